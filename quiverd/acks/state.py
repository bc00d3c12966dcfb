"""Subscriber progress for one shard: marks, gap sets, nacks, deletable segments. No I/O.

Every change goes through two steps. A *proposal* method (``add_subscriber``,
``record_outcome``, ``segment_finalized``, ``drop_segment``, ...) validates against the
current state and returns ack.log records without changing anything. The caller
encodes and appends them, fdatasyncs ack.log, and only then calls ``apply`` on each.
``apply`` is the only mutation and is also what replay calls, so the live path and
recovery cannot diverge, and a mark is never ahead of the acks that are durable.

Marks. For each subscriber ``covered_below`` is the exclusive high-water mark: every
live segment below it has all bundles ``ack`` or ``dropped`` (segments below the
subscriber's start segment count as covered). It advances over live segments in
``segment_seq`` order and never passes a segment with a missing bundle; acks beyond it
wait in the subscriber's gap set, which only holds bundles of live segments at or above
the mark, so it is bounded by the live segments retention keeps (and, for acks past
the first unfinished segment, by ``max_gap_entries``).

Stale records are no-ops in ``apply`` (an ack for a deleted segment, a second ack of the
same bundle, a nack after an ack): that makes apply idempotent, so a record replayed
after a checkpoint that already includes it changes nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from quiverd.acks.format import (
    ACK,
    DROPPED,
    NACK,
    OP_ADD,
    OUTCOMES,
    REJECTED,
    Checkpoint,
    Outcome,
    Record,
    SegmentDeleted,
    SegmentFinalized,
    SubscriberChange,
    SubscriberCheckpoint,
)
from quiverd.acks.registry import DEFAULT_MAX_SUBSCRIBERS, Subscriber, SubscriberRegistry
from quiverd.kernel.errors import AtCapacity, QuiverError

# Out-of-order acks beyond the first unfinished segment, per subscriber. A consumer
# that keeps acking past a stuck bundle is stopped here instead of growing memory.
DEFAULT_MAX_GAP_ENTRIES = 1_000_000


class UnknownBundle(QuiverError, LookupError):
    """An outcome names a bundle that was never finalized (not merely already deleted)."""

    hint = "acks must name (segment_seq, bundle_index) pairs the daemon delivered"


class DropPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Synthetic ``dropped`` outcomes to make durable before a segment is deleted."""

    records: list[Outcome]
    dropped_by_subscriber: dict[str, int]  # bundles each subscriber never received


class Lag(msgspec.Struct, frozen=True, kw_only=True):
    segments_behind: int  # live segments at or above the mark
    bundles_pending: int  # bundles in them not yet acked or dropped
    gap_entries: int  # acked/dropped bundles waiting above the mark
    nacked_bundles: int


class Reconciliation(msgspec.Struct, frozen=True, kw_only=True):
    records: list[Record]  # SEGMENT / SEGMENT_DELETED records that match the disk
    orphans: list[int]  # segment files below the floor that ack.log already deleted


@dataclass(slots=True)
class _Cursor:
    covered_below: int
    done: dict[int, dict[int, int]] = field(default_factory=dict)  # seq -> idx -> outcome
    nacks: dict[int, dict[int, int]] = field(default_factory=dict)  # seq -> idx -> count
    gap_len: int = 0


class AckState:
    """Everything ack.log records for one shard, rebuilt by ``apply``."""

    def __init__(self, *, max_gap_entries: int = DEFAULT_MAX_GAP_ENTRIES,
                 max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS) -> None:
        self.registry = SubscriberRegistry(max_subscribers=max_subscribers)
        self._segments: dict[int, int] = {}  # live segment_seq -> bundle_count
        self._order: list[int] = []  # live segment_seqs, ascending
        self._floor = 0  # one past the highest segment_seq ever finalized
        self._cursors: dict[int, _Cursor] = {}
        self._max_gap = max_gap_entries

    # ---- the one mutation -------------------------------------------------------

    def apply(self, record: Record) -> None:
        """Apply one record that is already durable in ack.log (or being replayed)."""
        if isinstance(record, Outcome):
            self._apply_outcome(record)
        elif isinstance(record, SegmentFinalized):
            self._apply_segment(record.segment_seq, record.bundle_count)
        elif isinstance(record, SegmentDeleted):
            self._apply_deleted(record.segment_seq)
        elif isinstance(record, SubscriberChange):
            sub = self.registry.apply(record)
            if sub is not None and record.op == OP_ADD:
                cursor = self._cursors[sub.subscriber_id] = _Cursor(sub.start_segment)
                self._advance(cursor)
            elif sub is not None:
                # Dropping the cursor is what releases the subscriber's hold on segments.
                del self._cursors[sub.subscriber_id]
        else:
            self._apply_checkpoint(record)

    def _apply_outcome(self, rec: Outcome) -> None:
        cursor = self._cursors.get(rec.subscriber_id)
        count = self._segments.get(rec.segment_seq)
        seq, idx = rec.segment_seq, rec.bundle_index
        if cursor is None or count is None or seq < cursor.covered_below or idx >= count:
            return
        done = cursor.done.get(seq)
        if done is not None and idx in done:
            return  # the first final outcome wins; redelivery duplicates change nothing
        if rec.outcome == NACK:
            nacks = cursor.nacks.setdefault(seq, {})
            nacks[idx] = nacks.get(idx, 0) + 1
            return
        if done is None:
            done = cursor.done[seq] = {}
        done[idx] = rec.outcome
        cursor.gap_len += 1
        pending = cursor.nacks.get(seq)
        if pending is not None and pending.pop(idx, None) is not None and not pending:
            del cursor.nacks[seq]
        if len(done) == count:
            self._advance(cursor)

    def _apply_segment(self, seq: int, bundle_count: int) -> None:
        if seq in self._segments:
            return
        self._segments[seq] = bundle_count
        bisect.insort(self._order, seq)
        self._floor = max(self._floor, seq + 1)
        if bundle_count == 0:  # an empty segment is covered the moment it exists
            for cursor in self._cursors.values():
                self._advance(cursor)

    def _apply_deleted(self, seq: int) -> None:
        if self._segments.pop(seq, None) is None:
            return
        del self._order[bisect.bisect_left(self._order, seq)]
        for cursor in self._cursors.values():
            self._forget(cursor, seq)
            # A deleted segment no longer blocks anyone: the mark may move past it.
            self._advance(cursor)

    def _apply_checkpoint(self, cp: Checkpoint) -> None:
        self.registry.reset([Subscriber(subscriber_id=s.subscriber_id, name=s.name,
                                        start_segment=s.start_segment) for s in cp.subscribers],
                            cp.next_subscriber_id)
        self._segments = dict(cp.segments)
        self._order = sorted(self._segments)
        self._floor = max(cp.segment_floor, self._order[-1] + 1 if self._order else 0)
        self._cursors = {}
        for sub in cp.subscribers:
            cursor = self._cursors[sub.subscriber_id] = _Cursor(sub.covered_below)
            for seq, idx, outcome, nack_count in sub.entries:
                if outcome == NACK:
                    cursor.nacks.setdefault(seq, {})[idx] = nack_count
                else:
                    cursor.done.setdefault(seq, {})[idx] = outcome
                    cursor.gap_len += 1
            self._advance(cursor)

    def _advance(self, cursor: _Cursor) -> None:
        i = bisect.bisect_left(self._order, cursor.covered_below)
        while i < len(self._order):
            seq = self._order[i]
            done = cursor.done.get(seq)
            if (len(done) if done else 0) < self._segments[seq]:
                return
            cursor.covered_below = seq + 1
            self._forget(cursor, seq)
            i += 1

    @staticmethod
    def _forget(cursor: _Cursor, seq: int) -> None:
        done = cursor.done.pop(seq, None)
        if done:
            cursor.gap_len -= len(done)
        cursor.nacks.pop(seq, None)

    # ---- proposals: validate, build records, change nothing ----------------------

    def add_subscriber(self, name: str,
                       from_: Literal["earliest", "latest"] = "earliest") -> SubscriberChange:
        """``latest`` starts after every segment finalized so far; ``earliest`` at 0."""
        if from_ not in ("earliest", "latest"):
            raise ValueError(f"from_ must be 'earliest' or 'latest', not {from_!r}")
        return self.registry.propose_add(name, self._floor if from_ == "latest" else 0)

    def remove_subscriber(self, name: str) -> SubscriberChange:
        return self.registry.propose_remove(name)

    def record_outcome(self, sub: str, segment_seq: int, bundle_index: int,
                       outcome: int) -> Outcome | None:
        """The record for a consumer's ack, nack or reject, or the dispatcher's ``dropped``
        for a staged bundle its job discarded (SPEC §7); None when it would change nothing.
        A reject is final like an ack (the bundle is done for this subscriber, never
        delivered to it again); the first final outcome wins."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be ack, nack, dropped or rejected, not {outcome}")
        subscriber = self.registry.get(sub)
        cursor = self._cursors[subscriber.subscriber_id]
        count = self._segments.get(segment_seq)
        if count is None and segment_seq < self._floor:
            return None  # already deleted: a late duplicate
        if count is None or not 0 <= bundle_index < count:
            raise UnknownBundle(f"bundle ({segment_seq}, {bundle_index}) was never finalized")
        done = cursor.done.get(segment_seq)
        if segment_seq < cursor.covered_below or (done is not None and bundle_index in done):
            return None
        if (outcome in (ACK, REJECTED) and cursor.gap_len >= self._max_gap
                and segment_seq != self._frontier(cursor)):
            raise AtCapacity(f"subscriber {sub!r} has {cursor.gap_len} acks waiting behind an "
                             "unacked bundle; ack the oldest pending bundle first")
        return Outcome(segment_seq=segment_seq, bundle_index=bundle_index,
                       subscriber_id=subscriber.subscriber_id, outcome=outcome)

    def segment_finalized(self, segment_seq: int, bundle_count: int) -> SegmentFinalized:
        """Segments must be announced in increasing order, after their file is durable."""
        if segment_seq < self._floor:
            raise ValueError(f"segment {segment_seq} is below the floor {self._floor}: "
                             "segments must be finalized in increasing order")
        return SegmentFinalized(segment_seq=segment_seq, bundle_count=bundle_count)

    def segment_deleted(self, segment_seq: int) -> SegmentDeleted:
        return SegmentDeleted(segment_seq=segment_seq)

    def drop_segment(self, segment_seq: int) -> DropPlan:
        """``dropped`` outcomes for every bundle of the segment some subscriber lacks."""
        records: list[Outcome] = []
        counts: dict[str, int] = {}
        count = self._segments.get(segment_seq)
        for sub in self.registry:
            cursor = self._cursors[sub.subscriber_id]
            if count is None or segment_seq < cursor.covered_below:
                continue
            done = cursor.done.get(segment_seq, {})
            missing = [i for i in range(count) if i not in done]
            records += [Outcome(segment_seq=segment_seq, bundle_index=i,
                                subscriber_id=sub.subscriber_id, outcome=DROPPED)
                        for i in missing]
            if missing:
                counts[sub.name] = len(missing)
        return DropPlan(records=records, dropped_by_subscriber=counts)

    def reconcile(self, on_disk: Mapping[int, int]) -> Reconciliation:
        """Records that make ack.log agree with the segment files found at startup.

        ``on_disk`` maps segment_seq -> bundle_count of every valid segment file. A
        crash can fall between a segment's rename and its SEGMENT record, or between
        unlinking a file and its SEGMENT_DELETED record; this closes both windows.
        """
        records: list[Record] = []
        for seq in sorted(on_disk):
            if seq not in self._segments and seq >= self._floor:
                records.append(SegmentFinalized(segment_seq=seq, bundle_count=on_disk[seq]))
        records += [SegmentDeleted(segment_seq=s) for s in self._order if s not in on_disk]
        orphans = sorted(s for s in on_disk if s not in self._segments and s < self._floor)
        return Reconciliation(records=records, orphans=orphans)

    def checkpoint_record(self) -> Checkpoint:
        """The whole state as one record; equal states give equal checkpoints."""
        subs = []
        for sub in self.registry:
            cursor = self._cursors[sub.subscriber_id]
            entries = [(s, i, o, 0) for s, d in cursor.done.items() for i, o in d.items()]
            entries += [(s, i, NACK, n) for s, d in cursor.nacks.items() for i, n in d.items()]
            subs.append(SubscriberCheckpoint(
                subscriber_id=sub.subscriber_id, name=sub.name, start_segment=sub.start_segment,
                covered_below=cursor.covered_below, entries=tuple(sorted(entries))))
        return Checkpoint(segment_floor=self._floor, next_subscriber_id=self.registry.next_id,
                          segments=tuple((s, self._segments[s]) for s in self._order),
                          subscribers=tuple(subs))

    # ---- queries ------------------------------------------------------------------

    @property
    def segment_floor(self) -> int:
        return self._floor

    def live_segments(self) -> dict[int, int]:
        """segment_seq -> bundle_count of every segment ack.log considers present."""
        return {s: self._segments[s] for s in self._order}

    def deletable_segments(self) -> list[int]:
        """Live segments every registered subscriber's mark covers (none without subscribers)."""
        if not self._cursors:
            return []
        lowest = min(c.covered_below for c in self._cursors.values())
        return self._order[: bisect.bisect_left(self._order, lowest)]

    def high_water_mark(self, sub: str) -> int | None:
        """Highest segment_seq covered for ``sub`` (inclusive), None if none is yet."""
        covered_below = self._cursor(sub).covered_below
        return covered_below - 1 if covered_below > 0 else None

    def covered_below(self, sub: str) -> int:
        return self._cursor(sub).covered_below

    def gap_set(self, sub: str) -> set[tuple[int, int]]:
        return {(s, i) for s, d in self._cursor(sub).done.items() for i in d}

    def is_done(self, sub: str, segment_seq: int, bundle_index: int) -> bool:
        """Has ``sub`` acked (or had dropped) this bundle? (A deleted segment's bundles
        below the mark count as done; one never finalized does not.)"""
        cursor = self._cursor(sub)
        if segment_seq < cursor.covered_below:
            return True
        done = cursor.done.get(segment_seq)
        return done is not None and bundle_index in done

    def nack_count(self, sub: str, segment_seq: int, bundle_index: int) -> int:
        return self._cursor(sub).nacks.get(segment_seq, {}).get(bundle_index, 0)

    def pending_for(self, sub: str) -> Iterator[tuple[int, int]]:
        """Bundles ``sub`` has neither acked nor had dropped, oldest first (lazy)."""
        cursor = self._cursor(sub)
        for seq in self._order[bisect.bisect_left(self._order, cursor.covered_below):]:
            done = cursor.done.get(seq, {})
            for idx in range(self._segments.get(seq, 0)):
                if idx not in done:
                    yield seq, idx

    def lag(self, sub: str) -> Lag:
        cursor = self._cursor(sub)
        behind = self._order[bisect.bisect_left(self._order, cursor.covered_below):]
        bundles = sum(self._segments[s] for s in behind)
        return Lag(segments_behind=len(behind), bundles_pending=bundles - cursor.gap_len,
                   gap_entries=cursor.gap_len,
                   nacked_bundles=sum(len(d) for d in cursor.nacks.values()))

    def _cursor(self, sub: str) -> _Cursor:
        return self._cursors[self.registry.get(sub).subscriber_id]

    def _frontier(self, cursor: _Cursor) -> int | None:
        i = bisect.bisect_left(self._order, cursor.covered_below)
        return self._order[i] if i < len(self._order) else None
