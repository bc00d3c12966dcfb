"""WAL writer: one per shard. Consumes AppendRequests, produces DurableBatches.

    producers ──AppendRequest──▶ wal_writer ──DurableBatch──▶ segment_builder
                                    ▲  │ protocol Ack / Error (per connection)
    finalizer ──WalReleased─────────┘  ▼

Each append batch is encoded and written in one worker-thread hop. Acks leave
only after the fdatasync that covers the entry returned:

- ``always``:   write + fdatasync in the same hop, then ack the batch.
- ``interval``: group commit. One fdatasync covers every append written before
  it started, and exactly those entries are acked after it returns. It starts
  when the timer fires (``flush_interval_ms`` after the last sync), when the
  inbox runs empty (no more appends are queued, so waiting adds only latency),
  or, in the same worker hop as the write, once ``flush_bytes`` are unsynced.
- ``never``:    ack after the write (tests and benchmarks only).

A failed fdatasync raises DurabilityLost: nothing it covered is acked, the
shard's task group fails and the daemon exits non-zero (systemd restarts it,
replay recovers what was durable). It is never retried.

A full disk (ENOSPC, EDQUOT, or less than ``disk_reserve_bytes`` free) is
backpressure. The entries of a batch that made it are synced and acked; no byte
of the others is left in the WAL. They keep their sequence numbers and are
written again after a backoff (``actors.retry``: 50 ms doubling to 2 s) under
``at_capacity = "wait"`` (the writer reads no more requests meanwhile, so
producers wait), or get AT_CAPACITY under ``"reject"`` (their numbers go to the
next bundles: no gap). Events: ``wal_disk_full`` once, ``wal_disk_space_back``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.kernel.bundle import Bundle, MetaCodec
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import WalConfig
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import WalMetrics
from quiverd.protocol.frames import Ack, Error, ErrorCode
from quiverd.wal import format as walformat
from quiverd.wal.files import EntryToWrite, WalFiles, WalNoSpace
from quiverd_actors.messages import AppendRequest, DurableBatch, ProducerReply, WalReleased
from quiverd_actors.retention_gate import RetentionGate
from quiverd_actors.retry import Retry

MAX_BATCH_ENTRIES = 256
MAX_BATCH_BYTES = 16 * 1024 * 1024


_Placed = tuple[AppendRequest, Bundle, float]  # request, stamped bundle, monotonic time taken


@dataclass
class _Pending:
    """Written but not yet covered by an fdatasync."""

    items: list[_Placed] = field(default_factory=list)
    nbytes: int = 0


async def run(
    inbox: MemoryObjectReceiveStream[AppendRequest],
    outbox: MemoryObjectSendStream[DurableBatch],
    releases: MemoryObjectReceiveStream[WalReleased],
    *,
    shard: int,
    wal: WalFiles,
    cfg: WalConfig,
    next_sequence: int,
    limiter: CapacityLimiter,
    stats: WalMetrics,
    log: Logger,
    gate: RetentionGate | None = None,
    over_cap: Changes | None = None,
    drop_oldest: bool = False,
    stopping: anyio.Event | None = None,
    disk_reserve_bytes: int = 0,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Append, sync and acknowledge until ``inbox`` ends; then release until ``releases`` ends.

    ``gate`` (the shard's RetentionGate) holds producers back while the shard is
    over its size cap; under ``drop_oldest`` it only wakes the gc (``over_cap``).
    ``disk_reserve_bytes``: free space appends leave on the filesystem, so that
    segments (which release the WAL) and ack.log can still be written.
    """
    wal.reserve_bytes = disk_reserve_bytes
    writer = _Writer(shard, wal, cfg, next_sequence, limiter, stats, log, outbox)
    writer.reserve_bytes = disk_reserve_bytes
    writer.gate, writer.drop_oldest = gate, drop_oldest
    if over_cap is not None:
        writer.over_cap = over_cap
    writer.idle = lambda: inbox.statistics().current_buffer_used == 0
    if stopping is not None:
        writer.stopping = stopping
    async with releases, anyio.create_task_group() as tg:
        # Releases outlive the inbox: the finalizer still writes the last segment
        # after producers are gone, and ends `releases` when it is done.
        tg.start_soon(writer.serve_releases, releases)
        async with inbox, outbox, anyio.create_task_group() as timer_tg:
            if cfg.flush_policy == "interval":
                timer_tg.start_soon(writer.sync_on_timer)
            task_status.started()
            async for first in inbox:
                await writer.append(_drain(first, inbox))
            await writer.finish()
            timer_tg.cancel_scope.cancel()
    await anyio.to_thread.run_sync(wal.close, limiter=limiter)


def _drain(first: AppendRequest,
           inbox: MemoryObjectReceiveStream[AppendRequest]) -> list[AppendRequest]:
    """Take what is already queued, bounded in count and bytes: one hop per batch."""
    batch, nbytes = [first], first.bundle.payload_bytes
    while len(batch) < MAX_BATCH_ENTRIES and nbytes < MAX_BATCH_BYTES:
        try:
            req = inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
        batch.append(req)
        nbytes += req.bundle.payload_bytes
    return batch


class _Writer:
    def __init__(self, shard: int, wal: WalFiles, cfg: WalConfig, next_sequence: int,
                 limiter: CapacityLimiter, stats: WalMetrics, log: Logger,
                 outbox: MemoryObjectSendStream[DurableBatch]) -> None:
        self.shard, self.wal, self.cfg, self.limiter = shard, wal, cfg, limiter
        self.next_sequence, self.stats, self.log, self.outbox = next_sequence, stats, log, outbox
        self.stats.last_sequence.set(next_sequence - 1)  # what replay recovered
        self.meta = MetaCodec()
        self.pending = _Pending()
        self.kick = anyio.Event()  # set to sync now rather than at the next tick
        self.capacity = anyio.Event()  # set when a release freed WAL space
        self.sync_lock = anyio.Lock()  # keeps acks and DurableBatches in sequence order
        self.gate: RetentionGate | None = None
        self.over_cap = Changes()  # wakes the gc; the shard passes its own
        self.drop_oldest = False
        self.idle: Callable[[], bool] = lambda: False  # is the inbox empty right now?
        self.stopping = anyio.Event()  # set by the shard when the daemon stops
        self.disk_full = Retry(log)  # a disk-full episode: backoff, start and end events
        self.full_refusals = 0  # bundles refused (reject, stopping) in this episode
        self.reserve_bytes = 0  # free space appends leave; + 1/8 while the disk is full
        self.release_retry = Retry(log)  # releases that found no space for the sidecar

    async def append(self, batch: list[AppendRequest]) -> None:
        entries: list[EntryToWrite] = []
        placed: list[_Placed] = []
        taken = time.monotonic()  # the ack latency runs from here
        for req in batch:
            slots = (*req.bundle.slots, self.meta.encode(req.bundle.client, req.bundle.txn))
            size = walformat.entry_size(slots)
            if not await self._wait_for_room(req, entries, placed, size):
                continue
            seq, ts = self.next_sequence, time.time_ns()
            self.next_sequence += 1
            # Encoded (CRC over the payloads) in the write's worker thread, not here.
            entries.append((seq, (ts, slots), size))
            placed.append((req, _stamp(req.bundle, seq, ts), taken))
        if entries:
            await self._write(entries, placed)
        elif self.pending.items and self.idle():
            self.kick.set()  # only refusals this time: sync what earlier batches wrote

    async def _wait_for_room(self, req: AppendRequest, entries: list[EntryToWrite],
                             placed: list[_Placed], size: int) -> bool:
        """Block (``wait``) or refuse (``reject``) while the WAL or the shard is full."""
        if not await self._wait_for_retention(req):
            return False
        while not self.wal.fits_batch([*(e[2] for e in entries), size]):
            if self.cfg.at_capacity == "reject":
                return self._reject(req, f"shard {self.shard} WAL is at capacity "
                                    f"({self.wal.live_bytes} bytes in {self.wal.file_count} "
                                    "files); retry later")
            if entries:  # write what we have first so it can be synced and released
                await self._write(list(entries), list(placed))
                entries.clear()
                placed.clear()
                continue
            self.stats.capacity_waits.inc()
            self.log.warning("wal_at_capacity", shard=self.shard, bytes=self.wal.live_bytes,
                             files=self.wal.file_count)
            self.kick.set()
            if self.stopping.is_set():
                return self._refuse_stopping(req)
            self.capacity = anyio.Event()
            with anyio.move_on_after(1.0):
                await self.capacity.wait()
        return True

    async def _wait_for_retention(self, req: AppendRequest) -> bool:
        """The shard's size cap: wait or refuse under backpressure; nudge gc otherwise."""
        gate = self.gate
        if gate is None or not gate.over():
            return True
        if self.drop_oldest:
            # The gc drops the oldest segments; wait (briefly) for it so the cap holds.
            # If only the open segment holds data, the builder seals it under pressure.
            self.over_cap.notify()
            with anyio.move_on_after(1.0):
                while gate.over():
                    await gate.opened.wait()
            return True
        gate.closed = True
        self.stats.throttled.inc()
        self.over_cap.notify()
        if self.cfg.at_capacity == "reject":
            return self._reject(req, f"shard {self.shard} is at its retention size cap "
                                f"({gate.usage()} of {gate.cap_bytes} bytes) and subscribers "
                                "have not acked; retry later")
        self.log.warning("ingest_throttled", shard=self.shard, usage_bytes=gate.usage(),
                         cap_bytes=gate.cap_bytes)
        self.kick.set()  # sync what is written so it can be finalized and delivered
        while gate.over():
            if self.stopping.is_set():
                return self._refuse_stopping(req)
            with anyio.move_on_after(1.0):
                await gate.opened.wait()
        return True

    def _reject(self, req: AppendRequest, message: str) -> bool:
        """``at_capacity = "reject"``: answer AT_CAPACITY now (never acked, retryable)."""
        self.stats.rejected.inc()
        _reply(req, Error(request_id=req.request_id, code=ErrorCode.AT_CAPACITY, message=message))
        return False

    def _refuse_stopping(self, req: AppendRequest) -> bool:
        """Shutting down while the bundle waits for room: refuse it (never acked)."""
        _reply(req, Error(request_id=req.request_id, code=ErrorCode.SHUTTING_DOWN,
                          message="quiverd is shutting down; this bundle was not stored, "
                          "resend it after the restart"))
        return False

    async def _write(self, entries: list[EntryToWrite], placed: list[_Placed]) -> None:
        """Write, then sync and acknowledge per policy; hold or refuse what finds no space."""
        while True:
            full = await self._write_once(entries, placed)
            if full is None:
                if self.disk_full.active:
                    self.wal.reserve_bytes = self.reserve_bytes
                    self.stats.disk_full.set(0)
                    self.disk_full.succeeded("wal_disk_space_back", shard=self.shard,
                                             refused_bundles=self.full_refusals)
                return
            entries, placed = entries[full.written:], placed[full.written:]
            if not await self._no_space(full, entries, placed):
                return

    async def _write_once(self, entries: list[EntryToWrite],
                          placed: list[_Placed]) -> WalNoSpace | None:
        """Write ``entries``; sync and acknowledge per policy. On a full disk the first
        ``written`` of them are synced and acked all the same, and the error returned."""
        nbytes = sum(e[2] for e in entries)
        policy = self.cfg.flush_policy
        if policy == "interval" and 0 < self.cfg.flush_bytes <= self.pending.nbytes + nbytes:
            # flush_bytes reached: write and fdatasync in the same worker hop; the
            # fdatasync also covers every earlier unsynced append (group commit).
            async with self.sync_lock:
                full = await self._append(entries, sync=True)
                if full is None:
                    covered, self.pending = self.pending.items + placed, _Pending()
                    await self._acknowledge(covered)
                    return None
        else:
            full = await self._append(entries, sync=policy == "always")
        written = len(entries) if full is None else full.written
        if policy == "interval" or (full is not None and policy == "always"):
            self.pending.items.extend(placed[:written])
            self.pending.nbytes += sum(e[2] for e in entries[:written])
            self.stats.inflight.set(len(self.pending.items))
            if full is not None:
                await self.sync_pending()  # before waiting for space: ack what made it
            elif self.idle():
                # Nothing more is queued: waiting for the tick would only add latency,
                # the group is as large as it will get.
                self.kick.set()
        elif written:
            await self._acknowledge(placed[:written])  # "always" synced in the write's hop
        return full

    async def _append(self, entries: list[EntryToWrite], *, sync: bool) -> WalNoSpace | None:
        """One worker hop; returns the WalNoSpace that stopped it part-way, if any."""
        full = None
        try:
            await anyio.to_thread.run_sync(lambda: self.wal.append(entries, sync=sync),
                                           limiter=self.limiter)
        except WalNoSpace as exc:
            full = exc
        written = entries if full is None else entries[:full.written]
        if written:
            self.stats.appends.inc(len(written))
            self.stats.bytes_written.inc(sum(e[2] for e in written))
            self.stats.last_sequence.set(written[-1][0])
        if sync and full is None:
            self._synced()
        return full

    async def _no_space(self, full: WalNoSpace, entries: list[EntryToWrite],
                        placed: list[_Placed]) -> bool:
        """``entries`` found no space. True: write them again now; False: refused them."""
        self.stats.no_space.inc()
        if not self.disk_full.active:
            self.full_refusals = 0
            self.stats.disk_full.set(1)
            # Hysteresis: resume once a margin beyond the reserve is free, not at the
            # first freed byte (segment writes and releases make free space wobble).
            self.wal.reserve_bytes = self.reserve_bytes + self.reserve_bytes // 8
        self.disk_full.failed("wal_disk_full", shard=self.shard, reason=full.reason,
                              error=str(full), held_bundles=len(placed),
                              at_capacity=self.cfg.at_capacity, hint=full.hint)
        self.kick.set()  # what is written gets synced and acked meanwhile
        reject = self.cfg.at_capacity == "reject"
        if reject or self.stopping.is_set():
            # Never acked; their sequence numbers go to the next bundles.
            self.next_sequence = entries[0][0]
            self.full_refusals += len(placed)
            for req, _, _ in placed:
                if reject:
                    self._reject(req, f"shard {self.shard} cannot write its WAL: the disk is "
                                 f"full ({full.reason}); retry later")
                else:
                    self._refuse_stopping(req)
            return False
        await self.disk_full.pause(self.stopping)
        return True

    async def sync_on_timer(self) -> None:
        """Group commit: one fdatasync per tick covers everything written before it."""
        interval = self.cfg.flush_interval_ms / 1000
        while True:
            with anyio.move_on_after(interval):
                await self.kick.wait()
            self.kick = anyio.Event()
            await self.sync_pending()

    async def sync_pending(self) -> None:
        async with self.sync_lock:
            if not self.pending.items:
                return
            covered, self.pending = self.pending, _Pending()
            await anyio.to_thread.run_sync(self.wal.sync, limiter=self.limiter)
            self._synced()
            await self._acknowledge(covered.items)

    def _synced(self) -> None:
        self.stats.fsyncs.inc()
        self.stats.fdatasync_latency.observe(self.wal.last_sync_seconds)

    async def _acknowledge(self, placed: list[_Placed]) -> None:
        self.stats.inflight.set(len(self.pending.items))  # written, not yet synced
        now = time.monotonic()
        for req, bundle, taken in placed:
            _reply(req, Ack(request_id=req.request_id, shard=self.shard,
                            sequence=bundle.sequence))
            self.stats.ack_latency.observe(now - taken)
        self.stats.acks.inc(len(placed))
        self.stats.acked_bytes.inc(sum(b.payload_bytes for _, b, _ in placed))
        await self.outbox.send(DurableBatch(bundles=tuple(b for _, b, _ in placed)))

    async def finish(self) -> None:
        """Inbox ended: make everything written durable and acknowledged."""
        await self.sync_pending()

    async def serve_releases(self, releases: MemoryObjectReceiveStream[WalReleased]) -> None:
        """Reclaim WAL space for each release; one that finds no disk space for the
        sidecar is done later (with the next release, or after a backoff)."""
        deferred: int | None = None  # highest release not yet done
        retry = self.release_retry
        while True:
            upto = deferred
            with anyio.move_on_after(math.inf if deferred is None else retry.delay):
                try:
                    msg = await releases.receive()
                except anyio.EndOfStream:
                    return  # a deferred release stays undone: replay skips those entries
                upto = max(msg.upto_sequence, deferred or 0)
            if deferred is not None:
                retry.backoff()
            assert upto is not None
            try:
                freed = await anyio.to_thread.run_sync(self.wal.release, upto,
                                                       limiter=self.limiter)
            except WalNoSpace as exc:
                self.stats.sidecar_no_space.inc()
                retry.failed("wal_release_deferred", shard=self.shard, upto_sequence=upto,
                             error=str(exc), hint=exc.hint)
                deferred = upto
                continue
            deferred = None
            retry.succeeded("wal_release_done", shard=self.shard, upto_sequence=upto)
            if freed:
                self.capacity.set()


def _stamp(bundle: Bundle, sequence: int, ts_ns: int) -> Bundle:
    return Bundle(client=bundle.client, slots=bundle.slots, txn=bundle.txn,
                  ingestion_ts_ns=ts_ns, sequence=sequence)


def _reply(req: AppendRequest, reply: ProducerReply) -> None:
    try:
        req.reply.send_nowait(reply)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the producer hung up; its data is durable all the same
