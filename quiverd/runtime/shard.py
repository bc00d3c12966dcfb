"""One shard: its directory (``kernel.layout.ShardLayout``), its recovery, its actors.

    ingest ─AppendRequests─▶ wal_writer ─DurableBatch(64)─▶ segment_builder
                                   ▲                              │ SealedSegment(1)
                                   └──────WalReleased(16)──── finalizer
                                                                  │ SegmentWritten
    dispatcher ─RecordOutcome──▶ ┌────────────┐ ◀─────────────────┘
    admin ─ChangeSubscriber────▶ │ ack_logger │ (256) owns ack.log, AckState, SegmentTable
    gc_sweeper ─RetireSegments─▶ └────────────┘ ──(Changes)──▶ dispatcher, gc_sweeper
               ─SegmentsDeleted▶       ▲
    scrubber ──RetireSegments, SegmentsDeleted (a corrupt segment: quarantined)
       ▲ SegmentChecks: the dispatcher's first read of a segment recovery did not
         check in full runs its whole-file CRC and reports a bad one

Actors start in dependency order (ack_logger, then dispatcher and gc, then the
ingest chain from its far end); the ingest chain ends by end-of-stream when
producers are gone, then dispatcher and gc stop, and the ack_logger drains last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from quiverd.acks.state import AckState
from quiverd.kernel import logs
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import Config
from quiverd.kernel.faults import Hooks
from quiverd.kernel.jobs import Verdict
from quiverd.kernel.layout import DataDir, ShardLayout, segment_path
from quiverd.kernel.metrics import (
    AckLogMetrics,
    DispatchMetrics,
    GcMetrics,
    Metrics,
    ScrubMetrics,
    SegmentMetrics,
    WalMetrics,
)
from quiverd.runtime.recovery import Recovered, recover_shard
from quiverd.segments.table import SegmentTable, SegmentView, StagedRef, TableListener
from quiverd_actors import (
    ack_logger,
    finalizer,
    gc_sweeper,
    scrubber,
    segment_builder,
    wal_writer,
)
from quiverd_actors.dispatcher import Dispatcher
from quiverd_actors.inbox import ShardInbox
from quiverd_actors.messages import (
    AckLogRequest,
    DurableBatch,
    SealedSegment,
    WalReleased,
)
from quiverd_actors.retention_gate import RetentionGate
from quiverd_actors.segment_checks import SegmentChecks


class Shard:
    def __init__(self, index: int, cfg: Config, *, shard_count: int, faults: Hooks,
                 metrics: Metrics, staging: TableListener | None = None,
                 verdict: Callable[[StagedRef], Verdict] | None = None) -> None:
        self.index, self.cfg, self.faults = index, cfg, faults
        self.staging, self.verdict = staging, verdict
        self.shard_count = shard_count
        self.disk_reserve_bytes = 0  # set by recover(): it needs the filesystem's size
        self.layout = DataDir(Path(cfg.data_dir)).shard(index)
        self.log = logs.get("shard", shard=index)
        self.wal_stats = WalMetrics(metrics, index)
        self.segment_stats = SegmentMetrics(metrics, index)
        self.ack_stats = AckLogMetrics(metrics, index)
        self.gc_stats = GcMetrics(metrics, index)
        self.dispatch_stats = DispatchMetrics(metrics, index)
        self.scrub_stats = ScrubMetrics(metrics, index)
        self.checks = SegmentChecks()  # filled by recover()
        self.corrupt_entries = metrics.wal_corrupt_entries.labels(index)
        self.bundles_lost = metrics.bundles_lost.labels(index)
        # Filled by connections once per read batch; bounded upstream by their windows.
        self.inbox = ShardInbox()
        self.ack_tx, self._ack_rx = anyio.create_memory_object_stream[AckLogRequest](256)
        self.recovered: Recovered | None = None
        self._table = SegmentTable()  # handed to the ack_logger, its only writer
        self.segments: SegmentView = self._table.view()
        self.unfinished = True
        self.changes = Changes()  # ack state changed: dispatcher and gc re-evaluate
        self.over_cap = Changes()  # ingest hit the size cap: gc sweeps now
        per_shard_cap = cfg.retention.size_cap_bytes // shard_count
        self.gate = RetentionGate(cap_bytes=per_shard_cap, usage=self.usage_bytes)
        self.dispatcher: Dispatcher | None = None
        self.seals = segment_builder.SealRequests()  # a job's commit: seal its bundles now
        self.stopping = anyio.Event()  # producers waiting for room are refused, not held

    async def recover(self) -> None:
        self.recovered = await anyio.to_thread.run_sync(
            recover_shard, self.index, self.layout, self.cfg, self.faults, self.log)
        self.recovered.ack_file.fault_hook = self.faults.get("acklog")
        self._table = SegmentTable(self.recovered.segments, listener=self.staging)
        self.checks = SegmentChecks(self.recovered.unverified)
        self.segments = self._table.view()
        self.corrupt_entries.inc(self.recovered.replay.get("corrupt_entries", 0))
        fs_bytes = await anyio.to_thread.run_sync(_filesystem_bytes, self.layout.dir)
        self.disk_reserve_bytes = wal_disk_reserve_bytes(self.cfg, self.shard_count, fs_bytes)
        self.bundles_lost.inc(self.recovered.replay.get("bundles_lost", 0))
        self.scrub_stats.lost_bytes.inc(await anyio.to_thread.run_sync(
            _quarantined_bytes, self.layout, self.recovered))

    @property
    def acks(self) -> AckState:
        assert self.recovered is not None
        return self.recovered.acks

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start the shard's actors in dependency order; return when all have drained."""
        rec = self.recovered
        assert rec is not None
        # Named per-shard limiters: a 100 ms segment write must not hold up an
        # ack.log commit or a WAL fdatasync.
        acklog = anyio.CapacityLimiter(1)  # ack.log appends and compaction
        gc = anyio.CapacityLimiter(1)  # segment deletion
        reads = anyio.CapacityLimiter(1)  # dispatcher's segment reads
        scrub = anyio.CapacityLimiter(1)  # scrubber's reads and quarantine moves
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(lambda task_status: ack_logger.run(
                    self._ack_rx, state=rec.acks, file=rec.ack_file, segments=self._table,
                    pending=rec.ack_pending,
                    changes=self.changes, limiter=acklog, stats=self.ack_stats, log=self.log,
                    task_status=task_status))
                async with anyio.create_task_group() as services:
                    self.dispatcher = Dispatcher(
                        self.index, rec.acks, self.segments, self.ack_tx.clone(), self.changes,
                        reads, self.log, self.dispatch_stats, verdict=self.verdict,
                        checks=self.checks,
                        preview=self.cfg.lake.enabled and self.cfg.lake.convert_staged)
                    await services.start(self.dispatcher.run)
                    await services.start(lambda task_status: scrubber.run(
                        self.ack_tx.clone(), shard=self.index, layout=self.layout,
                        segments=self.segments, checks=self.checks,
                        rate_bytes_per_s=self.cfg.scrub.rate_mb_per_s * 1e6 / self.shard_count,
                        pass_interval_s=self.cfg.scrub.pass_interval_s, limiter=scrub,
                        stats=self.scrub_stats, log=self.log, task_status=task_status))
                    await services.start(lambda task_status: gc_sweeper.run(
                        self.ack_tx.clone(), state=rec.acks, segments=self.segments,
                        shard=self.layout, cfg=self.cfg.retention, gate=self.gate,
                        over_cap=self.over_cap, changes=self.changes, limiter=gc,
                        stats=self.gc_stats, log=self.log, hook=self.faults.get("gc"),
                        task_status=task_status))
                    await self._run_ingest_chain(rec, task_status)
                    services.cancel_scope.cancel()
                await self.ack_tx.aclose()
        finally:
            # Also when the shard stopped on an error (its actors close their clones): an
            # open stream would be left for the garbage collector to warn of.
            self.ack_tx.close()
        self.unfinished = False

    async def _run_ingest_chain(self, rec: Recovered,
                                task_status: anyio.abc.TaskStatus[None]) -> None:
        # Deep enough that a finalize in progress does not hold up the next group
        # commit; still bounded (and its bundles are all inside the bounded WAL).
        durable_tx, durable_rx = anyio.create_memory_object_stream[DurableBatch](64)
        sealed_tx, sealed_rx = anyio.create_memory_object_stream[SealedSegment](1)
        release_tx, release_rx = anyio.create_memory_object_stream[WalReleased](16)
        if rec.covered_through:  # what segments held at start: the WAL may be full of it
            release_tx.send_nowait(WalReleased(upto_sequence=rec.covered_through))
        io = anyio.CapacityLimiter(1)  # WAL releases (writes and syncs have their own threads)
        fin = anyio.CapacityLimiter(1)  # finalizer
        build = anyio.CapacityLimiter(1)  # builder's decode of durable bundles
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: finalizer.run(
                sealed_rx, self.ack_tx.clone(), release_tx, shard=self.layout,
                max_dictionary_cardinality=self.cfg.segment.max_dictionary_cardinality,
                limiter=fin, stats=self.segment_stats, log=self.log,
                hook=self.faults.get("finalize"),
                reserve_bytes=finalizer.METADATA_RESERVE_BYTES, fetch=rec.wal.read_back,
                salvage=rec.wal, on_lost=self._lost_at_finalize,
                task_status=task_status))
            await tg.start(lambda task_status: segment_builder.run(
                durable_rx, sealed_tx, cfg=self.cfg.segment,
                first_segment_seq=rec.next_segment_seq, recovered=rec.open_bundles,
                limiter=build, stats=self.segment_stats, log=self.log,
                seal_early=self._seal_early, from_wal=True, seals=self.seals,
                next_sequence=rec.next_sequence, task_status=task_status))
            rec.open_bundles = []  # now owned by the builder
            await tg.start(lambda task_status: wal_writer.run(
                self.inbox, durable_tx, release_rx, shard=self.index, wal=rec.wal,
                cfg=self.cfg.wal, next_sequence=rec.next_sequence, limiter=io,
                stats=self.wal_stats, log=self.log, gate=self.gate, over_cap=self.over_cap,
                drop_oldest=self.cfg.retention.size_cap_policy == "drop_oldest",
                stopping=self.stopping, disk_reserve_bytes=self.disk_reserve_bytes,
                producers=rec.producers, producers_path=self.layout.producers,
                task_status=task_status))
            task_status.started()

    def progress_mark(self) -> tuple[float, float]:
        """Counters that move whenever the WAL makes written appends durable."""
        return (self.wal_stats.fsyncs.value, self.wal_stats.acks.value)

    def stalled_since(self, mark: tuple[float, float]) -> bool:
        """Appends wait for an fdatasync and none completed since ``mark`` was taken."""
        return self.wal_stats.inflight.value > 0 and self.progress_mark() == mark

    def _seal_early(self) -> bool:
        """Finalize early: the WAL is past half its bound or the shard is at its cap."""
        rec = self.recovered
        wal_full = rec is not None and rec.wal.live_bytes > self.cfg.wal.max_size_bytes // 2
        return wal_full or self.gate.over()

    def usage_bytes(self) -> int:
        """What this shard holds on disk: WAL + segments + ack.log (the size cap's measure)."""
        rec = self.recovered
        wal = rec.wal.live_bytes if rec else 0
        return wal + self.segments.total_bytes() + int(self.ack_stats.log_bytes.value)

    def status_wal(self, key: str) -> int:
        """One of the WAL files' numbers (``wal_bytes``, ``wal_files``); 0 before recovery."""
        return self.recovered.wal.stats()[key] if self.recovered else 0

    def status(self) -> dict[str, Any]:
        """This shard's part of `status --json`: the values /metrics exports, by name."""
        rec = self.recovered
        wal = rec.wal.stats() if rec else {}
        w, seg = self.wal_stats, self.segment_stats
        return {
            "shard": self.index,
            **wal,
            **{key: int(v.value) for key, v in (
                ("last_sequence", w.last_sequence), ("appends", w.appends),
                ("fsyncs", w.fsyncs), ("acks", w.acks), ("in_flight", w.inflight),
                ("capacity_waits", w.capacity_waits), ("rejected_at_capacity", w.rejected),
                ("open_bundles", seg.open_bundles), ("open_bytes", seg.open_bytes),
                ("open_streams", seg.open_streams), ("segments_finalized", seg.finalized))},
            "disk_full": bool(w.disk_full.value),  # the WAL holds or refuses bundles: no space
            "segments": len(self.segments),
            "segment_bytes": self.segments.total_bytes(),
            "replay": rec.replay if rec else {},
            "quarantined_segments": rec.quarantined_segments if rec else [],
            "lost_sequences": rec.lost_sequences if rec else [],
            "lost_bundles": rec.lost_bundles if rec else [],
            # Reported at an earlier start (lost.json): listed, not new.
            "known_lost_sequences": rec.known_lost_sequences if rec else [],
            "known_lost_bundles": rec.known_lost_bundles if rec else [],
            "scrub": self.scrub_status(),
        }

    def _lost_at_finalize(self, sequence: int) -> None:
        """A bundle the finalizer refused (quarantined): counted and listed in status."""
        self.bundles_lost.inc()
        if self.recovered is not None:
            self.recovered.lost_sequences.append((sequence, sequence))

    def left_at_stop(self) -> dict[str, int]:
        """What a stop cut short left behind, for ``shutdown_timed_out``: bundles received
        and not acked (their producers retry), and bundles in the WAL that no segment
        holds yet (replay finalizes them at the next start)."""
        rec = self.recovered
        return {"shard": self.index, "bundles_not_acked": int(self.wal_stats.inflight.value),
                "bundles_not_finalized": rec.wal.unreleased_entries if rec else 0,
                "wal_bytes": rec.wal.live_bytes if rec else 0}

    def scrub_status(self) -> dict[str, Any]:
        """The scrubber's progress and the segments found corrupt since startup."""
        checks, st = self.checks, self.scrub_stats
        return {
            "rate_mb_per_s": self.cfg.scrub.rate_mb_per_s / self.shard_count,
            "unverified_segments": checks.unverified_count,
            "passes": int(st.passes.value),
            "pass_bytes": checks.pass_bytes,
            "pass_done_bytes": checks.pass_done_bytes,
            "bytes_checked": int(st.bytes.value),
            "segments_checked": int(st.segments.value),
            "corrupt_found": {k: int(st.corrupt(k).value) for k in ("read", "scrub")},
            "quarantined": list(checks.quarantined),
        }


def wal_disk_reserve_bytes(cfg: Config, shard_count: int, fs_bytes: int | None = None) -> int:
    """Free space WAL appends leave on the filesystem, so that a full disk drains itself.

    Segments release the WAL and ack.log records let the gc delete segments, so both
    must still fit when the WAL has filled the disk: room for one segment per shard
    being finalized (the target size, overshot by at most one group commit of
    ``flush_bytes`` plus one write batch) and the finalizer's own metadata reserve.
    A segment never holds more than the WAL does, and the reserve never takes more
    than a tenth of the filesystem (``fs_bytes``): a large segment target on a small
    disk must not stop ingest before it starts.
    """
    segment = (min(cfg.segment.target_size_bytes, cfg.wal.max_size_bytes)
               + cfg.wal.flush_bytes + wal_writer.MAX_BATCH_BYTES)
    reserve = finalizer.METADATA_RESERVE_BYTES + shard_count * segment
    if fs_bytes is not None:
        reserve = min(reserve, max(fs_bytes // 10, 2 * finalizer.METADATA_RESERVE_BYTES))
    return reserve


def _quarantined_bytes(layout: ShardLayout, rec: Recovered) -> int:
    """File bytes of the segments this start quarantined whose bundles are lost (the WAL
    no longer held them): ``quiver_lost_bytes_total{reason="corrupt"}``. A segment named
    lost without its file in quarantine/ (ack.log lists it, the file is gone) counts 0."""
    quarantined = set(rec.quarantined_segments)
    total = 0
    for lost in rec.lost_bundles:
        if str(lost.segment_seq) not in quarantined:
            continue
        name = segment_path(layout.segments_dir, lost.segment_seq).name
        try:
            total += (layout.quarantine_dir / name).stat().st_size
        except FileNotFoundError:
            pass
    return total


def _filesystem_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize
