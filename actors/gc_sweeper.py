"""GC sweeper: one per shard. Deletes segments that are fully acked or past retention.

    ack_logger ──(Changes)──▶ gc_sweeper ──DropRequest / SegmentGone──▶ ack_logger
                                   └── sets the shard's RetentionGate (ingest backpressure)

Steady state: a segment every registered subscriber's mark covers is deleted.
Retention, per shard (``size_cap_bytes / shards``), over WAL + segments + ack.log:
- ``backpressure`` (default): the gate closes, producers wait or get AT_CAPACITY;
  nothing acknowledged is deleted. The gate reopens once acks free space.
- ``drop_oldest``: the oldest segments are deleted, after synthetic ``dropped``
  outcomes for every subscriber that lacked them are durable in ack.log.
``max_age_s`` deletes segments whose newest bundle is older (drop, then delete).

Deleting is: raise the DELETED marker (replay must not resurrect the segment's
WAL entries) → unlink → fsync(dir) → SEGMENT_DELETED in ack.log.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectSendStream

from actors.messages import AckLogMessage, DropRequest, SegmentGone
from quiverd.acks.state import AckState
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import RetentionConfig
from quiverd.kernel.durable import fsync_dir
from quiverd.segments.markers import DELETED, Deleted, read_marker, write_marker

SWEEP_INTERVAL_S = 1.0


@dataclass
class RetentionGate:
    """Closed while the shard is over its size cap under ``backpressure``."""

    cap_bytes: int
    usage: Any  # callable() -> bytes used by the shard
    closed: bool = False
    opened: anyio.Event = field(default_factory=anyio.Event)
    throttled: int = 0  # quiver_ingest_throttle_total

    def over(self) -> bool:
        return self.cap_bytes > 0 and self.usage() >= self.cap_bytes

    def refresh(self) -> None:
        self.closed = self.over()
        if not self.closed:
            self.opened.set()
            self.opened = anyio.Event()


@dataclass
class GcStats:
    evictions: dict[str, int] = field(default_factory=dict)  # quiver_gc_evictions_total{reason}
    segments_dropped: int = 0  # quiver_segment_dropped_total
    dropped_bundles: dict[str, int] = field(default_factory=dict)  # {subscriber}


async def run(
    ack_log: MemoryObjectSendStream[AckLogMessage],
    *,
    state: AckState,
    segments: dict[int, Any],
    segments_dir: Path,
    cfg: RetentionConfig,
    gate: RetentionGate,
    pressure: Changes,
    changes: Changes,
    limiter: CapacityLimiter,
    stats: GcStats,
    log: Any,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Sweep on every state change, on ingest pressure and once a second."""
    sweeper = _Sweeper(ack_log, state, segments, segments_dir, cfg, gate, limiter, stats, log)
    async with ack_log:
        task_status.started()
        while True:
            version, pressed = changes.version, pressure.version
            await sweeper.sweep()
            with anyio.move_on_after(SWEEP_INTERVAL_S):
                async with anyio.create_task_group() as tg:
                    async def wake(c: Changes, v: int) -> None:
                        await c.wait_beyond(v)
                        tg.cancel_scope.cancel()
                    tg.start_soon(wake, changes, version)
                    tg.start_soon(wake, pressure, pressed)


class _Sweeper:
    def __init__(self, ack_log: MemoryObjectSendStream[AckLogMessage], state: AckState,
                 segments: dict[int, Any], segments_dir: Path, cfg: RetentionConfig,
                 gate: RetentionGate, limiter: CapacityLimiter, stats: GcStats,
                 log: Any) -> None:
        self.ack_log, self.state, self.segments = ack_log, state, segments
        self.dir, self.cfg, self.gate, self.limiter = segments_dir, cfg, gate, limiter
        self.stats, self.log = stats, log

    async def sweep(self) -> None:
        for seq in self.state.deletable_segments():
            if seq in self.segments:
                await self._delete(seq, "acked")
        if self.cfg.max_age_s:
            horizon = time.time_ns() - self.cfg.max_age_s * 1_000_000_000
            for seq in sorted(self.segments):
                if seq in self.segments and self.segments[seq].max_ts_ns < horizon:
                    await self._drop_and_delete(seq, "max_age")
        if self.cfg.size_cap_policy == "drop_oldest":
            while self.gate.over() and self._oldest() is not None:
                await self._drop_and_delete(self._oldest(), "size_cap")  # type: ignore[arg-type]
        self.gate.refresh()

    def _oldest(self) -> int | None:
        return min(self.segments) if self.segments else None

    async def _drop_and_delete(self, seq: int, reason: str) -> None:
        done = anyio.Event()
        result: dict[str, Any] = {}

        def on_done(counts: Any) -> None:
            result["counts"] = counts
            done.set()

        await self.ack_log.send(DropRequest(segment_seq=seq, on_done=on_done))
        await done.wait()
        counts = result["counts"]
        if isinstance(counts, Exception):
            raise counts
        for sub, n in counts.items():
            self.stats.dropped_bundles[sub] = self.stats.dropped_bundles.get(sub, 0) + n
        if counts:
            self.stats.segments_dropped += 1
            self.log.warning("segment_dropped", segment_seq=seq, reason=reason,
                             dropped_by_subscriber=counts)
        await self._delete(seq, reason)

    async def _delete(self, seq: int, reason: str) -> None:
        # Out of the table first, so the dispatcher stops reading it; the file goes
        # next, and SEGMENT_DELETED last (recovery reconciles a crash in between).
        info = self.segments.pop(seq)
        await anyio.to_thread.run_sync(_unlink_segment, self.dir, info.path,
                                       info.last_sequence, limiter=self.limiter)
        self.stats.evictions[reason] = self.stats.evictions.get(reason, 0) + 1
        self.log.info("segment_deleted", segment_seq=seq, reason=reason, bytes=info.size_bytes)
        await self.ack_log.send(SegmentGone(segment_seq=seq, reason=reason))


def _unlink_segment(segments_dir: Path, path: Path, last_sequence: int) -> None:
    marker = segments_dir / DELETED
    current = read_marker(marker, Deleted)
    if last_sequence > current.wal_sequence:
        write_marker(marker, Deleted(wal_sequence=last_sequence))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fsync_dir(segments_dir)
