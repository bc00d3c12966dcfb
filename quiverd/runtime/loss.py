"""Which acknowledged bundles no file holds any more: the loss report. Pure: no I/O.

Recovery and ``quiverd fsck`` both report loss through ``find_loss``. A shard numbers
its bundles 1, 2, 3, ... (the WAL's ``per_core_sequence``, +1 per bundle), and each
sequence is held by one of::

    segments/DELETED        every sequence <= it was deleted on purpose (gc, retention)
    segments/<seq>.qseg     [first_sequence, last_sequence] of each valid segment
    wal/                    the entries replay keeps

A sequence up to the highest one known that none of them holds is lost: a WAL entry
skipped as damage, or a bundle of a segment that is gone (quarantined, or listed by
ack.log but absent) whose WAL entries were already released. Segments hold
sequences in segment order, so a gone segment lies between its valid neighbours and
the lost sequences between them are its bundles; the WAL releases segments in order,
so when only some are lost they are the oldest. Above the newest valid segment, when
the WAL no longer reaches that far, the bundle counts ack.log recorded for the gone
segments say how far the lost sequences went (assuming, as the writer guarantees,
no sequence was skipped inside them).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import msgspec

from quiverd.kernel.ranges import complement as _complement
from quiverd.kernel.ranges import merge as _merge

Ranges = list[tuple[int, int]]
_MAX = 1 << 64  # above any u64 sequence


class SegmentSpan(Protocol):
    """What ``segments.table.SegmentInfo`` knows of a valid segment."""

    @property
    def segment_seq(self) -> int: ...
    @property
    def first_sequence(self) -> int: ...
    @property
    def last_sequence(self) -> int: ...


class LostSegment(msgspec.Struct, frozen=True, kw_only=True):
    """A gone segment whose bundles ``(shard, segment_seq, 0..bundle_count-1)`` are lost."""

    segment_seq: int
    bundle_count: int | None  # None: ack.log never recorded the segment


class Loss(msgspec.Struct, frozen=True, kw_only=True):
    sequences: Ranges  # lost WAL sequences, ascending, inclusive ranges
    segments: list[LostSegment]  # gone segments the lost sequences belonged to
    highest_sequence: int  # the highest sequence ever used, as far as the files tell

    @property
    def count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.sequences)

    def __bool__(self) -> bool:
        return bool(self.sequences or self.segments)


class Coverage:
    """The sequences valid segments and the DELETED marker hold (``replay.Coverage``)."""

    def __init__(self, segments: Iterable[SegmentSpan], deleted_sequence: int) -> None:
        spans = [(s.first_sequence, s.last_sequence) for s in segments]
        self.ranges = _merge(spans + ([(1, deleted_sequence)] if deleted_sequence > 0 else []))

    @property
    def high(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0

    def holds(self, sequence: int) -> bool:
        i = bisect.bisect_right(self.ranges, (sequence, _MAX)) - 1
        return i >= 0 and self.ranges[i][0] <= sequence <= self.ranges[i][1]

    def unheld(self, first: int, last: int) -> Ranges:
        return _complement(self.ranges, first, last)


def find_loss(*, segments: Sequence[SegmentSpan], deleted_sequence: int,
              wal_sequences: Iterable[int], gone: Mapping[int, int | None],
              never_acked: Iterable[tuple[int, int]] = ()) -> Loss:
    """Lost sequences and the gone segments they belonged to.

    ``gone`` maps the segment_seq of every segment that should exist but does not
    (quarantined now, or recorded by ack.log and absent) to its bundle count.
    ``never_acked``: WAL damage the commit records show was never synced (a torn
    unsynced write, ``quiverd.wal.commits``): no acknowledged bundle, so no loss.
    """
    wal = _runs(sorted(set(wal_sequences)))
    held = _merge([*Coverage(segments, deleted_sequence).ranges, *wal, *never_acked])
    newest = max(segments, key=lambda s: s.segment_seq, default=None)
    base = newest.last_sequence if newest is not None else deleted_sequence
    above = [n for q, n in gone.items() if newest is None or q > newest.segment_seq]
    top = max([deleted_sequence, base + sum(n or 0 for n in above),
               *(s.last_sequence for s in segments), *(hi for _, hi in wal)])
    lost = _complement(held, 1, top)
    # A gone segment ack.log never recorded, above every valid one: its size is unknown,
    # so its lost sequences cannot be told, but if nothing holds the sequence right
    # after the newest valid segment, its bundles are gone too.
    unknown_lost = bool(_complement(held, base + 1, base + 1))
    return Loss(sequences=lost, segments=_attribute(lost, segments, gone, top, unknown_lost),
                highest_sequence=top)


def _attribute(lost: Ranges, segments: Sequence[SegmentSpan], gone: Mapping[int, int | None],
               top: int, unknown_lost: bool) -> list[LostSegment]:
    """Gone segments whose window between valid neighbours lost sequences, oldest first."""
    order = sorted(segments, key=lambda s: s.segment_seq)
    windows: dict[tuple[int, int], list[int]] = {}
    for q in sorted(gone):
        below = [s.last_sequence for s in order if s.segment_seq < q]
        after = [s.first_sequence for s in order if s.segment_seq > q]
        window = (below[-1] + 1 if below else 1, after[0] - 1 if after else top)
        windows.setdefault(window, []).append(q)
    out: list[LostSegment] = []
    for (first, last), members in windows.items():
        missing = sum(hi - lo + 1 for lo, hi in _intersect(lost, first, last))
        if last == top and unknown_lost and missing <= 0:
            out += [LostSegment(segment_seq=q, bundle_count=None)
                    for q in members if gone[q] is None]
            continue
        for q in members:
            count = gone[q]
            if missing <= 0:
                break
            if count == 0:
                continue
            out.append(LostSegment(segment_seq=q, bundle_count=count))
            missing -= count if count is not None else missing
    return out


def split_known(loss: Loss, known_sequences: Ranges,
                known_segments: Iterable[int]) -> tuple[Loss, Loss]:
    """``loss`` as (new, known): what an earlier report already named is known."""
    known = _merge(known_sequences)
    old_seqs = [r for lo, hi in loss.sequences for r in _intersect(known, lo, hi)]
    new_seqs = [r for lo, hi in loss.sequences for r in _complement(known, lo, hi)]
    seen = set(known_segments)
    new = Loss(sequences=new_seqs, segments=[s for s in loss.segments
                                              if s.segment_seq not in seen],
               highest_sequence=loss.highest_sequence)
    old = Loss(sequences=old_seqs, segments=[s for s in loss.segments
                                              if s.segment_seq in seen],
               highest_sequence=loss.highest_sequence)
    return new, old


def remembered(loss: Loss, known_segments: Iterable[tuple[int, int | None]],
               max_segments: int) -> tuple[Ranges, list[tuple[int, int | None]]]:
    """What the lost record should hold after ``loss`` was reported: every range still
    lost (a range gc passed drops out), and the gone segments reported so far (newest
    ``max_segments``; none once no sequence is lost any more)."""
    if not loss.sequences:
        return [], [(s.segment_seq, s.bundle_count) for s in loss.segments][-max_segments:]
    segments = dict(known_segments)
    segments.update((s.segment_seq, s.bundle_count) for s in loss.segments)
    return _merge(loss.sequences), sorted(segments.items())[-max_segments:]


def _runs(sorted_values: list[int]) -> Ranges:
    """Consecutive values as inclusive ranges."""
    runs: Ranges = []
    for v in sorted_values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _intersect(ranges: Ranges, first: int, last: int) -> Ranges:
    return [(max(lo, first), min(hi, last)) for lo, hi in ranges if lo <= last and hi >= first]
