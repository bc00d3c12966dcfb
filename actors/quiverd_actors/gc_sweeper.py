"""GC sweeper: one per shard. Deletes segments that are fully acked or past retention.

    ack_logger ──(Changes)──▶ gc_sweeper ──RetireSegments / SegmentsDeleted──▶ ack_logger
                                   └── refreshes the shard's RetentionGate (ingest backpressure)

Steady state: a segment every registered subscriber's mark covers is deleted.
Retention, per shard (``size_cap_bytes / shards``), over WAL + segments + ack.log:
- ``backpressure`` (default): the gate closes, producers wait or get AT_CAPACITY;
  nothing acknowledged is deleted. The gate reopens once acks free space.
- ``drop_oldest``: the oldest segments are deleted, after synthetic ``dropped``
  outcomes for every subscriber that lacked them are durable in ack.log.
``max_age_s`` deletes segments whose newest bundle is older (drop, then delete).

One sweep deletes in batches, one per reason, each in three steps: the
ack_logger retires the batch (``dropped`` outcomes durable first for a retention
reason; the segments leave the table, so the dispatcher stops reading them) →
one DELETED marker write, the unlinks, one directory fsync → SEGMENT_DELETED
records in one ack.log commit. A crash between steps is reconciled at startup: the
marker names the batch, so its files, gone without their SEGMENT_DELETED records, read
as deleted rather than lost. A marker write that finds no space (or fails before its
rename) changed nothing: it is tried again with backoff, and the sweeper waits.
"""

from __future__ import annotations

import time

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectSendStream

from quiverd.acks.state import AckState
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import RetentionConfig
from quiverd.kernel.faults import Hook
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import GcMetrics
from quiverd.kernel.reply import Reply
from quiverd.segments.files import NotWritten, delete_segments
from quiverd.segments.table import SegmentView
from quiverd_actors.messages import (
    AckLogRequest,
    Retired,
    RetireReason,
    RetireSegments,
    SegmentsDeleted,
)
from quiverd_actors.retention_gate import RetentionGate

SWEEP_INTERVAL_S = 1.0
RETRY_S = 0.05  # a DELETED marker that could not be written: doubling up to RETRY_MAX_S
RETRY_MAX_S = 2.0


async def run(
    ack_log: MemoryObjectSendStream[AckLogRequest],
    *,
    state: AckState,
    segments: SegmentView,
    shard: ShardLayout,
    cfg: RetentionConfig,
    gate: RetentionGate,
    over_cap: Changes,
    changes: Changes,
    limiter: CapacityLimiter,
    stats: GcMetrics,
    log: Logger,
    hook: Hook | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Sweep on every ack state change, when ingest hits the cap, and once a second."""
    sweeper = _Sweeper(ack_log, state, segments, shard, cfg, gate, limiter, stats, log)
    sweeper.hook = hook
    async with ack_log:
        task_status.started()
        while True:
            version, pressed = changes.version, over_cap.version
            await sweeper.sweep()
            with anyio.move_on_after(SWEEP_INTERVAL_S):
                async with anyio.create_task_group() as tg:
                    async def wake(c: Changes, v: int) -> None:
                        await c.wait_beyond(v)
                        tg.cancel_scope.cancel()
                    tg.start_soon(wake, changes, version)
                    tg.start_soon(wake, over_cap, pressed)


class _Sweeper:
    def __init__(self, ack_log: MemoryObjectSendStream[AckLogRequest], state: AckState,
                 segments: SegmentView, shard: ShardLayout, cfg: RetentionConfig,
                 gate: RetentionGate, limiter: CapacityLimiter, stats: GcMetrics,
                 log: Logger) -> None:
        self.ack_log, self.state, self.segments = ack_log, state, segments
        self.shard, self.cfg, self.gate, self.limiter = shard, cfg, gate, limiter
        self.stats, self.log = stats, log
        self.hook: Hook | None = None  # tests: "gc=kill:unlinked"

    async def sweep(self) -> None:
        self.stats.sweeps.inc()
        await self._delete([s for s in self.state.deletable_segments() if s in self.segments],
                           "acked")
        if self.cfg.max_age_s:
            horizon = time.time_ns() - self.cfg.max_age_s * 1_000_000_000
            await self._delete([s.segment_seq for s in self.segments if s.max_ts_ns < horizon],
                               "max_age")
        if self.cfg.size_cap_policy == "drop_oldest":
            await self._delete(self._oldest_over_cap(), "size_cap")
        self.gate.refresh()

    def _oldest_over_cap(self) -> list[int]:
        """The oldest segments whose bytes bring the shard back under its cap."""
        excess = self.gate.excess_bytes()
        picked: list[int] = []
        for seg in self.segments:
            if excess <= 0:
                break
            picked.append(seg.segment_seq)
            excess -= seg.size_bytes
        return picked

    async def _delete(self, seqs: list[int], reason: RetireReason) -> None:
        if not seqs:
            return
        reply: Reply[Retired] = Reply()
        await self.ack_log.send(RetireSegments(segment_seqs=tuple(seqs), reason=reason,
                                               reply=reply))
        retired = await reply.wait()
        if not retired.segments:
            return
        self._count_drops(retired, reason)
        await self._unlink(retired)
        self.stats.delete_batches.inc()
        n = len(retired.segments)
        self.stats.evictions(reason).inc(n)
        self.log.info("segments_deleted", reason=reason, segments=n,
                      first_segment_seq=retired.segments[0].segment_seq,
                      last_segment_seq=retired.segments[-1].segment_seq,
                      bytes=sum(s.size_bytes for s in retired.segments))
        await self.ack_log.send(SegmentsDeleted(
            segment_seqs=tuple(s.segment_seq for s in retired.segments), reason=reason))

    async def _unlink(self, retired: Retired) -> None:
        """delete_segments, again with backoff while its marker cannot be written.

        The batch has already left the segment table, so nothing reads these files;
        they stay on disk (and their bundles stay deliverable after a restart) until
        the marker is written."""
        delay, failed = RETRY_S, False
        while True:
            try:
                await anyio.to_thread.run_sync(
                    lambda: delete_segments(self.shard, retired.segments, hook=self.hook),
                    limiter=self.limiter)
                break
            except NotWritten as exc:
                if not failed:
                    self.log.warning("segment_delete_deferred", path=str(self.shard.deleted),
                                     error=str(exc), no_space=exc.no_space,
                                     segments=len(retired.segments),
                                     hint="free disk space; the deletion is tried again "
                                     "with backoff")
                failed = True
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        if failed:
            self.log.info("segment_delete_resumed", path=str(self.shard.deleted))

    def _count_drops(self, retired: Retired, reason: RetireReason) -> None:
        for sub, count in retired.dropped_by_subscriber.items():
            self.stats.dropped_bundles(sub).inc(count)
        self.stats.segments_dropped.inc(retired.segments_with_drops)
        if reason in self.stats.lost_bytes:  # max_age, size_cap (quiver_lost_bytes_total)
            self.stats.lost_bytes[reason].inc(retired.dropped_bytes)
        if retired.dropped_by_subscriber:
            self.log.warning("segments_dropped", reason=reason,
                             segments=retired.segments_with_drops,
                             dropped_by_subscriber=retired.dropped_by_subscriber)
