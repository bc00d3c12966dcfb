"""The WAL writer's threads (one shard): one long-lived writer thread and one syncer thread.

    event loop ──submit(batch)──▶ writer thread ──written──▶ syncer thread
        ▲                         writev, rotate,            fdatasync of all
        │                         capacity, disk full        written so far
        └─────────── post(on_durable, every entry the sync covered) ◀──┘

The loop hands over whole batches (``submit``); the writer takes everything queued
at once, numbers the entries, and ``writev``s them; the syncer fdatasyncs what was
written when ``FlushPolicy`` says so and hands every covered entry back to the loop
in one ``post`` (``loop.call_soon_threadsafe``). Writes go on while a sync runs.
No per-bundle hop, no anyio primitive, no shared state: each thread owns its fields
and hears from the others through its ``queue.SimpleQueue`` (C code: a put from the
loop never blocks, nor waits for the GIL behind a lock).

A commit is acknowledged only after the fdatasync that covers it returned. A sync
waits until the loop has taken the previous commit (``delivered``): a slow
consumer of durable batches holds later syncs back, which bounds the pipeline.
A failed fdatasync raises DurabilityLost out of ``run_syncer``: nothing it covered
is acknowledged and the shard stops (never retried).

Sequence numbers are given by the writer at write time, so a bundle refused for
lack of space (``at_capacity = "reject"``, or the daemon stopping) uses none.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from quiverd.kernel.bundle import Bundle, MetaCodec
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import WalMetrics
from quiverd.wal import format as walformat
from quiverd.wal.files import EntryToWrite, WalFiles, WalNoSpace
from quiverd.wal.flush import Action, FlushPolicy
from quiverd_actors.retry import Retry

CAPACITY_RECHECK_S = 1.0  # a wait for WAL room looks again at least this often
# One write takes at most this much payload (the disk reserve counts one write batch).
MAX_BATCH_BYTES = 16 * 1024 * 1024

Refusal = Literal["capacity", "disk_full", "stopping"]


Item = tuple[Any, float]  # (request, monotonic time the loop took it)
Written = tuple[Any, Bundle, float]  # (request, bundle stamped with sequence, taken)


class Sink(Protocol):
    """The loop's side; the pipeline calls these only through ``post``."""

    def on_durable(self, written: list[Written]) -> None: ...

    def on_refused(self, reqs: list[Any], why: Refusal, message: str) -> None: ...


# Messages to the syncer (its queue also carries (written, bytes, idle): a write landed).
_CREDIT = "credit"  # the loop took the last commit: the next sync may start
_IDLE = "idle"  # the writer has nothing to write (or waits for room): sync now
_DONE = "done"  # the writer exited: sync what is left, then exit too
_ABORT = "abort"  # cancelled or failed: exit at once, acknowledge nothing more
_CLOSE = "close"  # (writer's queue) no more submits


class WalPipeline:
    def __init__(self, wal: WalFiles, policy: FlushPolicy, sink: Sink,
                 post: Callable[..., Any], *, shard: int, next_sequence: int,
                 reject: bool, stats: WalMetrics, log: Logger,
                 idle: Callable[[], bool] = lambda: True) -> None:
        self.wal, self.policy, self.sink, self.post = wal, policy, sink, post
        self.shard, self.next_sequence, self.reject = shard, next_sequence, reject
        self.stats, self.log = stats, log
        self.idle = idle  # is the loop's inbox empty (nothing about to be submitted)?
        self.meta = MetaCodec()
        # Plain C queues: a put from the loop never blocks and takes no Python lock,
        # so the loop never waits for a thread (nor for the GIL behind one).
        self.to_writer: queue.SimpleQueue[list[Item] | str] = queue.SimpleQueue()
        # The syncer's queue: (written entries, bytes, idle) per write, or a message below.
        self.to_syncer: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.space = threading.Event()  # set when a release freed WAL space
        self.stopping = threading.Event()  # the daemon stops: waits end in refusals
        self.aborted = False
        self.disk_full = Retry(log)
        self.full_refusals = 0
        self.reserve_bytes = wal.reserve_bytes  # + 1/8 while the disk is full
        self._batch_left = 0  # entries of the batch being written not yet written
        self._idle_told = False  # the last write's message said "idle" already
        # Commit records say how far syncs got (SPEC §3); under "never" none is claimed.
        wal.commits = policy.syncs
        stats.last_sequence.set(next_sequence - 1)

    # ---- the loop's calls (never block) -----------------------------------------
    def submit(self, items: list[Item]) -> None:
        self.to_writer.put(items)

    def delivered(self) -> None:
        """The loop handed the last commit on: the next sync may start."""
        self._tell_syncer(_CREDIT)

    def close(self) -> None:
        """No more submits: write what is queued, sync it, acknowledge it, then exit."""
        self.to_writer.put(_CLOSE)

    def abort(self) -> None:
        """Cancelled: both threads exit as soon as they can; nothing more is acked."""
        self.aborted = True
        self.stopping.set()
        self.space.set()
        self.to_writer.put(_ABORT)
        self.to_syncer.put(_ABORT)

    def kick(self) -> None:
        """Sync what is written now (retention wants it finalized)."""
        self._tell_syncer(_IDLE)

    def _tell_syncer(self, message: Any) -> None:
        if self.policy.syncs:  # under "never" no syncer reads the queue
            self.to_syncer.put(message)

    # ---- writer thread -----------------------------------------------------------
    def run_writer(self) -> None:
        q = self.to_writer
        try:
            while True:
                first = q.get()
                batch: list[Item] = []
                nbytes, more = 0, first
                while True:  # everything queued, up to MAX_BATCH_BYTES of payload
                    if more == _ABORT:
                        return
                    if more == _CLOSE:  # what was queued before it is written first
                        if batch:
                            self._write_batch(batch)
                            self._after_write()
                        return
                    assert isinstance(more, list)
                    batch.extend(more)
                    nbytes += sum(req.bundle.payload_bytes for req, _ in more)
                    if nbytes >= MAX_BATCH_BYTES or q.empty():
                        break
                    more = q.get_nowait()
                self._write_batch(batch)
                self._after_write()
        except BaseException:
            # A failed write (DurabilityLost): a later fdatasync proves nothing about
            # it, so nothing more is synced or acknowledged; the shard stops.
            self.abort()
            raise
        finally:
            self.to_syncer.put(_DONE)

    def _after_write(self) -> None:
        """Nothing more to write: tell the syncer, unless the last write already did."""
        if self.to_writer.empty() and not self._idle_told:
            self._tell_syncer(_IDLE)
        self._idle_told = False

    def _write_batch(self, batch: list[Item]) -> None:
        pending = [(req, taken, self._slots(req.bundle)) for req, taken in batch]
        limit = len(pending)  # entries per write; halved while a write finds no space
        while pending and not self.aborted:
            sizes = [walformat.entry_size(slots) for _, _, slots in pending]
            n = min(self.wal.fitting_prefix(sizes), limit)
            if n == 0:
                pending = self._no_room(pending)
                continue
            total = 0
            for i, size in enumerate(sizes[:n]):  # one write: MAX_BATCH_BYTES at most
                total += size
                if total > MAX_BATCH_BYTES and i:
                    n = i
                    break
            self._batch_left = len(pending)
            count, full = self._append(pending[:n])
            pending = pending[count:]
            if full is None:
                continue
            if count == 0 and n > 1:
                # A write is cut back whole: fewer entries may still fit. Halve before
                # calling the disk full, so what fits is written and acked meanwhile.
                self.stats.no_space.inc()
                limit = n // 2
                continue
            refused = self._no_space(full, pending[:n - count])
            pending = pending[refused:]

    def _slots(self, bundle: Bundle) -> tuple[Any, ...]:
        return (*bundle.slots, self.meta.encode(bundle.client, bundle.txn, bundle.producer))

    def _no_room(self, pending: list[Any]) -> list[Any]:
        """The WAL is at its size or file bound: refuse the first, or wait for a release."""
        if self.reject:
            self._refuse(pending[:1], "capacity", f"shard {self.shard} WAL is at capacity "
                         f"({self.wal.live_bytes} bytes in {self.wal.file_count} files); "
                         "retry later")
            return pending[1:]
        self.stats.capacity_waits.inc()
        self.log.warning("wal_at_capacity", shard=self.shard, bytes=self.wal.live_bytes,
                         files=self.wal.file_count)
        if self.stopping.is_set():
            self._refuse_stopping(pending[:1])
            return pending[1:]
        self.space.clear()
        self._tell_syncer(_IDLE)  # what is written gets synced, and can be released
        self.space.wait(CAPACITY_RECHECK_S)
        return pending

    def _append(self, chunk: list[Any]) -> tuple[int, WalNoSpace | None]:
        """Write ``chunk`` (it fits); how many of it were written, and why not the rest."""
        first = self.next_sequence
        entries: list[EntryToWrite] = []
        for i, (_, _, slots) in enumerate(chunk):
            entries.append((first + i, (time.time_ns(), slots), walformat.entry_size(slots)))
        full: WalNoSpace | None = None
        try:
            self.wal.append(entries, sync=False)
        except WalNoSpace as exc:
            full = exc
        count = len(entries) if full is None else full.written
        if count:
            self._written(chunk[:count], entries[:count])
        if full is None and self.disk_full.active:
            self.wal.reserve_bytes = self.reserve_bytes
            self.stats.disk_full.set(0)
            self.disk_full.succeeded("wal_disk_space_back", shard=self.shard,
                                     refused_bundles=self.full_refusals)
        return count, full

    def _written(self, chunk: list[Any], entries: list[EntryToWrite]) -> None:
        self.next_sequence = entries[-1][0] + 1
        nbytes = sum(e[2] for e in entries)
        self.stats.appends.inc(len(entries))
        self.stats.bytes_written.inc(nbytes)
        self.stats.last_sequence.set(entries[-1][0])
        done = [(req, Bundle(client=req.bundle.client, slots=req.bundle.slots,
                             txn=req.bundle.txn, ingestion_ts_ns=e[1][0], sequence=e[0],
                             producer=req.bundle.producer), taken)
                for (req, taken, _), e in zip(chunk, entries, strict=True)]
        if not self.policy.syncs:
            self.post(self.sink.on_durable, done)
            return
        # The batch's last write with nothing queued behind it carries "idle" itself:
        # one message, one wake-up of the syncer, per write.
        idle = len(chunk) == self._batch_left and self.to_writer.empty()
        self._idle_told = idle
        self.to_syncer.put((done, nbytes, idle))

    def _no_space(self, full: WalNoSpace, rest: list[Any]) -> int:
        """``rest`` found no disk space. Returns how many of it were refused (0: the
        writer pauses and tries them again, keeping their place in line)."""
        self.stats.no_space.inc()
        if not self.disk_full.active:
            self.full_refusals = 0
            self.stats.disk_full.set(1)
            # Hysteresis: resume once a margin beyond the reserve is free, not at the
            # first freed byte (segment writes and releases make free space wobble).
            self.wal.reserve_bytes = self.reserve_bytes + self.reserve_bytes // 8
        self.disk_full.failed("wal_disk_full", shard=self.shard, reason=full.reason,
                              error=str(full), held_bundles=len(rest),
                              at_capacity="reject" if self.reject else "wait", hint=full.hint)
        if self.reject or self.stopping.is_set():
            self.full_refusals += len(rest)
            if self.reject:
                self._refuse(rest, "disk_full", f"shard {self.shard} cannot write its WAL: "
                             f"the disk is full ({full.reason}); retry later")
            else:
                self._refuse_stopping(rest)
            return len(rest)
        self._tell_syncer(_IDLE)  # paused: what is written gets synced and acked
        self.disk_full.pause_blocking(self.stopping)
        return 0

    def _refuse(self, pending: list[Any], why: Refusal, message: str) -> None:
        if why != "stopping":
            self.stats.rejected.inc(len(pending))
        self.post(self.sink.on_refused, [p[0] for p in pending], why, message)

    def _refuse_stopping(self, pending: list[Any]) -> None:
        self._refuse(pending, "stopping", "quiverd is shutting down; this bundle was not "
                     "stored, resend it after the restart")

    # ---- syncer thread -----------------------------------------------------------
    def run_syncer(self) -> None:
        """fdatasync per ``FlushPolicy``; hand each commit to the loop in one post."""
        if not self.policy.syncs:
            return
        st = _SyncState()
        while True:
            if not st.take(self.to_syncer):
                return
            self.stats.inflight.set(len(st.written))
            if st.done and not st.written:
                # The last record, synced: damage to what was acked reads as loss.
                if not self.aborted:
                    self.wal.commit_idle(sync=True)
                return
            st.timeout = None
            if not (st.written and st.credit):
                continue
            decision = self.policy.after_write(
                unsynced_entries=len(st.written), unsynced_bytes=st.nbytes,
                unsynced_age_s=time.monotonic() - st.oldest,
                writer_idle=st.idle and self.idle(), closing=st.done)
            if decision.action is not Action.SYNC:
                st.timeout = None if decision.wait_s == math.inf else decision.wait_s
                continue
            covered, st.written, st.nbytes, st.credit = st.written, [], 0, False
            self.stats.inflight.set(len(covered))
            self.wal.sync()  # DurabilityLost ends the thread: nothing covered is acked
            self.stats.fsyncs.inc()
            self.stats.fdatasync_latency.observe(self.wal.last_sync_seconds)
            self.stats.inflight.set(0)
            self.post(self.sink.on_durable, covered)
            if st.idle and self.to_syncer.empty():
                # Nothing more is coming now: record the frontier (written, not synced;
                # the next batch would carry it otherwise).
                self.wal.commit_idle()


class _SyncState:
    """The syncer's view, built from its queue's messages (only it touches this)."""

    def __init__(self) -> None:
        self.written: list[Written] = []  # written, not yet synced
        self.nbytes = 0
        self.oldest = 0.0  # monotonic arrival of the oldest unsynced write
        self.credit = True  # the loop took the last commit
        self.idle = False  # the writer has nothing more to write right now
        self.done = False  # the writer exited
        self.timeout: float | None = None  # the policy's wait; None: until a message

    def take(self, q: queue.SimpleQueue[Any]) -> bool:
        """Apply the next message (waiting up to ``timeout``) and all queued behind it;
        False on abort."""
        try:
            msg = q.get(timeout=self.timeout)
        except queue.Empty:
            return True  # the wait ran out: decide again
        while True:
            if msg == _ABORT:
                return False
            if msg == _CREDIT:
                self.credit = True
            elif msg == _IDLE:
                self.idle = True
            elif msg == _DONE:
                self.done = True
            else:
                done, nbytes, idle = msg
                if not self.written:
                    self.oldest = time.monotonic()
                self.written.extend(done)
                self.nbytes += nbytes
                self.idle = idle
            try:
                msg = q.get_nowait()
            except queue.Empty:
                return True
