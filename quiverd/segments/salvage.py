"""Finalizing around bundles that passed validation but make finalize raise.

Ingest validates every payload, yet a bundle can still break the segment encoder (an
Arrow edge case, a bug). Raising would stop the shard, and replay would bring the same
bundle back at the next start: a crash loop. Instead the finalizer rebuilds the
segment without the bundles that refuse, which are reported lost with their ids and
whose WAL entries are copied to ``quarantine/`` (``refused-<sequence:016>.walentry``)::

    encode(segment) raises ─▶ each bundle encoded alone: those that raise refuse
                            ─▶ the rest together; if that still raises (bundles that
                               only fail in company), add them one at a time, keeping
                               each one the segment still encodes with
                            ─▶ the segment of the bundles kept (possibly none)

Bundles are rebuilt from their WAL entries (still unreleased: the WAL region goes
only once the segment is durable). I/O errors and CorruptRecord are not refusals:
they propagate. Blocking: runs in the finalizer's worker thread, on the error path only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from quiverd.kernel.bundle import Bundle, Slot
from quiverd.kernel.errors import QuiverError
from quiverd.segments.format import Piece
from quiverd.segments.open_segment import OpenSegment

Encode = Callable[[OpenSegment], list[Piece]]


class WalSource(Protocol):
    """What ``wal.files.WalFiles`` offers for unreleased entries."""

    def read_slots(self, sequences: list[int]) -> dict[int, tuple[Slot, ...]]: ...
    def entry_bytes(self, sequences: list[int]) -> dict[int, bytes]: ...


def is_refusal(exc: BaseException) -> bool:
    """An exception that says "this data does not encode", not "the disk failed"."""
    return isinstance(exc, Exception) and not isinstance(exc, OSError | QuiverError)


def without_refused(segment: OpenSegment, source: WalSource, encode: Encode
                    ) -> tuple[OpenSegment, dict[int, str]]:
    """``segment`` rebuilt without the bundles that make ``encode`` raise, and those
    bundles' sequences with the error each raised."""
    sequences = [e.sequence for e in segment.entries]
    slots = source.read_slots(sequences)
    bundles = [Bundle(client=e.client, slots=slots[e.sequence], txn=e.txn,
                      ingestion_ts_ns=e.ingestion_ts_ns, sequence=e.sequence)
               for e in segment.entries]
    refused: dict[int, str] = {}
    for b in bundles:
        if (error := _fails(encode, [b])) is not None:
            refused[b.sequence] = error
    kept = [b for b in bundles if b.sequence not in refused]
    if kept and _fails(encode, kept) is not None:
        kept, together = [], kept
        for b in together:
            if (error := _fails(encode, [*kept, b])) is not None:
                refused[b.sequence] = f"only with other bundles: {error}"
            else:
                kept.append(b)
    return _segment(kept), refused


def _fails(encode: Encode, bundles: list[Bundle]) -> str | None:
    """The error building and encoding ``bundles`` raises, or None."""
    try:
        encode(_segment(bundles))
    except Exception as exc:
        if not is_refusal(exc):
            raise
        return f"{type(exc).__name__}: {exc}"
    return None


def _segment(bundles: list[Bundle]) -> OpenSegment:
    segment = OpenSegment()
    for b in bundles:
        segment.add(b)
    return segment
