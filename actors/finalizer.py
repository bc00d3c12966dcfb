"""Finalizer: one per shard. Consumes SealedSegments, produces SegmentWritten.

    segment_builder ──SealedSegment──▶ finalizer ──SegmentWritten──▶ ack_logger
                                           └──────WalReleased──────▶ wal_writer

Each segment is encoded and written in a worker thread under the named
``finalize`` limiter: ``<seq>.qseg.tmp`` → fsync → rename → fsync(dir) → 0440,
then the FLOOR marker rises. Only after that does the WAL region it covers get
released, so a crash at any step leaves every acknowledged bundle in the WAL,
in the segment, or both (replay skips WAL entries a durable segment already
holds). The ack_logger lists the segment once ack.log records it; from then on
the dispatcher delivers it.
"""

from __future__ import annotations

from pathlib import Path

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.messages import SealedSegment, SegmentWritten, WalReleased
from quiverd.kernel.faults import Hook
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import SegmentMetrics
from quiverd.segments.files import Floor, write_marker, write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.table import SegmentInfo


async def run(
    inbox: MemoryObjectReceiveStream[SealedSegment],
    outbox: MemoryObjectSendStream[SegmentWritten],
    releases: MemoryObjectSendStream[WalReleased],
    *,
    shard: ShardLayout,
    max_dictionary_cardinality: int,
    limiter: CapacityLimiter,
    stats: SegmentMetrics,
    log: Logger,
    hook: Hook | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Write every sealed segment durably, then release its WAL region and announce it."""
    async with inbox, outbox, releases:
        task_status.started()
        async for sealed in inbox:
            path = shard.segment(sealed.segment_seq)
            segment = sealed.segment
            size = await anyio.to_thread.run_sync(
                _write, shard, path, sealed.segment_seq, segment, max_dictionary_cardinality,
                hook, limiter=limiter)
            stats.finalized.inc()
            stats.finalized_bytes.inc(size)
            log.info("segment_finalized", segment_seq=sealed.segment_seq, bytes=size,
                     bundles=segment.bundle_count, streams=segment.stream_count,
                     reason=sealed.reason)
            assert segment.first_sequence is not None and segment.last_sequence is not None
            await releases.send(WalReleased(upto_sequence=segment.last_sequence))
            await outbox.send(SegmentWritten(info=SegmentInfo(
                segment_seq=sealed.segment_seq, path=path, bundle_count=segment.bundle_count,
                size_bytes=size, first_sequence=segment.first_sequence,
                last_sequence=segment.last_sequence, min_ts_ns=segment.min_ts or 0,
                max_ts_ns=segment.max_ts or 0)))


def _write(shard: ShardLayout, path: Path, segment_seq: int, segment: OpenSegment,
           max_dictionary_cardinality: int, hook: Hook | None) -> int:
    """Encode and durably write one segment, then raise the floor (worker thread)."""
    pieces = encode_segment(segment, max_dictionary_cardinality=max_dictionary_cardinality)
    size = write_segment(path, pieces, hook=hook)
    write_marker(shard.floor, Floor(segment_seq=segment_seq))
    if hook is not None:
        hook("floor_written")
    return size
