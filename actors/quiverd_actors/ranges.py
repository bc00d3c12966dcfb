"""Ranged reads of one shard for a subscriber: positions, spans, fetches, ack-through.

    STREAM connection (quiverd.net.consumers.serve_stream)
        open         → register ─ChangeSubscriber─▶ ack_logger; first_position
        latest       → span (segment table + staged verdicts, on the loop, no I/O)
        fetch        → picks (loop) → RangeFetch.frames (one worker hop per READ_BATCH)
        ack_through  → RecordOutcomes ─▶ ack_logger (Reply once durable)

A **position** ``(segment_seq, bundle_index)`` means "after that bundle": a range
``(after, through]`` holds every bundle whose ``(segment_seq, bundle_index)`` is greater
than ``after`` and at most ``through``. ``bundle_index`` may be -1: ``(s, -1)`` is just
before the first bundle of segment ``s``. Positions compare as tuples, so a range names
the same bundles whatever was acked or deleted since: a micro-batch re-run after a crash
reads the same bundles (those not deleted: a subscriber's unacked segments are retained,
except by ``drop_oldest`` or ``max_age`` retention, which records ``dropped`` for them;
``lost`` names what of a range was deleted, so the reader is told, never short-changed).
A range ending at a segment's last bundle ends at ``(s, END_OF_SEGMENT)``.

Only finalized segments are in the table, so a range never holds a bundle still in an
open segment. ``span`` stops before the first staged bundle whose job is undecided
(SPEC §7, verdict HOLD): it is published or discarded later, and a range must not change
its rows once handed out. Bundles a job discarded are skipped by ``picks``.

Nothing here changes the dispatcher's own state: these run in the connection's task and
only read the shard's ``AckState``, ``SegmentView`` and verdicts, or send requests to
the ack_logger, which applies them like any other.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from quiverd.acks import format as fmt
from quiverd.kernel.errors import AtCapacity, ShuttingDown
from quiverd.kernel.jobs import Verdict
from quiverd.kernel.reply import Reply
from quiverd.segments.reader import SegmentReader
from quiverd_actors.messages import ChangeSubscriber, RecordOutcomes

if TYPE_CHECKING:
    from quiverd_actors.dispatcher import Dispatcher, OutgoingDelivery

Position = tuple[int, int]  # (segment_seq, bundle_index): "after this bundle"
END_OF_SEGMENT = 0xFFFF_FFFF  # (s, END_OF_SEGMENT): after every bundle of segment s
FIRST_SEGMENT_SEQ = 1  # a shard's first segment (FLOOR starts at 0: "none yet")
READ_BATCH = 64  # bundles read per worker hop
ACK_BATCH = 4096  # outcomes per ack.log request
MAX_OPEN_READERS = 4  # segment readers one fetch keeps open


class HeldBundle(AtCapacity):
    """A fetch range holds a staged bundle whose job is undecided: retry later."""

    hint = "ranges come from `latest`, which stops before undecided bundles"


async def register(d: Dispatcher, name: str, start: str) -> None:
    """Register subscriber ``name`` on this shard (durable in its ack.log on return)."""
    reply: Reply[None] = Reply()
    await _to_ack_log(d, ChangeSubscriber(
        op="add", name=name, start="latest" if start == "latest" else "earliest", reply=reply))
    await reply.wait()


def first_position(d: Dispatcher, name: str) -> Position:
    """Just before ``name``'s oldest pending bundle, or after every finalized bundle."""
    for seg, idx in d.state.pending_for(name):
        return (seg, idx - 1)
    return (d.state.segment_floor, -1)


def span(d: Dispatcher, start: Position, *, cap: Position | None, limit: int
         ) -> tuple[Position, int]:
    """``(end, count)``: the longest range ``(start, end]`` of at most ``limit`` bundles
    (0: no limit), not beyond ``cap``, ending before the first undecided staged bundle.
    ``end == start`` when there is nothing new."""
    end, count = start, 0
    seqs = d.segments.seqs()
    for seg in seqs[bisect.bisect_left(seqs, start[0]):]:
        if cap is not None and seg > cap[0]:
            break
        info = d.segments.get(seg)
        if info is None:
            continue
        first = start[1] + 1 if seg == start[0] else 0
        last = info.bundle_count - 1
        if cap is not None and seg == cap[0]:
            last = min(last, cap[1])
        if limit:
            last = min(last, first + (limit - count) - 1)
        held = False
        if info.staged and d.verdict is not None:
            for idx in sorted(i for i in info.staged if first <= i <= last):
                if d.verdict(info.staged[idx]) is Verdict.HOLD:
                    last, held = idx - 1, True
                    break
        if last >= first:
            count += last - first + 1
            # A finalized segment never grows: its end is spelled (seg, END_OF_SEGMENT),
            # so a position (s, i) with i < END_OF_SEGMENT always has bundles of s after
            # it, and a start in a deleted segment says whether any were lost (``lost``).
            end = (seg, END_OF_SEGMENT if last == info.bundle_count - 1 else last)
        if held or (limit and count >= limit):
            break
    return end, count


def picks(d: Dispatcher, after: Position, through: Position, limit: int = READ_BATCH
          ) -> tuple[list[Position], Position]:
    """Up to ``limit`` bundles of ``(after, through]`` to send, oldest first, and the
    position the next call starts after (``through`` once the range is done).
    Discarded staged bundles are passed over; an undecided one raises HeldBundle."""
    out: list[Position] = []
    seqs = d.segments.seqs()
    for seg in seqs[bisect.bisect_left(seqs, after[0]):]:
        info = d.segments.get(seg)
        if seg > through[0] or info is None:
            break
        first = after[1] + 1 if seg == after[0] else 0
        stop = info.bundle_count - 1 if seg < through[0] else min(info.bundle_count - 1,
                                                                   through[1])
        for idx in range(first, stop + 1):
            ref = info.staged.get(idx) if info.staged else None
            if ref is not None and d.verdict is not None:
                verdict = d.verdict(ref)
                if verdict is Verdict.HOLD:
                    raise HeldBundle(f"shard {d.shard}: bundle ({seg}, {idx}) belongs to job "
                                     f"{ref.job_id!r}, not decided yet")
                if verdict is Verdict.DISCARD:
                    continue
            out.append((seg, idx))
            if len(out) >= limit:
                return out, (seg, idx)
    return out, through


def past_deleted(d: Dispatcher, start: Position, cap: Position | None) -> Position:
    """How far a range from ``start`` reaches over deleted segments alone: just before
    the next live segment (after the last finalized one if none), never beyond ``cap``,
    and ``start`` itself while the start's segment still has bundles after it."""
    info = d.segments.get(start[0])
    if info is not None and start[1] < info.bundle_count - 1:
        return start  # span stopped at an undecided bundle there: never pass it
    seqs = d.segments.seqs()
    i = bisect.bisect_right(seqs, start[0])
    upto = seqs[i] if i < len(seqs) else d.state.segment_floor
    end = (upto - 1, END_OF_SEGMENT)
    if cap is not None:
        end = min(end, cap)
    return max(start, end)


def lost(d: Dispatcher, after: Position, through: Position, *, dropped: bool
         ) -> list[dict[str, object]]:
    """Runs of deleted segments in ``(after, through]``: bundles of the range no fetch
    can deliver any more (retention's ``drop_oldest`` or ``max_age`` deleted them, or
    recovery found them gone). Segment numbers are handed out in order from 1 and never
    twice, so a number below the floor that is not in the table was finalized and
    deleted. (One exception, reported too: a number recovery skipped because that
    segment's file was quarantined and its bundles came back from the WAL into a later
    segment; a query that stops on it goes on with failOnDataLoss false.)

    A range never holds what its reader acked (its acks trail its start), so every
    deleted segment strictly inside is lost to it. The start's own segment is lost from
    ``(s, -1)``; from ``(s, i)`` with ``0 <= i < END_OF_SEGMENT`` (a range cut inside
    the segment) only when ``dropped`` (the subscriber had bundles dropped on this shard
    since the daemon started): offsets written before ends were spelled
    ``(s, END_OF_SEGMENT)`` end at ``(s, last)``, and that segment is deleted once acked.
    Each run is ``{"after": position, "through": position, "segments": [first, last]}``.
    O(live segments), no I/O."""
    hi = min(through[0] if through[1] >= 0 else through[0] - 1, d.state.segment_floor - 1)
    lo = after[0]
    if after[1] >= END_OF_SEGMENT or (after[1] >= 0 and not dropped):
        lo += 1
    lo = max(lo, FIRST_SEGMENT_SEQ)
    if lo > hi:
        return []
    runs: list[dict[str, object]] = []
    seqs = d.segments.seqs()
    expect = lo
    for seg in [*seqs[bisect.bisect_left(seqs, lo):bisect.bisect_right(seqs, hi)], hi + 1]:
        if seg > expect:
            first, last = expect, seg - 1
            start = after if first == after[0] else (first, -1)
            end = through if last == through[0] else (last, END_OF_SEGMENT)
            runs.append({"after": list(start), "through": list(end),
                         "segments": [first, last]})
        expect = seg + 1
    return runs


async def ack_through(d: Dispatcher, name: str, through: Position) -> int:
    """Ack every bundle ``name`` has pending up to ``through``; returns how many, once
    durable. (Bundles past it stay pending: Spark commits offsets it processed.)"""
    todo = _pending_until(d, name, through)
    for i in range(0, len(todo), ACK_BATCH):
        chunk = todo[i:i + ACK_BATCH]
        reply: Reply[tuple[Exception | None, ...]] = Reply()
        await _to_ack_log(d, RecordOutcomes(
            outcomes=tuple((name, seg, idx, fmt.ACK) for seg, idx in chunk), reply=reply))
        await reply.wait()
    return len(todo)


async def _to_ack_log(d: Dispatcher, request: ChangeSubscriber | RecordOutcomes) -> None:
    try:
        await d.ack_log.send(request)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        # The shard's pipeline is stopping: its dispatcher closed the stream.
        raise ShuttingDown(f"shard {d.shard} is stopping") from None


def _pending_until(d: Dispatcher, name: str, through: Position) -> list[Position]:
    out: list[Position] = []
    for seg, idx in d.state.pending_for(name):
        if (seg, idx) > through:
            break
        out.append((seg, idx))
    return out


class RangeFetch:
    """The segment readers of one fetch (worker threads, one at a time)."""

    def __init__(self, d: Dispatcher, client: str | None) -> None:
        self.d, self.client = d, client
        self.readers: OrderedDict[int, SegmentReader] = OrderedDict()
        # Segments deleted between the range's picks and their read (retention), each
        # with its first bundle not read: the rest is left out and the fetch's answer
        # names it.
        self.gone: dict[int, int] = {}

    async def frames(self, wanted: list[Position]) -> list[OutgoingDelivery]:
        """The DELIVERY frames of ``wanted`` whose client matches (one worker hop)."""
        paths = {seg: self.d.segments[seg].path for seg, _ in wanted if seg in self.d.segments}
        return await anyio.to_thread.run_sync(self._read, wanted, paths,
                                              limiter=self.d.limiter)

    def _read(self, wanted: list[Position], paths: dict[int, Path]
              ) -> list[OutgoingDelivery]:
        out: list[OutgoingDelivery] = []
        for seg, idx in wanted:
            path = paths.get(seg)
            if path is None or seg in self.gone:
                self.gone.setdefault(seg, idx)
                continue
            try:
                reader = self._reader(seg, path)
                if self.client is not None and reader.bundle_meta(idx).client != self.client:
                    continue
                out.append(self.d._frame(reader, seg, idx))
            except FileNotFoundError:
                self.gone.setdefault(seg, idx)
        return out

    def _reader(self, seg: int, path: Path) -> SegmentReader:
        reader = self.readers.get(seg)
        if reader is None:
            checks = self.d.checks
            reader = (SegmentReader.open(path) if checks is None
                      else checks.open_reader(seg, path))
            self.readers[seg] = reader
            while len(self.readers) > MAX_OPEN_READERS:
                self.readers.popitem(last=False)[1].close()
        return reader

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()  # frames already sent keep their mapping alive
        self.readers.clear()


__all__ = ["END_OF_SEGMENT", "HeldBundle", "Position", "RangeFetch", "ack_through",
           "first_position", "lost", "picks", "register", "span"]
