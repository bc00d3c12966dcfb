"""Finalizer: one per shard. Consumes SealedSegments, produces FinalizedSegments.

    segment_builder ──SealedSegment──▶ finalizer ──FinalizedSegment──▶ dispatcher
                                           └──────WalReleased──────▶ wal_writer

Each segment is encoded and written in a worker thread under the named
``finalize`` limiter: ``<seq>.qseg.tmp`` → fsync → rename → fsync(dir) → 0440.
Only after that does the WAL region it covers get released, so a crash at any
step leaves every acknowledged bundle in the WAL, in the segment, or both
(replay skips WAL entries a durable segment already holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.messages import FinalizedSegment, SealedSegment, WalReleased
from quiverd.segments.format import encode_segment, write_segment
from quiverd.segments.markers import FLOOR, Floor, write_marker


@dataclass
class FinalizerStats:
    segments: int = 0
    bytes: int = 0
    last_segment_seq: int = 0


def segment_path(segments_dir: Path, segment_seq: int) -> Path:
    return segments_dir / f"{segment_seq:016d}.qseg"


async def run(
    inbox: MemoryObjectReceiveStream[SealedSegment],
    outbox: MemoryObjectSendStream[FinalizedSegment],
    releases: MemoryObjectSendStream[WalReleased],
    *,
    segments_dir: Path,
    max_dictionary_cardinality: int,
    limiter: CapacityLimiter,
    stats: FinalizerStats,
    log: Any,
    hook: Any = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Write every sealed segment durably, then release its WAL region and announce it."""
    async with inbox, outbox, releases:
        task_status.started()
        async for sealed in inbox:
            path = segment_path(segments_dir, sealed.segment_seq)
            segment = sealed.segment
            size = await anyio.to_thread.run_sync(
                _write, path, segment, max_dictionary_cardinality, hook, limiter=limiter)
            stats.segments += 1
            stats.bytes += size
            stats.last_segment_seq = sealed.segment_seq
            log.info("segment_finalized", segment_seq=sealed.segment_seq, bytes=size,
                     bundles=segment.bundle_count, streams=segment.stream_count,
                     reason=sealed.reason)
            await releases.send(WalReleased(upto_sequence=segment.last_sequence))
            await outbox.send(FinalizedSegment(
                segment_seq=sealed.segment_seq, path=str(path), bundle_count=segment.bundle_count,
                size_bytes=size, first_sequence=segment.first_sequence,
                last_sequence=segment.last_sequence, min_ts_ns=segment.min_ts or 0,
                max_ts_ns=segment.max_ts or 0))


def _write(path: Path, segment: Any, max_dictionary_cardinality: int, hook: Any) -> int:
    """Encode and durably write one segment, then raise the floor (worker thread)."""
    pieces = encode_segment(segment, max_dictionary_cardinality=max_dictionary_cardinality)
    size = write_segment(path, pieces, hook=hook)
    write_marker(path.parent / FLOOR, Floor(segment_seq=int(path.stem)))
    if hook is not None:
        hook("floor_written")
    return size
