"""One shard: its directory (``kernel.layout.ShardLayout``), its recovery, its actors.

    ingest ─AppendRequest(64)─▶ wal_writer ─DurableBatch(64)─▶ segment_builder
                                   ▲                              │ SealedSegment(1)
                                   └──────WalReleased(16)──── finalizer
                                                                  │ SegmentWritten
    dispatcher ─RecordOutcome──▶ ┌────────────┐ ◀─────────────────┘
    admin ─ChangeSubscriber────▶ │ ack_logger │ (256) owns ack.log, AckState, SegmentTable
    gc_sweeper ─RetireSegments─▶ └────────────┘ ──(Changes)──▶ dispatcher, gc_sweeper
               ─SegmentsDeleted▶

Actors start in dependency order (ack_logger, then dispatcher and gc, then the
ingest chain from its far end); the ingest chain ends by end-of-stream when
producers are gone, then dispatcher and gc stop, and the ack_logger drains last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from actors import ack_logger, finalizer, gc_sweeper, segment_builder, wal_writer
from actors.dispatcher import Dispatcher
from actors.messages import (
    AckLogRequest,
    AppendRequest,
    DurableBatch,
    SealedSegment,
    WalReleased,
)
from actors.retention_gate import RetentionGate
from quiverd.acks.state import AckState
from quiverd.kernel import logs
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import Config
from quiverd.kernel.faults import Hooks
from quiverd.kernel.layout import DataDir
from quiverd.runtime.recovery import Recovered, recover_shard
from quiverd.segments.table import SegmentTable, SegmentView


class Shard:
    def __init__(self, index: int, cfg: Config, *, shard_count: int, faults: Hooks) -> None:
        self.index, self.cfg, self.faults = index, cfg, faults
        self.layout = DataDir(Path(cfg.data_dir)).shard(index)
        self.log = logs.get("shard", shard=index)
        self.wal_stats = wal_writer.WalStats()
        self.builder_stats = segment_builder.BuilderStats()
        self.finalizer_stats = finalizer.FinalizerStats()
        self.ack_stats = ack_logger.AckLogStats()
        self.gc_stats = gc_sweeper.GcStats()
        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[AppendRequest](64)
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
        self.stopping = anyio.Event()  # producers waiting for room are refused, not held

    async def recover(self) -> None:
        self.recovered = await anyio.to_thread.run_sync(
            recover_shard, self.index, self.layout, self.cfg, self.faults, self.log)
        self._table = SegmentTable(self.recovered.segments)
        self.segments = self._table.view()

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
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: ack_logger.run(
                self._ack_rx, state=rec.acks, file=rec.ack_file, segments=self._table,
                changes=self.changes, limiter=acklog, stats=self.ack_stats, log=self.log,
                task_status=task_status))
            async with anyio.create_task_group() as services:
                self.dispatcher = Dispatcher(self.index, rec.acks, self.segments,
                                             self.ack_tx.clone(), self.changes, reads, self.log)
                await services.start(self.dispatcher.run)
                await services.start(lambda task_status: gc_sweeper.run(
                    self.ack_tx.clone(), state=rec.acks, segments=self.segments,
                    shard=self.layout, cfg=self.cfg.retention, gate=self.gate,
                    over_cap=self.over_cap, changes=self.changes, limiter=gc,
                    stats=self.gc_stats, log=self.log, task_status=task_status))
                await self._run_ingest_chain(rec, task_status)
                services.cancel_scope.cancel()
            await self.ack_tx.aclose()
        self.unfinished = False

    async def _run_ingest_chain(self, rec: Recovered,
                                task_status: anyio.abc.TaskStatus[None]) -> None:
        # Deep enough that a finalize in progress does not hold up the next group
        # commit; still bounded (and its bundles are all inside the bounded WAL).
        durable_tx, durable_rx = anyio.create_memory_object_stream[DurableBatch](64)
        sealed_tx, sealed_rx = anyio.create_memory_object_stream[SealedSegment](1)
        release_tx, release_rx = anyio.create_memory_object_stream[WalReleased](16)
        io = anyio.CapacityLimiter(2)  # WAL: one write + one fdatasync may overlap
        fin = anyio.CapacityLimiter(1)  # finalizer
        build = anyio.CapacityLimiter(1)  # builder's decode of durable bundles
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: finalizer.run(
                sealed_rx, self.ack_tx.clone(), release_tx, shard=self.layout,
                max_dictionary_cardinality=self.cfg.segment.max_dictionary_cardinality,
                limiter=fin, stats=self.finalizer_stats, log=self.log,
                hook=self.faults.get("finalize"), task_status=task_status))
            await tg.start(lambda task_status: segment_builder.run(
                durable_rx, sealed_tx, cfg=self.cfg.segment,
                first_segment_seq=rec.next_segment_seq, recovered=rec.open_bundles,
                limiter=build, stats=self.builder_stats, log=self.log,
                seal_early=self._seal_early, task_status=task_status))
            rec.open_bundles = []  # now owned by the builder
            await tg.start(lambda task_status: wal_writer.run(
                self._inbox_rx, durable_tx, release_rx, shard=self.index, wal=rec.wal,
                cfg=self.cfg.wal, next_sequence=rec.next_sequence, limiter=io,
                stats=self.wal_stats, log=self.log, gate=self.gate, over_cap=self.over_cap,
                drop_oldest=self.cfg.retention.size_cap_policy == "drop_oldest",
                stopping=self.stopping, task_status=task_status))
            task_status.started()

    def progress_mark(self) -> tuple[int, int]:
        """Counters that move whenever the WAL makes written appends durable."""
        return (self.wal_stats.fsyncs, self.wal_stats.acks)

    def stalled_since(self, mark: tuple[int, int]) -> bool:
        """Appends wait for an fdatasync and none completed since ``mark`` was taken."""
        return self.wal_stats.inflight > 0 and self.progress_mark() == mark

    def _seal_early(self) -> bool:
        """Finalize early: the WAL is past half its bound or the shard is at its cap."""
        rec = self.recovered
        wal_full = rec is not None and rec.wal.live_bytes > self.cfg.wal.max_size_bytes // 2
        return wal_full or self.gate.over()

    def usage_bytes(self) -> int:
        """What this shard holds on disk: WAL + segments + ack.log (the size cap's measure)."""
        rec = self.recovered
        wal = rec.wal.live_bytes if rec else 0
        return wal + self.segments.total_bytes() + self.ack_stats.log_bytes

    def status(self) -> dict[str, Any]:
        rec = self.recovered
        wal = rec.wal.stats() if rec else {}
        return {
            "shard": self.index,
            **wal,
            "last_sequence": self.wal_stats.last_sequence,
            "appends": self.wal_stats.appends,
            "fsyncs": self.wal_stats.fsyncs,
            "acks": self.wal_stats.acks,
            "in_flight": self.wal_stats.inflight,
            "capacity_waits": self.wal_stats.capacity_waits,
            "rejected_at_capacity": self.wal_stats.rejected,
            "open_bundles": self.builder_stats.open_bundles,
            "open_bytes": self.builder_stats.open_bytes,
            "open_streams": self.builder_stats.open_streams,
            "segments": len(self.segments),
            "segment_bytes": self.segments.total_bytes(),
            "segments_finalized": self.finalizer_stats.segments,
            "replay": rec.replay if rec else {},
            "quarantined_segments": rec.quarantined_segments if rec else [],
            "lost_sequences": rec.lost_sequences if rec else [],
        }
