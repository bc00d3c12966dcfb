"""Finalizer: one per shard. Consumes SealedSegments, produces SegmentWritten.

    segment_builder ──SealedSegment──▶ finalizer ──SegmentWritten──▶ ack_logger
                                           └──────WalReleased──────▶ wal_writer

Each segment is encoded and written in a worker thread under the named
``finalize`` limiter: ``<seq>.qseg.tmp`` → fsync → rename → fsync(dir) → 0440 (its
page-cache pages are then given back: the next segment writes into warm pages),
then the FLOOR marker rises. Only after that does the WAL region it covers get
released, so a crash at any step leaves every acknowledged bundle in the WAL,
in the segment, or both (replay skips WAL entries a durable segment already
holds). The ack_logger lists the segment once ack.log records it; from then on
the dispatcher delivers it.

A write that fails before its rename (ENOSPC, EIO, a failed fsync of the temp
file, or less than ``reserve_bytes`` free) touched only its temp file, which is
removed: ``segment_write_failed`` is logged and the same bytes are written again
with backoff (``actors.retry``), while the WAL still holds every bundle. A
failed FLOOR write is retried on its own, the segment is not written twice.
A failure after a rename (the directory fsync) leaves the durable state
unknown: DurabilityLost, the daemon stops (exit 70) and replay sorts it out.

A bundle that makes the encoder raise (it passed validation: an Arrow edge case, a
bug) would stop the shard, and replay would bring it back: a crash loop. The segment
is rebuilt without it (``segments.salvage``), its WAL entry copied to quarantine/, and
it is reported lost with its id (``bundles_lost``, ``on_lost``); the WAL is released
past it all the same, so the next start does not meet it again.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.kernel.faults import Hook, prefixed
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import SegmentMetrics
from quiverd.kernel.quarantine import keep_bytes
from quiverd.segments.files import Floor, NotWritten, checked_write, write_segment
from quiverd.segments.format import Arena, Piece, encode_segment
from quiverd.segments.lost import add_sequences
from quiverd.segments.open_segment import Fetch, OpenSegment
from quiverd.segments.salvage import WalSource, is_refusal, without_refused
from quiverd.segments.table import SegmentInfo, StagedRef
from quiverd_actors.messages import SealedSegment, SegmentWritten, WalReleased
from quiverd_actors.retry import Retry

# Kept free by segment writes for what drains a full disk: ack.log records (which
# let the gc delete segments), the FLOOR/DELETED markers and the WAL sidecar.
METADATA_RESERVE_BYTES = 8 * 1024 * 1024
MARKER_MODE = 0o644


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
    reserve_bytes: int = 0,
    fetch: Fetch | None = None,
    salvage: WalSource | None = None,
    on_lost: Callable[[int], None] | None = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Write every sealed segment durably, then release its WAL region and announce it.

    ``fetch`` reads WAL entries back (``WalFiles.read_back``) for bundles the open
    segment did not hold (``OpenSegment.load``); ``salvage`` (the WalFiles) rebuilds a
    segment around bundles that make the encoder raise, and ``on_lost(sequence)``
    hears of each such bundle (status, metric).
    """
    retry = Retry(log)
    arena = Arena()  # warm memory the segments are encoded into, one after the other
    async with inbox, outbox, releases:
        task_status.started()
        async for sealed in inbox:
            segment = sealed.segment
            job = _Finalize(shard, sealed.segment_seq, segment, max_dictionary_cardinality,
                            hook, reserve_bytes, fetch, arena, salvage)
            size = await _until_written(job, limiter, retry, stats)
            assert segment.last_sequence is not None
            released = segment.last_sequence  # refused bundles included: never met again
            _report_refused(job, log, on_lost)
            # Nothing may read the batches any more: the WAL region they map is released.
            # (The worker thread let go of them already; these find empty streams.)
            segment.drop_batches()
            segment = job.segment  # rebuilt without refused bundles, or the same
            segment.drop_batches()
            if segment.bundle_count == 0:  # every bundle refused: no segment file
                await releases.send(WalReleased(upto_sequence=released))
                continue
            stats.finalized.inc()
            stats.finalized_bytes.inc(size)
            log.info("segment_finalized", segment_seq=sealed.segment_seq, bytes=size,
                     bundles=segment.bundle_count, streams=segment.stream_count,
                     reason=sealed.reason)
            assert segment.first_sequence is not None and segment.last_sequence is not None
            assert job.staged is not None
            await releases.send(WalReleased(upto_sequence=released))
            await outbox.send(SegmentWritten(info=SegmentInfo(
                segment_seq=sealed.segment_seq, path=job.path,
                bundle_count=segment.bundle_count, size_bytes=size,
                first_sequence=segment.first_sequence, last_sequence=segment.last_sequence,
                min_ts_ns=segment.min_ts or 0, max_ts_ns=segment.max_ts or 0,
                staged=job.staged)))


async def _until_written(job: _Finalize, limiter: CapacityLimiter, retry: Retry,
                         stats: SegmentMetrics) -> int:
    """One worker hop per attempt; a failure before a rename waits and tries again."""
    while True:
        try:
            size = await anyio.to_thread.run_sync(job.attempt, limiter=limiter)
        except NotWritten as exc:
            stats.write_failures.inc()
            if exc.no_space:
                stats.no_space.inc()
            retry.failed("segment_write_failed", repeat=True, segment_seq=job.segment_seq,
                         error=str(exc), errno=errno.errorcode.get(exc.errno or 0, "?"),
                         hint=exc.hint)
            await retry.pause()
            continue
        retry.succeeded("segment_write_recovered", segment_seq=job.segment_seq)
        return size


def _report_refused(job: _Finalize, log: Logger,
                    on_lost: Callable[[int], None] | None) -> None:
    """One ``bundles_lost`` event per refused bundle (a few per segment at most)."""
    for seq, (error, kept) in sorted(job.refused.items()):
        log.error("bundles_lost", first_sequence=seq, last_sequence=seq, bundles=1,
                  segment_seq=job.segment_seq, error=error, quarantine=str(kept),
                  hint="this bundle passed validation but the segment encoder refused it "
                  "(a bug: report it with the quarantined WAL entry); the rest of its "
                  "segment was finalized")
        if on_lost is not None:
            on_lost(seq)


@dataclass
class _Finalize:
    """One segment's way to disk; each attempt resumes after the last step that held."""

    shard: ShardLayout
    segment_seq: int
    segment: OpenSegment
    max_dictionary_cardinality: int
    hook: Hook | None
    reserve_bytes: int
    fetch: Fetch | None = None
    arena: Arena | None = None
    salvage: WalSource | None = None
    refused: dict[int, tuple[str, Path]] = field(default_factory=dict)  # seq -> error, copy
    refused_recorded: bool = False  # lost.json names them
    pieces: list[Piece] | None = None  # encoded once, kept until the file is durable
    staged: dict[int, StagedRef] | None = None
    size: int | None = None  # set once the segment file is durable
    floor_raised: bool = False

    @property
    def path(self) -> Path:
        return self.shard.segment(self.segment_seq)

    def attempt(self) -> int:
        """Encode, write the segment, raise the floor (worker thread); returns its size."""
        if self.size is None:
            if self.pieces is None:
                if self.segment.unloaded:
                    if self.fetch is None:
                        raise AssertionError("open segment left bundles in the WAL, no fetch")
                    self.segment.load(self.fetch)
                self.pieces = self._encode_or_salvage()
                self.staged = self.segment.staged()
            if self.refused and not self.refused_recorded:
                # Durable before the WAL releases them: reported once (the next start
                # lists them as known) and their sequences are never handed out again.
                add_sequences(self.shard.lost_record, self.refused)
                self.refused_recorded = True
            if self.segment.bundle_count == 0:
                self.size = 0  # every bundle refused: nothing to write
            else:
                self.size = write_segment(self.path, self.pieces, hook=self.hook,
                                          reserve_bytes=self.reserve_bytes)
            self.pieces = None  # the encoded copy is no longer needed
        if not self.floor_raised:
            floor = msgspec.json.encode(Floor(segment_seq=self.segment_seq))
            checked_write(self.shard.floor, floor, mode=MARKER_MODE,
                          hook=prefixed(self.hook, "floor_"))
            self.floor_raised = True
            if self.hook is not None:
                self.hook("floor_written")
        # Durable: let go of the batches here, in the worker thread. Freeing a segment's
        # thousands of Arrow objects on the event loop held the GIL there.
        self.segment.drop_batches()
        return self.size

    def _encode(self, segment: OpenSegment) -> list[Piece]:
        if self.hook is not None:  # tests: "finalize=raise:encode_sequence_7"
            for e in segment.entries:
                self.hook(f"encode_sequence_{e.sequence}")
        return encode_segment(segment, max_dictionary_cardinality=self.max_dictionary_cardinality,
                              arena=self.arena)

    def _encode_or_salvage(self) -> list[Piece]:
        try:
            return self._encode(self.segment)
        except Exception as exc:
            if self.salvage is None or not is_refusal(exc):
                raise
        salvaged, refused = without_refused(self.segment, self.salvage, self._encode)
        copies = self.salvage.entry_bytes(sorted(refused))
        for seq, error in refused.items():
            name = f"refused-{seq:016d}.walentry"
            try:
                kept = keep_bytes(copies[seq], self.shard.quarantine_dir, name)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # Nothing changed yet (the segment is still whole, nothing released):
                # the next attempt refuses and copies again.
                raise NotWritten(self.shard.quarantine_dir / name, exc) from exc
            self.refused[seq] = (error, kept)
        self.segment.drop_batches()  # the salvaged segment holds batches of its own
        self.segment = salvaged
        return self._encode(salvaged) if salvaged.bundle_count else []
