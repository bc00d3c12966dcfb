"""One shard: its directory, its recovery, and the pipeline of its actors.

    shard-<n>/wal/          WAL files + truncate sidecar (quiverd.wal)
    shard-<n>/segments/     <seq:016>.qseg, read-only
                            FLOOR    highest segment seq ever finalized (finalizer)
                            DELETED  highest WAL sequence of a deleted segment (gc)
    shard-<n>/quarantine/   bytes cut out during recovery, never silently dropped

Recovery (blocking, in a worker thread): verify every segment (a bad one moves
to quarantine/), replay the WAL, and keep as the open segment exactly the WAL
entries no durable segment holds, so nothing is lost or duplicated across a
crash at any finalize step.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from actors import ack_logger, finalizer, gc_sweeper, segment_builder, wal_writer
from actors.dispatcher import Dispatcher
from actors.messages import (
    AckLogMessage,
    AppendRequest,
    DurableBatch,
    FinalizedSegment,
    SealedSegment,
    WalReleased,
)
from quiverd.acks.log import AckLogFile
from quiverd.acks.recovery import recover_acks
from quiverd.acks.state import AckState
from quiverd.kernel import logs
from quiverd.kernel.bundle import Bundle, split_meta
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import Config
from quiverd.kernel.durable import fsync_dir
from quiverd.kernel.errors import CorruptRecord
from quiverd.segments.markers import DELETED, FLOOR, Deleted, Floor, read_marker
from quiverd.segments.reader import SegmentReader
from quiverd.wal import format as walformat
from quiverd.wal.files import WalFiles
from quiverd.wal.replay import replay_wal


@dataclass
class SegmentInfo:
    segment_seq: int
    path: Path
    size_bytes: int
    bundle_count: int
    first_sequence: int
    last_sequence: int
    min_ts_ns: int
    max_ts_ns: int


@dataclass
class Recovered:
    wal: WalFiles
    next_sequence: int
    next_segment_seq: int
    open_bundles: list[Bundle]
    segments: list[SegmentInfo]
    quarantined_segments: list[str] = field(default_factory=list)
    lost_sequences: list[tuple[int, int]] = field(default_factory=list)
    replay: dict[str, int] = field(default_factory=dict)
    acks: AckState | None = None
    ack_file: AckLogFile | None = None


class Shard:
    def __init__(self, index: int, cfg: Config, *, fault_hooks: dict[str, Any]) -> None:
        self.index, self.cfg, self.fault_hooks = index, cfg, fault_hooks
        self.dir = Path(cfg.data_dir) / f"shard-{index}"
        self.log = logs.get("shard", shard=index)
        self.wal_stats = wal_writer.WalStats()
        self.builder_stats = segment_builder.BuilderStats()
        self.finalizer_stats = finalizer.FinalizerStats()
        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[AppendRequest](64)
        self.recovered: Recovered | None = None
        self.segments: dict[int, SegmentInfo] = {}
        self.unfinished = True
        self.changes = Changes()  # ack state changed: dispatcher and gc re-evaluate
        self.pressure = Changes()  # ingest hit the size cap: gc sweeps now
        self.ack_stats = ack_logger.AckLogStats()
        self.gc_stats = gc_sweeper.GcStats()
        per_shard_cap = cfg.retention.size_cap_bytes // cfg.shard_count
        self.gate = gc_sweeper.RetentionGate(cap_bytes=per_shard_cap, usage=self.usage_bytes)
        self.ack_tx, self._ack_rx = anyio.create_memory_object_stream[AckLogMessage](256)
        self.dispatcher: Dispatcher | None = None
        self.stopping = anyio.Event()  # producers waiting for room are refused, not held

    @property
    def wal_dir(self) -> Path:
        return self.dir / "wal"

    @property
    def segments_dir(self) -> Path:
        return self.dir / "segments"

    @property
    def quarantine_dir(self) -> Path:
        return self.dir / "quarantine"

    async def recover(self) -> None:
        self.recovered = await anyio.to_thread.run_sync(self._recover_blocking)
        self.segments = {s.segment_seq: s for s in self.recovered.segments}

    def _recover_blocking(self) -> Recovered:
        for d in (self.wal_dir, self.segments_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        segments, quarantined = scan_segments(self.segments_dir, self.quarantine_dir, self.log)
        floor = read_marker(self.segments_dir / FLOOR, Floor)
        deleted = read_marker(self.segments_dir / DELETED, Deleted)
        state = replay_wal(self.wal_dir, self.quarantine_dir, cfg_hash=walformat.DEFAULT_CFG_HASH,
                           max_entry_bytes=self.cfg.wal.max_entry_bytes, log=self.log)
        covered = _Coverage(segments, deleted.wal_sequence)
        open_bundles = [_bundle_of(e) for e in state.entries if not covered.holds(e.sequence)]
        high = max([deleted.wal_sequence, *(s.last_sequence for s in segments)])
        lost = covered.missing({e.sequence for e in state.entries})
        for lo, hi in lost:
            self.log.error("bundles_lost", shard=self.index, first_sequence=lo, last_sequence=hi,
                           hint="their segment was quarantined and the WAL no longer holds them")
        wal = WalFiles.open(self.wal_dir, state, cfg_hash=walformat.DEFAULT_CFG_HASH,
                            max_size_bytes=self.cfg.wal.max_size_bytes,
                            max_chunks=self.cfg.wal.max_chunks, log=self.log)
        wal.fault_hook = self.fault_hooks.get("wal")
        next_segment_seq = max([floor.segment_seq, *(s.segment_seq for s in segments),
                                *quarantined]) + 1
        by_seq = {s.segment_seq: s for s in segments}
        acks, ack_file, ack_counters = recover_acks(self.dir, self.quarantine_dir, by_seq,
                                                    self.cfg.subscribers, self.log)
        segments = sorted(by_seq.values(), key=lambda s: s.segment_seq)
        self.log.info("shard_recovered", segments=len(segments), open_bundles=len(open_bundles),
                      wal_entries=len(state.entries), corrupt_entries=state.corrupt_entries,
                      torn_tail_bytes=state.torn_tail_bytes)
        return Recovered(
            wal=wal, next_sequence=max(state.next_sequence, high + 1),
            next_segment_seq=next_segment_seq, open_bundles=open_bundles, segments=segments,
            quarantined_segments=[str(q) for q in quarantined], lost_sequences=lost,
            replay={"entries": len(state.entries), "corrupt_entries": state.corrupt_entries,
                    "torn_tail_bytes": state.torn_tail_bytes,
                    **{f"ack_log_{k}": v for k, v in ack_counters.items()}},
            acks=acks, ack_file=ack_file)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start the shard's actors in dependency order; return when all have drained.

        The ingest chain (wal_writer → builder → finalizer) ends by end-of-stream
        when producers are gone; then dispatcher and gc stop, and the ack_logger
        drains last.
        """
        rec = self.recovered
        assert rec is not None and rec.acks is not None and rec.ack_file is not None
        acks, ack_file = rec.acks, rec.ack_file
        # Deep enough that a finalize in progress does not hold up the next group
        # commit; still bounded (and its bundles are all inside the bounded WAL).
        durable_tx, durable_rx = anyio.create_memory_object_stream[DurableBatch](64)
        sealed_tx, sealed_rx = anyio.create_memory_object_stream[SealedSegment](1)
        release_tx, release_rx = anyio.create_memory_object_stream[WalReleased](16)
        # Named per-shard limiters: a 100 ms segment write must not hold up an
        # ack.log commit or a WAL fdatasync.
        io = anyio.CapacityLimiter(2)  # WAL: one write + one fdatasync may overlap
        fin = anyio.CapacityLimiter(1)  # finalizer
        acklog = anyio.CapacityLimiter(1)  # ack.log appends and compaction
        gc = anyio.CapacityLimiter(1)  # segment deletion
        reads = anyio.CapacityLimiter(1)  # dispatcher's segment reads
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: ack_logger.run(
                self._ack_rx, state=acks, file=ack_file, segments=self.segments,
                on_segment=self._segment_added, changes=self.changes, limiter=acklog,
                stats=self.ack_stats, log=self.log, task_status=task_status))
            async with anyio.create_task_group() as services:
                self.dispatcher = Dispatcher(self.index, acks, self.segments, self.ack_tx.clone(),
                                             self.changes, reads, self.log)
                await services.start(self.dispatcher.run)
                await services.start(lambda task_status: gc_sweeper.run(
                    self.ack_tx.clone(), state=acks, segments=self.segments,
                    segments_dir=self.segments_dir, cfg=self.cfg.retention, gate=self.gate,
                    pressure=self.pressure, changes=self.changes, limiter=gc,
                    stats=self.gc_stats, log=self.log, task_status=task_status))
                await self._run_ingest_chain(rec, durable_tx, durable_rx, sealed_tx, sealed_rx,
                                             release_tx, release_rx, io, fin, task_status)
                services.cancel_scope.cancel()
            await self.ack_tx.aclose()
        self.unfinished = False

    async def _run_ingest_chain(self, rec: Recovered, durable_tx: Any, durable_rx: Any,
                                sealed_tx: Any, sealed_rx: Any, release_tx: Any, release_rx: Any,
                                io: anyio.CapacityLimiter, fin: anyio.CapacityLimiter,
                                task_status: anyio.abc.TaskStatus[None]) -> None:
        build = anyio.CapacityLimiter(1)  # builder's decode of durable bundles
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: finalizer.run(
                sealed_rx, self.ack_tx.clone(), release_tx, segments_dir=self.segments_dir,
                max_dictionary_cardinality=self.cfg.segment.max_dictionary_cardinality,
                limiter=fin, stats=self.finalizer_stats, log=self.log,
                hook=self.fault_hooks.get("finalize"), task_status=task_status))
            await tg.start(lambda task_status: segment_builder.run(
                durable_rx, sealed_tx, cfg=self.cfg.segment,
                first_segment_seq=rec.next_segment_seq, recovered=rec.open_bundles,
                limiter=build, stats=self.builder_stats, log=self.log,
                pressure=self._under_pressure, task_status=task_status))
            rec.open_bundles = []  # now owned by the builder
            await tg.start(lambda task_status: wal_writer.run(
                self._inbox_rx, durable_tx, release_rx, shard=self.index, wal=rec.wal,
                cfg=self.cfg.wal, next_sequence=rec.next_sequence, limiter=io,
                stats=self.wal_stats, log=self.log, gate=self.gate, pressure=self.pressure,
                drop_oldest=self.cfg.retention.size_cap_policy == "drop_oldest",
                stopping=self.stopping,
                task_status=task_status))
            task_status.started()

    def _segment_added(self, seg: FinalizedSegment) -> None:
        self.segments[seg.segment_seq] = SegmentInfo(
            segment_seq=seg.segment_seq, path=Path(seg.path), size_bytes=seg.size_bytes,
            bundle_count=seg.bundle_count, first_sequence=seg.first_sequence,
            last_sequence=seg.last_sequence, min_ts_ns=seg.min_ts_ns, max_ts_ns=seg.max_ts_ns)

    def _under_pressure(self) -> bool:
        """Finalize early: the WAL is past half its bound or the shard is at its cap."""
        rec = self.recovered
        wal_full = rec is not None and rec.wal.live_bytes > self.cfg.wal.max_size_bytes // 2
        return wal_full or self.gate.over()

    @property
    def acks(self) -> AckState:
        assert self.recovered is not None and self.recovered.acks is not None
        return self.recovered.acks

    def usage_bytes(self) -> int:
        """What this shard holds on disk: WAL + segments + ack.log (the size cap's measure)."""
        rec = self.recovered
        wal = rec.wal.live_bytes if rec else 0
        return wal + sum(s.size_bytes for s in self.segments.values()) + self.ack_stats.log_bytes

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
            "segment_bytes": sum(s.size_bytes for s in self.segments.values()),
            "segments_finalized": self.finalizer_stats.segments,
            "replay": rec.replay if rec else {},
            "quarantined_segments": rec.quarantined_segments if rec else [],
            "lost_sequences": rec.lost_sequences if rec else [],
        }


class _Coverage:
    """Which WAL sequences durable segments (or the floor) already hold."""

    def __init__(self, segments: list[SegmentInfo], floor_sequence: int) -> None:
        self.ranges = sorted((s.first_sequence, s.last_sequence) for s in segments)
        self.floor = floor_sequence

    def holds(self, sequence: int) -> bool:
        if sequence <= self.floor:
            return True
        return any(lo <= sequence <= hi for lo, hi in self.ranges)

    def missing(self, in_wal: set[int]) -> list[tuple[int, int]]:
        """Sequence gaps between durable segments that the WAL cannot fill either."""
        lost: list[tuple[int, int]] = []
        prev = self.floor
        for lo, hi in self.ranges:
            if lo > prev + 1:
                gap = [s for s in range(prev + 1, lo) if s not in in_wal]
                if gap:
                    lost.append((gap[0], gap[-1]))
            prev = max(prev, hi)
        return lost


def _bundle_of(entry: Any) -> Bundle:
    client, txn, slots = split_meta(entry.slots)
    return Bundle(client=client, slots=slots, txn=txn, ingestion_ts_ns=entry.ts_ns,
                  sequence=entry.sequence)


def scan_segments(segments_dir: Path, quarantine_dir: Path, log: Any
                  ) -> tuple[list[SegmentInfo], list[int]]:
    """Verify every segment; quarantine bad ones and leftover temp files."""
    good: list[SegmentInfo] = []
    quarantined: list[int] = []
    for path in sorted(segments_dir.iterdir()):
        if path.name in (FLOOR, DELETED, FLOOR + ".tmp", DELETED + ".tmp"):
            continue
        if path.suffix != ".qseg":
            # A *.qseg.tmp is a finalize cut short: its bundles are still in the WAL.
            _quarantine(path, quarantine_dir, log, reason="incomplete temp file")
            continue
        try:
            with SegmentReader.open(path) as reader:
                good.append(_info(path, reader))
        except CorruptRecord as exc:
            log.error("segment_quarantined", path=str(path), error=str(exc))
            _quarantine(path, quarantine_dir, log, reason=str(exc))
            if path.stem.isdigit():
                quarantined.append(int(path.stem))
    return good, quarantined


def _info(path: Path, reader: SegmentReader) -> SegmentInfo:
    manifest = reader.manifest
    seqs = manifest.column("sequence").to_pylist()
    ts = manifest.column("ingestion_ts").to_pylist()
    return SegmentInfo(segment_seq=int(path.stem), path=path, size_bytes=path.stat().st_size,
                       bundle_count=len(seqs), first_sequence=min(seqs), last_sequence=max(seqs),
                       min_ts_ns=min(ts), max_ts_ns=max(ts))


def _quarantine(path: Path, quarantine_dir: Path, log: Any, *, reason: str) -> None:
    target = quarantine_dir / path.name
    n = 1
    while target.exists():
        target = quarantine_dir / f"{path.name}.{n}"
        n += 1
    os.chmod(path, 0o640)
    shutil.move(path, target)
    fsync_dir(quarantine_dir)
    fsync_dir(path.parent)
    log.warning("file_quarantined", path=str(path), moved_to=str(target), reason=reason)
