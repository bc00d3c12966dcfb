"""Ack logger: one per shard, the only writer of ack.log and of the shard's AckState.

    finalizer ──FinalizedSegment──┐
    dispatcher ─OutcomeRequest────┤
    admin ──────SubscriberRequest─┼─▶ ack_logger ──(Changes.notify)──▶ dispatcher, gc_sweeper
    gc_sweeper ─DropRequest───────┤
    gc_sweeper ─SegmentGone───────┘

Each batch of requests becomes ack.log records that are appended and covered by
one fdatasync (group commit); only then are they applied to the AckState and
the requesters told, so a high-water mark is never ahead of the durable acks.
A failed fdatasync raises DurabilityLost (fatal for the shard, never retried).
The log is compacted into one checkpoint once ``compact_threshold_bytes`` of
records accumulated, which bounds replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream

from actors.messages import (
    AckLogMessage,
    DropRequest,
    FinalizedSegment,
    OutcomeRequest,
    SegmentGone,
    SubscriberRequest,
)
from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile
from quiverd.acks.state import AckState
from quiverd.kernel.changes import Changes
from quiverd.kernel.errors import DurabilityLost, QuiverError

MAX_BATCH = 1024
COMPACT_THRESHOLD_BYTES = 4 * 1024 * 1024


@dataclass
class AckLogStats:
    records: int = 0
    fsyncs: int = 0
    compactions: int = 0
    log_bytes: int = 0
    segments_deleted: dict[str, int] = field(default_factory=dict)  # by reason
    dropped_bundles: dict[str, int] = field(default_factory=dict)  # by subscriber
    segments_dropped: int = 0


async def run(
    inbox: MemoryObjectReceiveStream[AckLogMessage],
    *,
    state: AckState,
    file: AckLogFile,
    segments: dict[int, Any],
    on_segment: Any,
    changes: Changes,
    limiter: CapacityLimiter,
    stats: AckLogStats,
    log: Any,
    compact_threshold_bytes: int = COMPACT_THRESHOLD_BYTES,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Make requests durable in ack.log, apply them, notify; until ``inbox`` ends."""
    stats.log_bytes = file.size
    async with inbox:
        task_status.started()
        try:
            async for first in inbox:
                batch = [first]
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(inbox.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                for chunk in _split_at_subscriber_ops(batch):
                    await _commit(chunk, state, file, segments, on_segment, limiter, stats, log)
                changes.notify()
                if file.should_compact(compact_threshold_bytes):
                    stats.log_bytes = await anyio.to_thread.run_sync(file.compact, state,
                                                                     limiter=limiter)
                    stats.compactions += 1
                    log.info("ack_log_compacted", bytes=stats.log_bytes)
        finally:
            await anyio.to_thread.run_sync(file.close, limiter=limiter)


def _split_at_subscriber_ops(batch: list[AckLogMessage]) -> list[list[AckLogMessage]]:
    """A subscriber add takes its id when applied: at most one per durable batch."""
    chunks: list[list[AckLogMessage]] = [[]]
    for msg in batch:
        if isinstance(msg, SubscriberRequest) and any(
                isinstance(m, SubscriberRequest) for m in chunks[-1]):
            chunks.append([])
        chunks[-1].append(msg)
    return chunks


async def _commit(chunk: list[AckLogMessage], state: AckState, file: AckLogFile,
                  segments: dict[int, Any], on_segment: Any, limiter: CapacityLimiter,
                  stats: AckLogStats, log: Any) -> None:
    records: list[Any] = []
    done: list[tuple[Any, Any]] = []  # (callback, result) to call after apply
    for msg in chunk:
        try:
            recs, result = _propose(msg, state)
        except (QuiverError, ValueError, KeyError) as exc:
            done.append((getattr(msg, "on_done", None), exc))
            continue
        records += recs
        done.append((getattr(msg, "on_done", None), result))
    if records:
        encoded = [fmt.encode(r) for r in records]
        try:
            await anyio.to_thread.run_sync(_append_sync, file, encoded, limiter=limiter)
        except OSError as exc:
            raise DurabilityLost(f"ack.log write/fdatasync failed at {file.path}: "
                                 f"{exc.strerror or exc}; the shard stops") from exc
        stats.fsyncs += 1
        stats.records += len(records)
        stats.log_bytes = file.size
        for r in records:
            state.apply(r)
    for msg in chunk:
        _after_apply(msg, segments, on_segment, stats)
    for callback, result in done:
        if callback is not None:
            callback(result)


def _append_sync(file: AckLogFile, encoded: list[bytes]) -> None:
    file.append(encoded)
    file.sync()


def _propose(msg: AckLogMessage, state: AckState) -> tuple[list[Any], Any]:
    if isinstance(msg, FinalizedSegment):
        if msg.segment_seq in state.live_segments():
            return [], None  # announced by recovery already
        return [state.segment_finalized(msg.segment_seq, msg.bundle_count)], None
    if isinstance(msg, OutcomeRequest):
        rec = state.record_outcome(msg.subscriber, msg.segment_seq, msg.bundle_index, msg.outcome)
        return ([rec] if rec is not None else []), rec
    if isinstance(msg, SubscriberRequest):
        if msg.op == "add":
            return [state.add_subscriber(msg.name, msg.start)], msg.name  # type: ignore[arg-type]
        return [state.remove_subscriber(msg.name)], msg.name
    if isinstance(msg, DropRequest):
        plan = state.drop_segment(msg.segment_seq)
        return list(plan.records), dict(plan.dropped_by_subscriber)
    return [state.segment_deleted(msg.segment_seq)], None


def _after_apply(msg: AckLogMessage, segments: dict[int, Any], on_segment: Any,
                 stats: AckLogStats) -> None:
    """Keep the shard's segment table in step with what ack.log now says."""
    if isinstance(msg, FinalizedSegment):
        on_segment(msg)
    elif isinstance(msg, SegmentGone):
        segments.pop(msg.segment_seq, None)
        stats.segments_deleted[msg.reason] = stats.segments_deleted.get(msg.reason, 0) + 1
