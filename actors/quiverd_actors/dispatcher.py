"""Dispatcher: one per shard. Delivers finalized bundles to attached subscribers.

    ack_logger ──(Changes)──▶ dispatcher ──Delivery──▶ subscriber sessions (sockets)
                                   │  ◀──Feedback── the sessions' acks / nacks (its inbox)
                                   └──RecordOutcome(s)──▶ ack_logger (Reply given once durable)

For every attached session it walks ``AckState.pending_for(name)`` oldest
first and sends what is neither in flight nor waiting out a nack backoff, up
to the session's window. Bundles are read from the segment files in one worker
hop per batch. A socket session gets each bundle as a ready DELIVERY frame whose
slot payloads are the stored IPC messages, sliced from the memory-mapped segment
file (schema, dictionaries, record batches, EOS: nothing decoded or re-encoded);
only a bundle whose dictionaries were remapped at finalize is decoded, restored
and re-encoded. The in-process uploader (``local``) gets decoded tables, and with
``preview`` each staged bundle of an undecided job too, once (``staged=True``: not in
flight, no outcome expected), so a job's rows become Parquet while it still writes.

A nack is redelivered after ``base * 2**n`` (capped) with jitter; a session that
goes away gives its in-flight bundles back, so they are delivered again on
reconnect: delivery is at least once, and ids ``(shard, segment_seq,
bundle_index)`` let consumers deduplicate.

Acks and nacks arrive as ``Feedback`` messages in the dispatcher's inbox
(``quiverd_actors.feedback``); each pass applies all queued at once (the
window's room comes back then) and sends their outcomes to the ack_logger as one
request. An outcome stays in flight until the ack_logger's reply says it is
durable (the same commit wakes this actor through ``Changes``): then the bundle
leaves flight, and a nacked one waits out its backoff. The segment table is read
only (``SegmentView``): the ack_logger lists and retires segments.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pyarrow as pa
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectSendStream

from quiverd.acks import format as fmt
from quiverd.acks.state import AckState
from quiverd.kernel.changes import Changes
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.jobs import Verdict
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import DispatchMetrics
from quiverd.kernel.reply import Reply
from quiverd.protocol.frames import encode_delivery_parts
from quiverd.segments.reader import SegmentReader
from quiverd.segments.table import SegmentView, StagedRef
from quiverd_actors.feedback import FeedbackInbox, Outcome, OutcomeBatch
from quiverd_actors.messages import AckLogRequest, Feedback, LocalDelivery, RecordOutcome
from quiverd_actors.segment_checks import SegmentChecks
from quiverd_actors.sessions import OutgoingDelivery, Session

BACKOFF_BASE_S = 0.1
BACKOFF_MAX_S = 30.0
MAX_OPEN_READERS = 8
READ_BATCH = 64


@dataclass
class Dispatcher:
    shard: int
    state: AckState
    segments: SegmentView
    ack_log: MemoryObjectSendStream[AckLogRequest]
    changes: Changes
    limiter: CapacityLimiter
    log: Logger
    stats: DispatchMetrics
    sessions: list[Session] = field(default_factory=list)
    # (subscriber, segment_seq, bundle_index) -> session holding it
    inflight: dict[tuple[str, int, int], Session] = field(default_factory=dict)
    backoff: dict[tuple[str, int, int], float] = field(default_factory=dict)  # -> not before
    delivered_once: set[tuple[str, int, int]] = field(default_factory=set)
    readers: OrderedDict[int, SegmentReader] = field(default_factory=OrderedDict)
    unreadable: set[int] = field(default_factory=set)  # segments already reported
    awaiting: list[OutcomeBatch] = field(default_factory=list)  # outcomes not yet settled
    # Staged bundles (SPEC §7): what to do with one; None delivers them like any other.
    verdict: Callable[[StagedRef], Verdict] | None = None
    checks: SegmentChecks | None = None  # None: every open checks the whole file
    preview: bool = False  # local sessions get held staged bundles early (lake.convert_staged)
    # Per local session, the held bundles it was given early: segment -> indexes.
    _previewed: dict[Session, dict[int, set[int]]] = field(default_factory=dict)
    _to_preview: list[tuple[int, int]] = field(default_factory=list)  # found by _pick
    discarding: dict[tuple[str, int, int], Reply[None]] = field(default_factory=dict)
    _to_discard: list[tuple[int, int]] = field(default_factory=list)  # found by _pick
    # Per session, where its last pick scan met the first pending bundle not in
    # flight: every bundle before it was in flight then and stays so until it leaves
    # ``inflight`` (settled or detached: ``_rescan`` moves the mark back). Without it
    # every wake-up walked a wide window's in-flight bundles again (the uploader holds
    # thousands), which cost the event loop a quarter of its time.
    _scan_from: dict[Session, tuple[int, int]] = field(default_factory=dict)
    inbox: FeedbackInbox = field(init=False)

    def __post_init__(self) -> None:
        self.inbox = FeedbackInbox(self.changes)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Deliver whenever state, sessions or backoff timers change; runs until cancelled."""
        task_status.started()
        try:
            async with self.ack_log:
                await self._loop()
        finally:
            self.inbox.close()
            for session in list(self.sessions):
                self.detach(session)

    async def _loop(self) -> None:
        try:
            while True:
                version = self.changes.version
                await self._take_feedback()
                self._settle()
                if await self._fill():
                    # A full read batch went out and windows may have room for more:
                    # go on now (a wake-up would only come with the next ack or segment).
                    await anyio.lowlevel.checkpoint()
                    continue
                with anyio.move_on_after(self._next_backoff_s()):
                    await self.changes.wait_beyond(version)
        finally:
            for reader in self.readers.values():
                reader.close()
            self.readers.clear()

    # ---- sessions (called by the connection's task) -------------------------------
    def attach(self, session: Session) -> None:
        self.sessions.append(session)
        session.wakers.append(self.changes)
        self.stats.sessions.set(len(self.sessions))
        self.changes.notify()

    def detach(self, session: Session) -> None:
        session.closed = True
        if session in self.sessions:
            self.sessions.remove(session)
        self._scan_from.pop(session, None)
        self._previewed.pop(session, None)
        for key in [k for k, s in self.inflight.items() if s is session]:
            del self.inflight[key]  # pending again: redelivered to the next session
            self._rescan(key)
        self.stats.sessions.set(len(self.sessions))
        self.changes.notify()

    async def post(self, fb: Feedback) -> None:
        """Queue a session's acks and nacks for this shard; applied by the next pass."""
        await self.inbox.post(fb)

    async def feedback(self, session: Session, segment_seq: int, bundle_index: int,
                       outcome: int) -> None:
        """One ack or nack, queued as a Feedback of its own (no yield while there is room,
        so a sender's run of calls is applied in one pass)."""
        await self.inbox.post(Feedback(session=session,
                                       outcomes=((segment_seq, bundle_index, outcome),)))

    # ---- feedback (in this task only) ---------------------------------------------
    async def _take_feedback(self) -> None:
        """Apply every queued Feedback: the window's room comes back now, the outcomes
        go to the ack_logger as one request and stay in flight until it is durable."""
        batch = self.inbox.take()
        if not batch:
            return
        items: list[Outcome] = []
        freed: dict[int, Session] = {}
        counts: Counter[tuple[str, int]] = Counter()
        for fb in batch:
            session = fb.session
            for seg, idx, outcome in fb.outcomes:
                key = (session.name, seg, idx)
                if self.inflight.get(key) is session:
                    session.unacked -= 1  # the bundle stays in flight until settled
                    freed[id(session)] = session
                counts[(session.name, outcome)] += 1
                items.append(Outcome(key=key, session=session, outcome=outcome))
        for (name, outcome), n in counts.items():
            counter = (self.stats.nacks if outcome == fmt.NACK else
                       self.stats.rejects if outcome == fmt.REJECTED else self.stats.acks)
            counter(name).inc(n)
        for session in freed.values():
            session.room_freed()  # every shard of a shared window may refill now
        pending, request = OutcomeBatch.of(items)
        self.awaiting.append(pending)
        await self.ack_log.send(request)

    def _settle(self) -> None:
        """Outcomes the ack_logger made durable leave flight; a nack starts its backoff."""
        for key in [k for k, r in self.discarding.items() if r.done]:
            del self.discarding[key]
        still: list[OutcomeBatch] = []
        for batch in self.awaiting:
            if not batch.reply.done:
                still.append(batch)
                continue
            ignored: dict[str, list[tuple[Outcome, Exception]]] = {}
            for item, error in zip(batch.items, batch.errors(), strict=True):
                self._settle_one(item)
                if error is not None:
                    ignored.setdefault(item.session.name, []).append((item, error))
            for name, refused in ignored.items():  # one line per subscriber and batch
                first, error = refused[0]
                self.log.info("subscriber_feedback_ignored", subscriber=name,
                              segment_seq=first.key[1], bundle_index=first.key[2],
                              error=str(error), outcomes=len(refused))
        self.awaiting = still

    def _settle_one(self, item: Outcome) -> None:
        session, key = item.session, item.key
        if self.inflight.get(key) is session:
            del self.inflight[key]
            self._rescan(key)
        if item.outcome == fmt.NACK:
            n = (self.state.nack_count(*key) if session.name in self.state.registry else 1)
            delay = min(BACKOFF_BASE_S * 2 ** max(n - 1, 0), BACKOFF_MAX_S)
            self.backoff[key] = anyio.current_time() + delay * random.uniform(0.5, 1.0)
        else:
            self.backoff.pop(key, None)

    # ---- delivery ---------------------------------------------------------------
    def _next_backoff_s(self) -> float:
        """Until the next backoff ends; a backoff already over wakes no one again."""
        now = anyio.current_time()
        ahead = [t for t in self.backoff.values() if t > now]
        return min(ahead) - now + 0.001 if ahead else float("inf")

    async def _fill(self) -> bool:
        """Deliver one read batch per session with room; True if any batch was full."""
        more = False
        for session in list(self.sessions):
            if session.name not in self.state.registry:
                session.end(f"subscriber {session.name!r} was removed")
                self._forget(session.name)
                continue
            if session.room <= 0:
                continue
            picks = self._pick(session)
            await self._discard(session.name)
            if picks:
                sent = await self._deliver(session, picks)
                # Only a full batch that went out may leave more to send; unreadable
                # picks (a segment being deleted) must not spin the loop.
                more = more or sent == READ_BATCH
            if self._to_preview:
                more = await self._preview(session) == READ_BATCH or more
        return more

    async def _preview(self, session: Session) -> int:
        """Hand the local session the held bundles ``_pick`` found, each once; returns
        how many went. One that does not fit its stream now is offered again later."""
        picks, self._to_preview = self._to_preview, []
        paths = {seg: self.segments[seg].path for seg, _ in picks if seg in self.segments}
        picks = [p for p in picks if p[0] in paths]
        live = set(self.segments.seqs())
        got = await anyio.to_thread.run_sync(self._read, picks, paths, live, True, True,
                                             limiter=self.limiter)
        seen = self._previewed.setdefault(session, {})
        sent = 0
        for (seg, idx), d in zip(picks, got, strict=True):
            if d is None or session.closed:
                continue
            try:
                session.deliveries.send_nowait(d)  # type: ignore[arg-type]
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                break
            seen.setdefault(seg, set()).add(idx)
            sent += 1
        return sent

    def _forget(self, name: str) -> None:
        """A removed subscriber's backoff timers go with it."""
        for key in [k for k in self.backoff if k[0] == name]:
            del self.backoff[key]

    def _rescan(self, key: tuple[str, int, int]) -> None:
        """Bundle ``key`` left flight: scans of its subscriber must reach it again."""
        name, seg, idx = key
        for session, mark in self._scan_from.items():
            if session.name == name and (seg, idx) < mark:
                self._scan_from[session] = (seg, idx)

    def _pick(self, session: Session) -> list[tuple[int, int]]:
        now = anyio.current_time()
        picks: list[tuple[int, int]] = []
        self._to_discard = []
        limit = min(session.room, READ_BATCH)
        mark_seg, mark_idx = self._scan_from.get(session, (-1, -1))
        self._to_preview = []
        seen: dict[int, set[int]] | None = None
        if self.preview and session.local:
            seen = self._previewed.setdefault(session, {})
            for gone in [s for s in seen if s not in self.segments]:
                del seen[gone]
        first_free: tuple[int, int] | None = None
        last = (mark_seg, mark_idx)
        for seg, idx in self.state.pending_for(session.name):
            if seg < mark_seg or (seg == mark_seg and idx < mark_idx):
                continue  # in flight at the last scan, and nothing left flight since
            if len(picks) >= limit:
                break
            last = (seg, idx + 1)
            key = (session.name, seg, idx)
            if key in self.inflight:
                continue
            if self.backoff.get(key, 0.0) > now:
                first_free = first_free or (seg, idx)
                continue
            # Picks go into flight (``_deliver`` rescans those that do not); anything
            # else passed over here stays free, so the next scan starts at it.
            first_free = first_free or (seg, idx)
            info = self.segments.get(seg)
            if info is None:
                continue  # being deleted or quarantined
            ref = info.staged.get(idx) if info.staged else None
            if ref is not None and self.verdict is not None:
                verdict = self.verdict(ref)
                if verdict is Verdict.HOLD:
                    # Its job is undecided: nobody sees it yet, but the uploader may
                    # start on its rows (published only once the job commits them).
                    if (seen is not None and len(self._to_preview) < READ_BATCH
                            and idx not in seen.get(seg, ())):
                        self._to_preview.append((seg, idx))
                    continue
                if verdict is Verdict.DISCARD:
                    if key not in self.discarding and len(self._to_discard) < READ_BATCH:
                        self._to_discard.append((seg, idx))
                    continue
            picks.append((seg, idx))
            if first_free == (seg, idx):
                first_free = None
        self._scan_from[session] = first_free or last
        return picks

    async def _discard(self, name: str) -> None:
        """Staged bundles that will never be published: ``dropped`` for this subscriber."""
        for seg, idx in self._to_discard:
            reply: Reply[None] = Reply()
            self.discarding[(name, seg, idx)] = reply
            self.stats.discarded(name).inc()
            await self.ack_log.send(RecordOutcome(subscriber=name, segment_seq=seg,
                                                  bundle_index=idx, outcome=fmt.DROPPED,
                                                  reply=reply))
        self._to_discard = []

    async def _deliver(self, session: Session, picks: list[tuple[int, int]]) -> int:
        """Send what can be read of ``picks``; returns how many went out. Picks that
        did not go into flight are scanned again next time."""
        try:
            return await self._send(session, picks)
        finally:
            for seg, idx in picks:
                if (session.name, seg, idx) not in self.inflight:
                    self._rescan((session.name, seg, idx))

    async def _send(self, session: Session, picks: list[tuple[int, int]]) -> int:
        paths = {seg: self.segments[seg].path for seg, _ in picks}
        live = set(self.segments.seqs())
        frames = await anyio.to_thread.run_sync(self._read, picks, paths, live,
                                                session.local, limiter=self.limiter)
        sent = 0
        for (seg, idx), frame in zip(picks, frames, strict=True):
            key = (session.name, seg, idx)
            if session.closed:
                return sent
            if frame is None:
                # Deleted while we read it (retention), or unreadable: say so once.
                if seg in self.segments and seg not in self.unreadable:
                    self.unreadable.add(seg)
                    self.log.error("segment_unreadable", segment_seq=seg,
                                   hint="run `quiverd fsck` on the data directory")
                continue
            try:
                session.deliveries.send_nowait(frame)  # type: ignore[arg-type]
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return sent
            self.inflight[key] = session
            session.unacked += 1
            sent += 1
            self.backoff.pop(key, None)
            self.stats.delivered(session.name).inc()
            if key in self.delivered_once:
                self.stats.redelivered(session.name).inc()
            else:
                self.delivered_once.add(key)
                if len(self.delivered_once) > 1_000_000:
                    self.delivered_once.clear()  # only feeds the redelivery counter
        return sent

    def _read(self, picks: list[tuple[int, int]], paths: dict[int, Path], live: set[int],
              local: bool, staged: bool = False
              ) -> list[OutgoingDelivery | LocalDelivery | None]:
        """Read (and for a socket, frame) the picked bundles (worker thread; owns the
        reader cache)."""
        for seg in [s for s in self.readers if s not in live]:
            self.readers.pop(seg).close()  # deleted by the gc: release the mapping
        out: list[OutgoingDelivery | LocalDelivery | None] = []
        for seg, idx in picks:
            try:
                reader = self._reader(seg, paths[seg])
                if local:
                    b = reader.bundle(idx)
                    out.append(LocalDelivery(
                        shard=self.shard, segment_seq=seg, bundle_index=idx, client=b.client,
                        txn=b.txn, ingestion_ts_ns=b.ingestion_ts_ns, tables=b.slots,
                        staged=staged))
                else:
                    out.append(self._frame(reader, seg, idx))
            except (OSError, CorruptRecord):
                out.append(None)
        return out

    def _frame(self, reader: SegmentReader, seg: int, idx: int) -> OutgoingDelivery:
        """Bundle ``idx`` as a DELIVERY frame. Its slots are the segment's stored IPC
        messages when they are exactly what the producer sent; otherwise (remapped
        dictionaries) the bundle is restored and each slot encoded anew."""
        stored = reader.stored_slots(idx)
        if stored is not None:
            b = reader.bundle_meta(idx)
            slots = [(s.slot, s.rows, s.parts) for s in stored]
        else:
            b = reader.bundle(idx)
            slots = [(slot, table.num_rows, (_ipc_stream(table),))
                     for slot, table in sorted(b.slots.items())]
        parts = encode_delivery_parts(
            shard=self.shard, segment_seq=seg, bundle_index=idx, client=b.client, txn=b.txn,
            ingestion_ts_ns=b.ingestion_ts_ns, slots=slots)
        return OutgoingDelivery(shard=self.shard, segment_seq=seg, bundle_index=idx,
                                parts=tuple(parts))

    def _reader(self, seg: int, path: Path) -> SegmentReader:
        reader = self.readers.get(seg)
        if reader is None:
            # A segment recovery did not check in full gets its whole-file CRC here,
            # before its first delivery (a bad one is reported for quarantine).
            reader = (SegmentReader.open(path) if self.checks is None
                      else self.checks.open_reader(seg, path))
            self.readers[seg] = reader
            while len(self.readers) > MAX_OPEN_READERS:
                self.readers.popitem(last=False)[1].close()
        self.readers.move_to_end(seg)
        return reader


def _ipc_stream(table: pa.Table) -> memoryview:
    """One IPC stream holding ``table``, batch boundaries kept (no copy to bytes)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return memoryview(sink.getvalue())


__all__ = ["Dispatcher", "OutgoingDelivery", "Session"]
