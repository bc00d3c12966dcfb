"""Segment builder: one per shard. Consumes DurableBatches, produces SealedSegments.

    wal_writer ──DurableBatch──▶ segment_builder ──SealedSegment──▶ finalizer

Bundles accumulate in an ``OpenSegment`` (per-stream accumulators keyed by
``(slot, schema fingerprint)`` plus the manifest). The segment is sealed when
it reaches ``target_size_bytes`` or ``max_streams``, when it has been open for
``max_open_duration_ms`` (a timer, not the next arrival), when ``seal_early()``
says so after a batch (WAL or disk near its bound: reason ``pressure``), and at
end of stream (shutdown), and when a committed job asks for its bundles (``SealRequests``:
reason ``commit``). Each DurableBatch (one WAL commit) is added in one call
(``OpenSegment.add_batch``): bundles known from ingest validation cost one manifest
entry each, on the loop. Decoding Arrow payloads (replayed bundles) happens in one
worker-thread hop per batch.

A job's commit must not wait out ``max_open_duration_ms`` (read your writes, SPEC §7):
``SealRequests.sealed_through(job_id, sequence)`` (``sequence``: the highest WAL
sequence acknowledged when the request came, so every bundle of the job is at or below
it) seals the open segment at once if it holds a bundle of the job, waits for the
bundles still on their way from the WAL writer (sealing again if one of the job's
arrives), and answers with the number of the last segment sealed. The builder notes the
jobs of the open segment's tagged bundles (one attribute per bundle, on the loop); its
wait is cut short only when the open segment must be sealed.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.kernel.bundle import Bundle
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import SegmentConfig
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import SegmentMetrics
from quiverd.segments.open_segment import OpenSegment
from quiverd_actors.messages import DurableBatch, SealedSegment, SealReason


async def run(
    inbox: MemoryObjectReceiveStream[DurableBatch],
    outbox: MemoryObjectSendStream[SealedSegment],
    *,
    cfg: SegmentConfig,
    first_segment_seq: int,
    recovered: list[Bundle],
    limiter: CapacityLimiter,
    stats: SegmentMetrics,
    seal_early: Callable[[], bool] | None = None,  # WAL or disk near its bound
    log: Logger,
    from_wal: bool = False,
    seals: SealRequests | None = None,
    next_sequence: int = 0,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Accumulate and seal until ``inbox`` ends; the last open segment is sealed then.

    ``from_wal``: the finalizer reads payloads back from the WAL, so validated
    bundles are added without holding their bytes (``OpenSegment.add_batch``).
    """
    builder = _Builder(outbox, cfg, first_segment_seq, limiter, stats, log)
    builder.from_wal = from_wal
    requests = builder.seals = seals or SealRequests()
    # Every sequence below the WAL's next one is in a segment already or in ``recovered``.
    requests.seen = next_sequence - 1
    async with inbox, outbox:
        task_status.started()
        # Replayed WAL entries not yet in any segment: the open state before the crash,
        # sealed at the target size as live bundles would have been. After ready: a
        # large WAL is finalized while the daemon already accepts (new bundles queue
        # behind it, in sequence order); before, ready would wait for all of it.
        group: list[Bundle] = []
        group_bytes = 0
        for bundle in recovered:
            group.append(bundle)
            group_bytes += bundle.payload_bytes
            if builder.open.bytes + group_bytes >= cfg.target_size_bytes:
                await builder.add(group)
                await builder.seal_if_full()
                group, group_bytes = [], 0
        if group:
            await builder.add(group)
            await builder.seal_if_full()
        recovered = []
        requests.ready = True
        await builder.seal_if_due()
        while True:
            with anyio.move_on_after(builder.seconds_left()) as timer:
                requests.scope = timer  # a request that must seal now cancels it
                try:
                    batch = await inbox.receive()
                except anyio.EndOfStream:
                    break
                finally:
                    requests.scope = None
            if timer.cancelled_caught:
                if requests.due():
                    await builder.seal("commit")
                elif builder.seconds_left() <= 0:
                    await builder.seal("age")
                continue
            await builder.add(list(batch.bundles))
            if seal_early is not None and seal_early():
                await builder.seal("pressure")
            await builder.seal_if_due()
            await builder.seal_if_full()
        requests.ready = False
        await builder.seal("shutdown")


class SealRequests:
    """Requests to seal a shard's open segment for a committed job (one object per
    shard, shared by the builder and the job requests that wait on it)."""

    def __init__(self) -> None:
        self.jobs: dict[str, int] = {}  # job_id -> requests waiting for it
        self.seen = -1  # every sequence up to this one reached the builder
        self.open_jobs: set[str] = set()  # jobs with a bundle in the open segment
        self.last_segment = -1  # number of the last segment sealed (-1: none yet)
        self.ready = False  # the recovered bundles are in; False again at shutdown
        self.changes = Changes()  # the builder sealed or took a batch
        self.scope: anyio.CancelScope | None = None  # the builder's wait for a batch

    def due(self) -> bool:
        """Must the open segment be sealed now? (It holds a bundle of a job asked for.)"""
        return bool(self.jobs) and not self.open_jobs.isdisjoint(self.jobs)

    def done(self, job_id: str, sequence: int) -> bool:
        return self.ready and self.seen >= sequence and job_id not in self.open_jobs

    async def sealed_through(self, job_id: str, sequence: int) -> int:
        """Until every bundle of ``job_id`` is in a sealed segment, knowing that none has
        a sequence above ``sequence``; returns the number of the last segment sealed by
        then (finalized later). Other jobs' and untagged bundles are sealed with them
        when they share the open segment, and never on their own account."""
        self.jobs[job_id] = self.jobs.get(job_id, 0) + 1
        try:
            if self.due() and self.scope is not None:
                self.scope.cancel()
            while True:
                version = self.changes.version
                if self.done(job_id, sequence):
                    return self.last_segment
                await self.changes.wait_beyond(version)
        finally:
            left = self.jobs.pop(job_id) - 1
            if left:
                self.jobs[job_id] = left


class _Builder:
    def __init__(self, outbox: MemoryObjectSendStream[SealedSegment], cfg: SegmentConfig,
                 next_seq: int, limiter: CapacityLimiter, stats: SegmentMetrics,
                 log: Logger) -> None:
        self.outbox, self.cfg, self.limiter, self.stats, self.log = outbox, cfg, limiter, stats, log
        self.next_segment_seq = next_seq
        self.open = OpenSegment()
        self.opened_at: float | None = None
        self.from_wal = False
        self.seals = SealRequests()

    def seconds_left(self) -> float:
        if self.opened_at is None:
            return float("inf")
        age_limit = self.cfg.max_open_duration_ms / 1000
        return max(0.0, self.opened_at + age_limit - anyio.current_time())

    async def add(self, bundles: list[Bundle]) -> None:
        if self.opened_at is None:
            self.opened_at = anyio.current_time()
        segment = self.open
        seals = self.seals
        for b in bundles:  # an attribute per bundle, on the loop: no hop, no bytes
            if b.txn is not None:
                seals.open_jobs.add(b.txn.job_id)
        if self.from_wal:
            # No decode, no bytes touched: on the loop, once per batch (a thread hop
            # would cost more). Only bundles whose payloads must be decoded go on.
            bundles = bundles[segment.add_batch(bundles, decode=False):]
        if bundles:
            from_wal = self.from_wal

            def add_all() -> None:
                if from_wal:
                    segment.add_batch(bundles)
                else:
                    for b in bundles:
                        segment.add(b)

            await anyio.to_thread.run_sync(add_all, limiter=self.limiter)
        self._show(segment)
        if segment.last_sequence is not None:
            seals.seen = max(seals.seen, segment.last_sequence)
        seals.changes.notify()

    async def seal_if_due(self) -> None:
        if self.seals.due():
            await self.seal("commit")

    async def seal_if_full(self) -> None:
        if self.open.bytes >= self.cfg.target_size_bytes:
            await self.seal("size")
        elif self.open.stream_count >= self.cfg.max_streams:
            await self.seal("streams")

    async def seal(self, reason: SealReason) -> None:
        if self.open.bundle_count == 0:
            self.opened_at = None
            return
        sealed = SealedSegment(segment_seq=self.next_segment_seq, segment=self.open,
                               reason=reason)
        self.next_segment_seq += 1
        self.stats.sealed(reason).inc()
        self.open, self.opened_at = OpenSegment(), None
        self._show(self.open)
        await self.outbox.send(sealed)
        self.seals.last_segment = sealed.segment_seq
        self.seals.open_jobs = set()
        self.seals.changes.notify()

    def _show(self, segment: OpenSegment) -> None:
        self.stats.open_bundles.set(segment.bundle_count)
        self.stats.open_min_ts_ns = segment.min_ts or 0
        self.stats.open_bytes.set(segment.bytes)
        self.stats.open_streams.set(segment.stream_count)
