"""``shard-<n>/lost.json``: the losses a shard has already reported, so each is reported once.

    {"version": 1,
     "sequences": [[first, last], ...],          WAL sequence ranges reported lost
     "segments": [[segment_seq, bundle_count], ...],  gone segments reported lost
                                                 (bundle_count null: never recorded)
     "highest_sequence": N,                      the highest sequence ever reported lost:
                                                 never handed out again, even once gc
                                                 passed it (a refused bundle's sequence
                                                 is in no segment and no WAL entry)
     "never_acked": [[first, last], ...]}        WAL sequences a start found torn and
                                                 never acknowledged (a torn unsynced
                                                 write): never loss, also once the WAL
                                                 that showed it is released (optional;
                                                 dropped once gc's DELETED marker passes)

Written crash-safely (tmp → fsync → rename → fsync dir) after the loss was logged:
a crash in between reports it again, never not at all. Recovery rewrites it from what
is still lost at each start, so a range drops out once the gc's DELETED marker passes
it (bounded by the losses still on disk, and segments by ``MAX_SEGMENTS``). Missing:
nothing reported yet. Blocking: call from a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import msgspec

from quiverd.kernel.errors import CorruptRecord
from quiverd.segments.files import checked_write

VERSION = 1
MAX_SEGMENTS = 10_000  # gone segments remembered; the oldest are forgotten past this


class LostRecord(msgspec.Struct, frozen=True, kw_only=True):
    version: int = VERSION
    sequences: list[tuple[int, int]] = msgspec.field(default_factory=list)
    segments: list[tuple[int, int | None]] = msgspec.field(default_factory=list)
    highest_sequence: int = 0
    never_acked: list[tuple[int, int]] = msgspec.field(default_factory=list)


def read_lost(path: Path) -> LostRecord:
    """The record, or an empty one when absent. A damaged record is CorruptRecord: it
    only decides what is reported again, so the hint says it may be removed."""
    try:
        record = msgspec.json.decode(path.read_bytes(), type=LostRecord)
    except FileNotFoundError:
        return LostRecord()
    except (msgspec.DecodeError, OSError) as exc:
        raise CorruptRecord(str(path), 0, f"lost record unreadable: {exc}",
                            hint="delete it: known losses are then reported once more") \
            from exc
    if record.version != VERSION:
        raise CorruptRecord(str(path), 0, f"lost record version {record.version} is not "
                            f"{VERSION}", hint="read it with the build that wrote it, or "
                            "delete it: known losses are then reported once more")
    return record


def write_lost(path: Path, record: LostRecord) -> None:
    """Crash-safely; NotWritten when nothing changed (no space: try again),
    DurabilityLost after the rename."""
    checked_write(path, msgspec.json.encode(record), mode=0o644)


def add_sequences(path: Path, sequences: Iterable[int]) -> LostRecord:
    """Remember single sequences reported lost at run time (the finalizer's refusals).

    Must be durable before the WAL releases them: afterwards nothing else says these
    sequences were ever used. A damaged record is replaced (it only loses "known")."""
    try:
        record = read_lost(path)
    except CorruptRecord:
        record = LostRecord()
    extra = [(s, s) for s in sequences]
    record = LostRecord(sequences=sorted({*record.sequences, *extra}),
                        segments=record.segments,
                        highest_sequence=max([record.highest_sequence,
                                              *(hi for _, hi in extra)]))
    write_lost(path, record)
    return record
