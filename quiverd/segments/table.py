"""A shard's live segment files: what each one holds, in one table with one owner.

The ack_logger owns the ``SegmentTable``: it adds a segment once its SEGMENT
record is durable in ack.log and removes it when the gc retires it, so the
table and ack.log never disagree. Every other reader (dispatcher, gc sweeper,
status) holds a ``SegmentView``, which has no way to change it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import msgspec


class StagedRef(msgspec.Struct, frozen=True, kw_only=True):
    """A bundle of a transactional write (SPEC §7): staged until its job is decided."""

    job_id: str
    partition: int
    attempt: int
    end_rows: int = -1  # >= 0: the attempt's end-of-partition marker (rows, checksum)
    end_checksum: int = 0

    @property
    def is_end(self) -> bool:
        return self.end_rows >= 0


class SegmentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One durable, read-only segment file."""

    segment_seq: int
    path: Path
    size_bytes: int
    bundle_count: int
    first_sequence: int  # WAL sequences of its first and last bundle
    last_sequence: int
    min_ts_ns: int
    max_ts_ns: int
    # bundle_index -> tag of every transactional bundle (most segments: none)
    staged: dict[int, StagedRef] = msgspec.field(default_factory=dict)


class _Rows:
    """What the table and its views share: the rows and their byte total."""

    def __init__(self, rows: Iterable[SegmentInfo]) -> None:
        self.by_seq = {s.segment_seq: s for s in rows}
        # Kept as rows come and go: the size cap reads it on every append.
        self.total_bytes = sum(s.size_bytes for s in self.by_seq.values())


class SegmentView:
    """Read-only: the live segments by sequence number, oldest first."""

    def __init__(self, shared: _Rows) -> None:
        self._shared = shared
        self._rows = shared.by_seq

    def __contains__(self, segment_seq: object) -> bool:
        return segment_seq in self._rows

    def __getitem__(self, segment_seq: int) -> SegmentInfo:
        return self._rows[segment_seq]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[SegmentInfo]:
        return iter(sorted(self._rows.values(), key=lambda s: s.segment_seq))

    def get(self, segment_seq: int) -> SegmentInfo | None:
        return self._rows.get(segment_seq)

    def seqs(self) -> list[int]:
        return sorted(self._rows)

    def total_bytes(self) -> int:
        return self._shared.total_bytes

    def bytes_from(self, segment_seq: int) -> int:
        """Bytes of the segments at or above ``segment_seq`` (a subscriber's lag)."""
        return sum(s.size_bytes for q, s in self._rows.items() if q >= segment_seq)


class SegmentTable(SegmentView):
    """The owner's handle (the ack_logger's): adds and removes rows."""

    def __init__(self, rows: Iterable[SegmentInfo] = (),
                 listener: TableListener | None = None) -> None:
        super().__init__(_Rows(rows))
        self.listener = listener  # told of every row that comes and goes (staging)
        if listener is not None:
            for info in self._rows.values():
                listener.add_segment(info)

    def view(self) -> SegmentView:
        return SegmentView(self._shared)

    def add(self, info: SegmentInfo) -> None:
        old = self._rows.get(info.segment_seq)
        self._shared.total_bytes += info.size_bytes - (old.size_bytes if old else 0)
        self._rows[info.segment_seq] = info
        if self.listener is not None:
            if old is not None:
                self.listener.remove_segment(old)
            self.listener.add_segment(info)

    def remove(self, segment_seq: int) -> SegmentInfo | None:
        info = self._rows.pop(segment_seq, None)
        if info is not None:
            self._shared.total_bytes -= info.size_bytes
            if self.listener is not None:
                self.listener.remove_segment(info)
        return info


class TableListener(Protocol):
    def add_segment(self, info: SegmentInfo) -> None: ...
    def remove_segment(self, info: SegmentInfo) -> None: ...
