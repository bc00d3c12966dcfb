"""Scrubber: one per shard. Checks every byte of the shard's segments off the startup
path, and quarantines a segment that fails, whichever check found it.

    SegmentView ──▶ scrubber ──RetireSegments("corrupt"), SegmentsDeleted──▶ ack_logger
                       ▲
    dispatcher._reader ┘ SegmentChecks.open_reader: the whole-file CRC before a segment
                         recovery did not check in full is first delivered (subscribers
                         and the uploader alike), from the dispatcher's read thread

Recovery trusts a version 2 segment on its metadata CRC alone (quiverd.segments.format),
so its stream bytes are checked later: before they are first delivered, and by this
actor's passes over every segment at ``rate_bytes_per_s`` (``[scrub] rate_mb_per_s``
split evenly over shards; the segments recovery did not check come first). A pass
starts ``pass_interval_s`` after the previous one started, or when it ends if it took
longer.

A bad segment found at run time is handled as recovery handles one: it leaves the
segment table (``RetireSegments`` with reason ``corrupt``: no ``dropped`` outcomes,
the dispatcher stops reading it), moves to ``quarantine/``, its bundles ``(shard,
segment_seq, 0..bundle_count-1)`` are reported lost (``bundles_lost``: the WAL
released them when the segment was written; the segments the WAL still held at
startup were checked in full then), and ack.log forgets it (SEGMENT_DELETED), so no
subscriber waits for them. A crash between the steps is finished by the next
recovery: a file still in place is found again, one already quarantined is a gone
segment ack.log still lists, reported and forgotten there.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectSendStream

from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.layout import ShardLayout
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import ScrubMetrics
from quiverd.kernel.reply import Reply
from quiverd.segments.files import quarantine_segment
from quiverd.segments.reader import MIN_FILE_LEN
from quiverd.segments.table import SegmentInfo, SegmentView
from quiverd_actors.messages import AckLogRequest, Retired, RetireSegments, SegmentsDeleted
from quiverd_actors.segment_checks import SegmentChecks

MAX_CHUNK_BYTES = 4 * 1024 * 1024  # one worker hop reads and CRCs at most this much
MIN_CHUNK_BYTES = 64 * 1024
CHUNKS_PER_S = 8  # at low rates, smaller chunks keep the reads smooth


async def run(
    ack_log: MemoryObjectSendStream[AckLogRequest],
    *,
    shard: int,
    layout: ShardLayout,
    segments: SegmentView,
    checks: SegmentChecks,
    rate_bytes_per_s: float,
    pass_interval_s: float,
    limiter: CapacityLimiter,
    stats: ScrubMetrics,
    log: Logger,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Quarantine what checks find; scrub at the rate (0: no passes); until cancelled."""
    checks.bind()
    scrubber = _Scrubber(ack_log, shard, layout, segments, checks, limiter, stats, log)
    async with ack_log, anyio.create_task_group() as tg:
        tg.start_soon(scrubber.quarantine_found)
        if rate_bytes_per_s > 0:
            tg.start_soon(scrubber.passes, rate_bytes_per_s, pass_interval_s)
        task_status.started()


class _Scrubber:
    def __init__(self, ack_log: MemoryObjectSendStream[AckLogRequest], shard: int,
                 layout: ShardLayout, segments: SegmentView, checks: SegmentChecks,
                 limiter: CapacityLimiter, stats: ScrubMetrics, log: Logger) -> None:
        self.ack_log, self.shard, self.layout = ack_log, shard, layout
        self.segments, self.checks, self.limiter = segments, checks, limiter
        self.stats, self.log = stats, log

    async def quarantine_found(self) -> None:
        while True:
            version = self.checks.changes.version
            for seq, (error, found_by) in self.checks.take_found().items():
                await self._quarantine(seq, error, found_by)
            await self.checks.changes.wait_beyond(version)

    async def passes(self, rate_bytes_per_s: float, pass_interval_s: float) -> None:
        chunk = int(min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, rate_bytes_per_s / CHUNKS_PER_S)))
        while True:
            started = anyio.current_time()
            self.checks.prune(self.segments.seqs())
            # Those no CRC has checked yet first, then the rest, oldest first.
            todo = sorted(self.segments, key=lambda s: (not self.checks.is_unverified(
                s.segment_seq), s.segment_seq))
            self.checks.pass_bytes = sum(s.size_bytes for s in todo)
            self.checks.pass_done_bytes = 0
            self.log.info("scrub_pass_started", segments=len(todo),
                          bytes=self.checks.pass_bytes, rate_bytes_per_s=int(rate_bytes_per_s))
            for info in todo:
                await self._scrub(info, rate_bytes_per_s, chunk)
                self.checks.pass_done_bytes += info.size_bytes
            self.stats.passes.inc()
            self.log.info("scrub_pass_finished", segments=len(todo),
                          seconds=round(anyio.current_time() - started, 3))
            await anyio.sleep(max(0.0, started + pass_interval_s - anyio.current_time()))

    async def _scrub(self, info: SegmentInfo, rate: float, chunk: int) -> None:
        """One segment's whole-file CRC, read in chunks at ``rate`` bytes per second."""
        seq = info.segment_seq
        if seq not in self.segments or self.checks.is_found(seq):
            return
        try:
            check = await anyio.to_thread.run_sync(_FileCheck, info.path, limiter=self.limiter)
        except FileNotFoundError:
            return  # deleted by the gc meanwhile
        except CorruptRecord as exc:
            self.checks.report(seq, str(exc), "scrub")
            return
        try:
            started = anyio.current_time()
            while not check.done:
                n = await anyio.to_thread.run_sync(check.step, chunk, limiter=self.limiter)
                self.stats.bytes.inc(n)
                if seq not in self.segments:
                    return  # retired meanwhile: its verdict no longer matters
                await anyio.sleep(max(0.0, started + check.offset / rate - anyio.current_time()))
            if check.error is not None:
                self.checks.report(seq, check.error, "scrub")
                return
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(check.close, limiter=self.limiter)
        self.checks.mark_verified(seq)
        self.stats.segments.inc()

    async def _quarantine(self, seq: int, error: str, found_by: str) -> None:
        """Out of the table, into quarantine/, its bundles reported lost, forgotten by
        ack.log: what recovery does for a bad segment the WAL no longer holds."""
        reply: Reply[Retired] = Reply()
        await self.ack_log.send(RetireSegments(segment_seqs=(seq,), reason="corrupt",
                                               reply=reply))
        retired = await reply.wait()
        if not retired.segments:
            return  # already retired by the gc: nothing is delivered from it any more
        [info] = retired.segments
        try:
            moved = await anyio.to_thread.run_sync(
                quarantine_segment, self.layout, info.path, error, self.log,
                limiter=self.limiter)
        except FileNotFoundError:
            moved = None
        n = info.bundle_count
        self.stats.corrupt(found_by).inc()
        self.stats.bundles_lost.inc(n)
        self.stats.lost_bytes.inc(info.size_bytes)
        self.log.error("bundles_lost", shard=self.shard, segment_seq=seq, bundle_count=n,
                       bundle_ids=f"({self.shard}, {seq}, 0..{n - 1})" if n else None,
                       first_sequence=info.first_sequence, last_sequence=info.last_sequence,
                       found_by=found_by,
                       hint="its segment failed its CRC check after startup and the WAL no "
                       "longer holds these bundles; the file is in quarantine/")
        self.checks.quarantined.append({
            "segment_seq": seq, "found_by": found_by, "error": error,
            "moved_to": str(moved) if moved else None, "bundle_count": n,
            "first_sequence": info.first_sequence, "last_sequence": info.last_sequence})
        await self.ack_log.send(SegmentsDeleted(segment_seqs=(seq,), reason="corrupt"))


class _FileCheck:
    """A segment's whole-file CRC, computed a chunk at a time (blocking methods).

    The CRC covers every byte but its own four, metadata included, and recovery (or
    this process's finalizer) already parsed the metadata: a match is all that is
    left to check. One descriptor is kept, so a file unlinked meanwhile reads to
    the end."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        if self.size < MIN_FILE_LEN:
            os.close(self.fd)
            raise CorruptRecord(self.path, 0, f"truncated: {self.size} bytes")
        self.stored = int.from_bytes(os.pread(self.fd, 4, self.size - 4), "little")
        self.offset = 0
        self.crc = 0
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.offset >= self.size - 4

    def step(self, chunk: int) -> int:
        n = min(chunk, self.size - 4 - self.offset)
        data = os.pread(self.fd, n, self.offset)
        if len(data) != n:
            self.error = f"{self.path}: short read at offset {self.offset}"
            self.offset = self.size
            return len(data)
        self.crc = crc32c(data, self.crc)
        self.offset += n
        if self.done and self.crc != self.stored:
            self.error = str(CorruptRecord(self.path, self.size - 4, f"crc mismatch: stored "
                                           f"{self.stored:#010x}, got {self.crc:#010x}"))
        return n

    def close(self) -> None:
        os.close(self.fd)
