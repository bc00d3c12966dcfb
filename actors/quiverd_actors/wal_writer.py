"""WAL writer: one per shard. Takes AppendRequests, produces DurableBatches.

    producers ──AppendRequests (ShardInbox)──▶ wal_writer ──DurableBatch──▶ segment_builder
                                                 ▲  │ protocol Ack / Error (per connection)
    finalizer ──WalReleased──────────────────────┘  ▼

On the event loop this actor only moves batches: it takes everything the inbox
holds at once, checks the shard's retention gate once per batch, and submits the
batch to the shard's two long-lived threads (``wal_threads.WalPipeline``): a writer
that numbers and ``writev``s entries, and a syncer that fdatasyncs what was written
and hands each commit back in one ``loop.call_soon_threadsafe``. Acks leave only
after the fdatasync that covers the entry returned; when that happens is one pure
decision, ``quiverd.wal.flush.FlushPolicy``:

- ``always``:   every write is synced before its entries are acked.
- ``interval``: group commit. A sync covers everything written before it and starts
  when the writer is idle (nothing more queued: waiting adds only latency), once
  ``flush_bytes`` are unsynced, or ``flush_interval_ms`` after the oldest unsynced
  write. Writes go on while it runs.
- ``never``:    ack after the write (tests and benchmarks only).

A failed fdatasync raises DurabilityLost: nothing it covered is acked, the shard's
task group fails and the daemon exits non-zero (systemd restarts it, replay
recovers what was durable). It is never retried.

A full disk (ENOSPC, EDQUOT, or less than ``disk_reserve_bytes`` free) is
backpressure. The entries of a batch that made it are synced and acked; no byte of
the others is left in the WAL. They are written again after a backoff
(``actors.retry``: 50 ms doubling to 2 s) under ``at_capacity = "wait"`` (later
batches queue behind them, so producers wait), or get AT_CAPACITY under
``"reject"``. Numbers are given at write time: a refused bundle uses none, so there
is no gap. Events: ``wal_disk_full`` once, ``wal_disk_space_back``.

A named producer's bundle (protocol v3: its stream and ``producer_seq``) that the shard
already holds is not written again: it is answered with the first one's ACK, at once
when that one is acked, else together with it (or with its refusal). The table of
what is held (``quiverd.kernel.producers``) takes a bundle when it is acked, and is
written to ``producers.json`` before each WAL release, so a released entry's number
is never forgotten.
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.kernel import fs
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import WalConfig
from quiverd.kernel.durable import atomic_write
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import WalMetrics
from quiverd.kernel.producers import ProducerTable, StreamKey, stream_of
from quiverd.protocol.frames import Ack, Error, ErrorCode
from quiverd.wal.disk import reason_of
from quiverd.wal.files import WalFiles, WalNoSpace
from quiverd.wal.flush import FlushPolicy
from quiverd_actors.inbox import ShardInbox
from quiverd_actors.messages import AppendRequest, DurableBatch, ProducerReply, WalReleased
from quiverd_actors.retention_gate import RetentionGate
from quiverd_actors.retry import Retry
from quiverd_actors.wal_threads import MAX_BATCH_BYTES, Refusal, WalPipeline, Written

__all__ = ["MAX_BATCH_BYTES", "run"]

REFUSAL_CODES = {"capacity": ErrorCode.AT_CAPACITY, "disk_full": ErrorCode.AT_CAPACITY,
                 "stopping": ErrorCode.SHUTTING_DOWN}


async def run(
    inbox: ShardInbox | MemoryObjectReceiveStream[AppendRequest],
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
    producers: ProducerTable | None = None,
    producers_path: Path | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Append, sync and acknowledge until ``inbox`` ends; then release until ``releases`` ends.

    ``inbox`` is the shard's ShardInbox (or a memory stream, pumped into one).
    ``gate`` (the shard's RetentionGate) holds producers back while the shard is
    over its size cap; under ``drop_oldest`` it only wakes the gc (``over_cap``).
    ``disk_reserve_bytes``: free space appends leave on the filesystem, so that
    segments (which release the WAL) and ack.log can still be written.
    ``producers``: the named producers' stored numbers (recovery's), saved to
    ``producers_path`` before each release.
    """
    wal.reserve_bytes = disk_reserve_bytes
    writer = _Writer(shard, wal, cfg, next_sequence, stats, log, outbox)
    if producers is not None:
        writer.producers = producers
    writer.producers_path = producers_path
    writer.gate, writer.drop_oldest = gate, drop_oldest
    if over_cap is not None:
        writer.over_cap = over_cap
    try:
        async with releases, anyio.create_task_group() as tg:
            # Releases outlive the inbox: the finalizer still writes the last segment
            # after producers are gone, and ends `releases` when it is done.
            tg.start_soon(writer.serve_releases, releases, limiter)
            async with outbox, anyio.create_task_group() as io:
                if isinstance(inbox, MemoryObjectReceiveStream):
                    stream, inbox = inbox, ShardInbox()
                    io.start_soon(inbox.pump, stream)
                writer.start(io, inbox, stopping)
                task_status.started()
                try:
                    await writer.serve(inbox)
                except BaseException:
                    writer.pipeline.abort()  # cancelled or failed: the threads end now
                    raise
                await writer.done.wait()  # threads exited, every commit handed on
                io.cancel_scope.cancel()  # the stop watcher
    finally:
        # Also after a fatal error: a daemon serving in a test process must not keep
        # the file open (a subprocess's exit would close it).
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(wal.close, limiter=limiter)


class _Writer:
    """The loop's side of one shard's WAL: admission, acknowledgements, releases."""

    def __init__(self, shard: int, wal: WalFiles, cfg: WalConfig, next_sequence: int,
                 stats: WalMetrics, log: Logger,
                 outbox: MemoryObjectSendStream[DurableBatch]) -> None:
        self.shard, self.wal, self.cfg, self.stats, self.log = shard, wal, cfg, stats, log
        self.outbox = outbox
        self.fs = fs.active()  # its mark() tells crash-state tools when acks leave
        self.gate: RetentionGate | None = None
        self.over_cap = Changes()  # wakes the gc; the shard passes its own
        self.drop_oldest = False
        self.stopping = anyio.Event()  # set by the shard when the daemon stops
        self.release_retry = Retry(log)  # releases that found no space for the sidecar
        self.durable: list[DurableBatch] = []  # acked, not yet handed to the outbox
        self.wake: anyio.Event | None = None
        self.threads_left = 0
        self.done = anyio.Event()  # threads exited and every commit went to the outbox
        self.producers = ProducerTable()
        self.producers_path: Path | None = None
        # Numbered bundles submitted, not yet acked or refused; and the resends of
        # them that arrived meanwhile, answered with them.
        self.numbered: dict[tuple[StreamKey, int], list[AppendRequest]] = {}
        self.pipeline = WalPipeline(wal, FlushPolicy.of(cfg), self, _poster(),
                                    shard=shard, next_sequence=next_sequence,
                                    reject=cfg.at_capacity == "reject", stats=stats, log=log)

    def start(self, tg: anyio.abc.TaskGroup, inbox: ShardInbox,
              stopping: anyio.Event | None) -> None:
        """The writer and syncer threads, the deliverer, and the stop watcher."""
        self.pipeline.idle = lambda: inbox.empty
        for fn in (self.pipeline.run_writer, self.pipeline.run_syncer):
            self.threads_left += 1
            tg.start_soon(self._thread, fn)
        tg.start_soon(self._deliver)
        if stopping is not None:
            self.stopping = stopping
            tg.start_soon(self._watch_stopping)

    async def serve(self, inbox: ShardInbox) -> None:
        """Hand every batch to the writer thread; then let it drain and exit."""
        while (batch := await inbox.take()) is not None:
            taken = time.monotonic()  # the ack latency runs from here
            if any(req.bundle.producer is not None for req in batch):
                batch = self._new_only(batch)
            items = [(req, taken) for req in batch]
            if self.gate is not None and self.gate.over():
                items = [item for item in items if await self._wait_for_retention(item[0])]
            if items:
                self.pipeline.submit(items)
        self.pipeline.close()

    def _new_only(self, batch: list[AppendRequest]) -> list[AppendRequest]:
        """The batch without the numbered bundles the shard holds or is storing: those
        are answered with the first one's outcome."""
        fresh: list[AppendRequest] = []
        for req in batch:
            tag = req.bundle.producer
            if tag is None:
                fresh.append(req)
                continue
            key = (stream_of(req.bundle.client, tag), tag.seq)
            waiting = self.numbered.get(key)
            if waiting is not None:
                waiting.append(req)  # the first is in flight: answered with it
                continue
            sequence = self.producers.sequence_of(*key)
            if sequence is not None:
                self.stats.resends.inc()
                _reply(req, Ack(request_id=req.request_id, shard=self.shard,
                                sequence=sequence))
                continue
            self.numbered[key] = []
            fresh.append(req)
        return fresh

    def _settle_numbered(self, req: AppendRequest, reply: ProducerReply | None,
                         sequence: int = 0) -> None:
        """A numbered bundle was acked (``reply`` None: an Ack of ``sequence``) or
        refused: its resends get the same answer."""
        tag = req.bundle.producer
        if tag is None:
            return
        stream = stream_of(req.bundle.client, tag)
        if reply is None:
            self.producers.add(stream, tag.seq, sequence)
        for again in self.numbered.pop((stream, tag.seq), ()):
            self.stats.resends.inc()
            _reply(again, Ack(request_id=again.request_id, shard=self.shard,
                              sequence=sequence) if reply is None else
                   msgspec.structs.replace(reply, request_id=again.request_id))

    # ---- called on the loop by the pipeline's posts -------------------------------
    def on_durable(self, written: list[Written]) -> None:
        """One commit: ack its bundles now, queue its DurableBatch for the outbox."""
        now = time.monotonic()
        stats, shard = self.stats, self.shard
        self.fs.mark("acked", shard=shard, written=written)  # a no-op outside tests
        for req, bundle, taken in written:
            _reply(req, Ack(request_id=req.request_id, shard=shard, sequence=bundle.sequence))
            stats.ack_latency.observe(now - taken)
            if bundle.producer is not None:
                self._settle_numbered(req, None, bundle.sequence)
        stats.acks.inc(len(written))
        stats.acked_bytes.inc(sum(b.payload_bytes for _, b, _ in written))
        batch = DurableBatch(bundles=tuple(b for _, b, _ in written))
        if not self.durable:
            try:  # the usual case: the builder has room, and the next sync may start now
                self.outbox.send_nowait(batch)
                self.pipeline.delivered()
                return
            except anyio.WouldBlock:
                pass
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The builder is gone: the shard is stopping on a fatal error. These
                # bundles are acked and in the WAL; the next start replays them.
                return
        self.durable.append(batch)
        self._notify()

    def on_refused(self, reqs: list[AppendRequest], why: Refusal, message: str) -> None:
        code = REFUSAL_CODES[why]
        for req in reqs:
            error = Error(request_id=req.request_id, code=code, message=message)
            _reply(req, error)
            self._settle_numbered(req, error)

    # ---- loop tasks ----------------------------------------------------------------
    async def _deliver(self) -> None:
        """DurableBatches to the segment builder, in order. The pipeline starts its
        next sync only once the last one was taken: a slow builder holds syncs back."""
        while True:
            while self.durable:
                await self.outbox.send(self.durable[0])
                self.durable.pop(0)
                if not self.durable:
                    self.pipeline.delivered()
            if not self.threads_left:
                self.done.set()
                return
            await self._wait()

    async def _thread(self, fn: Callable[[], None]) -> None:
        try:
            await anyio.to_thread.run_sync(fn, limiter=CapacityLimiter(1))
        finally:
            self.threads_left -= 1
            self._notify()

    async def _watch_stopping(self) -> None:
        await self.stopping.wait()
        self.pipeline.stopping.set()
        self.pipeline.space.set()

    async def _wait(self) -> None:
        self.wake = anyio.Event()
        try:
            await self.wake.wait()
        finally:
            self.wake = None

    def _notify(self) -> None:
        if self.wake is not None:
            self.wake.set()

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
            self.stats.rejected.inc()
            self.on_refused([req], "capacity", f"shard {self.shard} is at its retention size "
                            f"cap ({gate.usage()} of {gate.cap_bytes} bytes) and subscribers "
                            "have not acked; retry later")
            return False
        self.log.warning("ingest_throttled", shard=self.shard, usage_bytes=gate.usage(),
                         cap_bytes=gate.cap_bytes)
        self.pipeline.kick()  # sync what is written so it can be finalized and delivered
        while gate.over():
            if self.stopping.is_set():
                self.on_refused([req], "stopping", "quiverd is shutting down; this bundle "
                                "was not stored, resend it after the restart")
                return False
            with anyio.move_on_after(1.0):
                await gate.opened.wait()
        return True

    async def serve_releases(self, releases: MemoryObjectReceiveStream[WalReleased],
                             limiter: CapacityLimiter) -> None:
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
                await self._save_producers(limiter)
                freed = await anyio.to_thread.run_sync(self.wal.release, upto,
                                                       limiter=limiter)
            except WalNoSpace as exc:
                self.stats.sidecar_no_space.inc()
                retry.failed("wal_release_deferred", shard=self.shard, upto_sequence=upto,
                             error=str(exc), hint=exc.hint)
                deferred = upto
                continue
            deferred = None
            retry.succeeded("wal_release_done", shard=self.shard, upto_sequence=upto)
            if freed:
                self.pipeline.space.set()


    async def _save_producers(self, limiter: CapacityLimiter) -> None:
        """producers.json as of now, before a release lets the WAL forget entries whose
        numbers only it held (WalNoSpace defers the release)."""
        table, path = self.producers, self.producers_path
        if path is None:
            return
        table.expire()
        if not table.changed:
            return
        raw = table.encode()
        try:
            await anyio.to_thread.run_sync(atomic_write, path, raw, limiter=limiter)
        except OSError as exc:
            table.changed = True  # written with the next release
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise WalNoSpace(f"no space to write {path}: {exc}", written=0,
                                 reason=reason_of(exc)) from exc
            raise


def _poster() -> Callable[..., Any]:
    """``loop.call_soon_threadsafe`` of the running loop; a post after the loop closed
    is dropped (the daemon is gone, and with it every connection to answer)."""
    import asyncio

    loop = asyncio.get_running_loop()

    def post(fn: Callable[..., Any], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(partial(fn, *args))
        except RuntimeError:
            pass

    return post


def _reply(req: AppendRequest, reply: ProducerReply) -> None:
    try:
        req.reply.send_nowait(reply)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the producer hung up; its data is durable all the same
