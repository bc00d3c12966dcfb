"""Segment builder: one per shard. Consumes DurableBatches, produces SealedSegments.

    wal_writer ──DurableBatch──▶ segment_builder ──SealedSegment──▶ finalizer

Bundles accumulate in an ``OpenSegment`` (per-stream accumulators keyed by
``(slot, schema fingerprint)`` plus the manifest). The segment is sealed when
it reaches ``target_size_bytes`` or ``max_streams``, when it has been open for
``max_open_duration_ms`` (a timer, not the next arrival), when ``seal_early()``
says so after a batch (WAL or disk near its bound: reason ``pressure``), and at
end of stream (shutdown). Each DurableBatch (one WAL commit) is added in one call
(``OpenSegment.add_batch``): bundles known from ingest validation cost one manifest
entry each, on the loop. Decoding Arrow payloads (replayed bundles) happens in one
worker-thread hop per batch.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.kernel.bundle import Bundle
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
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Accumulate and seal until ``inbox`` ends; the last open segment is sealed then.

    ``from_wal``: the finalizer reads payloads back from the WAL, so validated
    bundles are added without holding their bytes (``OpenSegment.add_batch``).
    """
    builder = _Builder(outbox, cfg, first_segment_seq, limiter, stats, log)
    builder.from_wal = from_wal
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
        while True:
            with anyio.move_on_after(builder.seconds_left()) as timer:
                try:
                    batch = await inbox.receive()
                except anyio.EndOfStream:
                    break
            if timer.cancelled_caught:
                await builder.seal("age")
                continue
            await builder.add(list(batch.bundles))
            if seal_early is not None and seal_early():
                await builder.seal("pressure")
            await builder.seal_if_full()
        await builder.seal("shutdown")


class _Builder:
    def __init__(self, outbox: MemoryObjectSendStream[SealedSegment], cfg: SegmentConfig,
                 next_seq: int, limiter: CapacityLimiter, stats: SegmentMetrics,
                 log: Logger) -> None:
        self.outbox, self.cfg, self.limiter, self.stats, self.log = outbox, cfg, limiter, stats, log
        self.next_segment_seq = next_seq
        self.open = OpenSegment()
        self.opened_at: float | None = None
        self.from_wal = False

    def seconds_left(self) -> float:
        if self.opened_at is None:
            return float("inf")
        age_limit = self.cfg.max_open_duration_ms / 1000
        return max(0.0, self.opened_at + age_limit - anyio.current_time())

    async def add(self, bundles: list[Bundle]) -> None:
        if self.opened_at is None:
            self.opened_at = anyio.current_time()
        segment = self.open
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

    def _show(self, segment: OpenSegment) -> None:
        self.stats.open_bundles.set(segment.bundle_count)
        self.stats.open_bytes.set(segment.bytes)
        self.stats.open_streams.set(segment.stream_count)
