"""The gc_sweeper actor (quiverd_actors.gc_sweeper) in process, against the real ack_logger.

Real segment files and a real ack.log; the messages the gc sends pass through a
tap on their way to the ack_logger, so each test compares them, the files left,
the DELETED marker, ack.log, the RetentionGate and the gc's metrics with what a sweep
must do: acked segments in one batch, drop_oldest, max_age, backpressure,
cancellation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import pyarrow as pa
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile
from quiverd.acks.recovery import recover_acks
from quiverd.acks.state import AckState
from quiverd.kernel import logs
from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import RetentionConfig, SubscriberEntry
from quiverd.kernel.layout import DataDir, ShardLayout
from quiverd.kernel.metrics import AckLogMetrics, GcMetrics, Metrics, Series
from quiverd.kernel.reply import Reply
from quiverd.segments.files import Deleted, read_marker, segment_info, write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader
from quiverd.segments.table import SegmentInfo, SegmentTable
from quiverd_actors import ack_logger, gc_sweeper
from quiverd_actors.messages import AckLogRequest, RecordOutcome, RetireSegments, SegmentsDeleted
from quiverd_actors.retention_gate import RetentionGate

LOG = logs.get("test")
HOUR_NS = 3600 * 1_000_000_000


def make_segment(shard: ShardLayout, seq: int, bundles: int, ts_ns: int) -> SegmentInfo:
    """A real segment file; bundle i holds WAL sequence ``10 * seq + i``."""
    segment = OpenSegment()
    for i in range(bundles):
        segment.add(Bundle(client="app", slots=(make_slot(0, pa.table({"x": [seq, i]})),),
                           ingestion_ts_ns=ts_ns + i, sequence=10 * seq + i))
    path = shard.segment(seq)
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1024))
    with SegmentReader.open(path) as reader:
        return segment_info(path, seq, reader)


class Usage:
    """The gate's measure (the table's bytes), counting its calls: a sweep ends with one."""

    def __init__(self, table: SegmentTable) -> None:
        self.table, self.calls, self.changes = table, 0, Changes()

    def __call__(self) -> int:
        self.calls += 1
        self.changes.notify()
        return self.table.total_bytes()


@dataclass
class Rig:
    """A recovered shard with live segments, ready for the ack_logger and the gc."""

    shard: ShardLayout
    state: AckState
    file: AckLogFile
    table: SegmentTable
    infos: list[SegmentInfo]
    ack_tx: MemoryObjectSendStream[AckLogRequest]
    ack_rx: MemoryObjectReceiveStream[AckLogRequest]
    usage: Usage
    changes: Changes = field(default_factory=Changes)
    metrics: Metrics = field(default_factory=Metrics)
    ack_stats: AckLogMetrics = field(init=False)
    stats: GcMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.ack_stats = AckLogMetrics(self.metrics, 0)
        self.stats = GcMetrics(self.metrics, 0)
    sent: list[AckLogRequest] = field(default_factory=list)  # what the gc sent, in order

    def commit(self, *records: fmt.Record | None) -> None:
        """Setup before the actors run: durable first, then applied (as the ack_logger does)."""
        self.file.append([fmt.encode(r) for r in records if r is not None])
        self.file.sync()
        for r in records:
            if r is not None:
                self.state.apply(r)

    def ack(self, sub: str, seq: int, *idxs: int) -> None:
        self.commit(*(self.state.record_outcome(sub, seq, i, fmt.ACK) for i in idxs))

    def files(self) -> list[int]:
        return sorted(int(p.stem) for p in self.shard.segments_dir.glob("*.qseg"))

    def sent_summary(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(type(m).__name__, m.segment_seqs, m.reason) for m in self.sent
                if isinstance(m, RetireSegments | SegmentsDeleted)]


def make_rig(tmp_path: Path, ts_ns: list[int], subscribers: tuple[str, ...] = ("a",)) -> Rig:
    """Segments 1..len(ts_ns), two bundles each, the i-th stamped ``ts_ns[i]``."""
    shard = DataDir(tmp_path).shard(0)
    for d in shard.directories():
        d.mkdir(parents=True, exist_ok=True)
    infos = [make_segment(shard, i + 1, 2, ts) for i, ts in enumerate(ts_ns)]
    rec = recover_acks(shard, {s.segment_seq: 2 for s in infos},
                       [SubscriberEntry(name=n) for n in subscribers], LOG)
    table = SegmentTable(infos)
    return Rig(shard, rec.state, rec.file, table, infos,
               *anyio.create_memory_object_stream[AckLogRequest](64), Usage(table))


async def tap(rx: MemoryObjectReceiveStream[AckLogRequest],
              tx: MemoryObjectSendStream[AckLogRequest], seen: list[AckLogRequest]) -> None:
    async with rx, tx:
        async for msg in rx:
            seen.append(msg)
            await tx.send(msg)


@asynccontextmanager
async def running(rig: Rig, gate: RetentionGate, cfg: RetentionConfig,
                  over_cap: Changes | None = None) -> AsyncIterator[None]:
    """ack_logger, then the gc (its messages tapped); leaving cancels the gc, then ends both."""
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(
                ack_logger.run, rig.ack_rx, state=rig.state, file=rig.file, segments=rig.table,
                changes=rig.changes, limiter=anyio.CapacityLimiter(1), stats=rig.ack_stats,
                log=LOG))
            async with rig.ack_tx, anyio.create_task_group() as services:
                gc_tx, gc_rx = anyio.create_memory_object_stream[AckLogRequest](16)
                services.start_soon(tap, gc_rx, rig.ack_tx.clone(), rig.sent)
                await services.start(partial(
                    gc_sweeper.run, gc_tx, state=rig.state, segments=rig.table.view(),
                    shard=rig.shard, cfg=cfg, gate=gate, over_cap=over_cap or Changes(),
                    changes=rig.changes, limiter=anyio.CapacityLimiter(1), stats=rig.stats,
                    log=LOG))
                yield
                services.cancel_scope.cancel()


async def until(changes: Changes, done: Callable[[], bool]) -> None:
    """Wait, on notifications only, until ``done()`` holds."""
    while not done():
        await changes.wait_beyond(changes.version)


@pytest.mark.asyncio
async def test_gc_sweeper_acked_segments_deleted_in_one_batch(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, [1_000] * 4)
    for seq in (1, 2, 3):
        rig.ack("a", seq, 0, 1)
    rig.ack("a", 4, 0)  # segment 4 is not fully acked: it stays
    async with running(rig, RetentionGate(0, rig.usage),
                       RetentionConfig()):
        await until(rig.changes, lambda: list(rig.state.live_segments()) == [4])
    assert rig.sent_summary() == [("RetireSegments", (1, 2, 3), "acked"),
                                  ("SegmentsDeleted", (1, 2, 3), "acked")]
    assert rig.stats.delete_batches.value == 1
    assert by_label(rig.metrics.gc_evictions, 'reason') == {"acked": 3}
    assert read_marker(rig.shard.deleted, Deleted) == Deleted(wal_sequence=31,
                                                             segment_seqs=[1, 2, 3])
    assert rig.files() == [4] and rig.table.seqs() == [4]
    # One ack.log commit for the three SEGMENT_DELETED records (the retire wrote none).
    assert (rig.ack_stats.fsyncs.value, rig.ack_stats.records.value) == (1, 3)
    assert by_label(rig.metrics.subscriber_dropped, 'subscriber') == {}
    assert rig.stats.segments_dropped.value == 0


@pytest.mark.asyncio
async def test_gc_sweeper_drop_oldest_deletes_only_what_brings_under_cap(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, [1_000] * 3, subscribers=("a", "b"))
    rig.ack("a", 1, 0)
    gate = RetentionGate(cap_bytes=rig.infos[2].size_bytes + 1, usage=rig.usage)
    async with running(rig, gate, RetentionConfig(size_cap_policy="drop_oldest")):
        await until(rig.changes, lambda: list(rig.state.live_segments()) == [3])
        assert not gate.closed
    assert rig.sent_summary() == [("RetireSegments", (1, 2), "size_cap"),
                                  ("SegmentsDeleted", (1, 2), "size_cap")]
    assert by_label(rig.metrics.subscriber_dropped, 'subscriber') == {"a": 3, "b": 4}
    assert (rig.stats.segments_dropped.value, rig.stats.delete_batches.value) == (2, 1)
    assert by_label(rig.metrics.gc_evictions, 'reason') == {"size_cap": 2}
    assert rig.files() == [3]
    assert read_marker(rig.shard.deleted, Deleted) == Deleted(wal_sequence=21,
                                                             segment_seqs=[1, 2])
    assert list(rig.state.pending_for("b")) == [(3, 0), (3, 1)]


@pytest.mark.asyncio
async def test_gc_sweeper_max_age_drops_only_older_segments(tmp_path: Path) -> None:
    now = time.time_ns()
    rig = make_rig(tmp_path, [now - 2 * HOUR_NS, now - HOUR_NS // 2, now])
    async with running(rig, RetentionGate(0, rig.usage),
                       RetentionConfig(max_age_s=3600)):
        await until(rig.changes, lambda: list(rig.state.live_segments()) == [2, 3])
    assert rig.sent_summary() == [("RetireSegments", (1,), "max_age"),
                                  ("SegmentsDeleted", (1,), "max_age")]
    assert by_label(rig.metrics.subscriber_dropped, 'subscriber') == {"a": 2}
    assert by_label(rig.metrics.gc_evictions, 'reason') == {"max_age": 1}
    assert rig.files() == [2, 3]
    assert rig.state.covered_below("a") == 2  # the dropped outcomes moved the mark


@pytest.mark.asyncio
async def test_gc_sweeper_backpressure_keeps_unacked_until_acks_free_space(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path, [1_000] * 3)
    usage = rig.usage
    gate = RetentionGate(cap_bytes=rig.infos[2].size_bytes + 1, usage=usage)
    over_cap = Changes()
    async with running(rig, gate, RetentionConfig(), over_cap):
        await until(usage.changes, lambda: usage.calls >= 1)
        over_cap.notify()  # ingest hit the cap: the gc sweeps again at once
        await until(usage.changes, lambda: usage.calls >= 2)
        assert gate.closed and rig.files() == [1, 2, 3] and rig.sent == []
        opened = gate.opened
        acks = [RecordOutcome(subscriber="a", segment_seq=seq, bundle_index=i,
                              outcome=fmt.ACK, reply=Reply()) for seq in (1, 2) for i in (0, 1)]
        for request in acks:
            rig.ack_tx.send_nowait(request)  # one ack_logger batch, so one sweep sees all
        await opened.wait()
        await until(rig.changes, lambda: list(rig.state.live_segments()) == [3])
    assert not gate.closed
    assert rig.sent_summary() == [("RetireSegments", (1, 2), "acked"),
                                  ("SegmentsDeleted", (1, 2), "acked")]
    assert rig.files() == [3] and by_label(rig.metrics.subscriber_dropped, 'subscriber') == {}


@pytest.mark.asyncio
async def test_gc_sweeper_cancelled_waiting_for_retire_ends(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, [1_000] * 2)
    rig.ack("a", 1, 0, 1)
    rig.ack_tx.close()
    gc_tx, gc_rx = anyio.create_memory_object_stream[AckLogRequest](4)
    with anyio.fail_after(1):
        async with gc_rx:
            async with anyio.create_task_group() as tg:
                await tg.start(partial(
                    gc_sweeper.run, gc_tx, state=rig.state, segments=rig.table.view(),
                    shard=rig.shard, cfg=RetentionConfig(), gate=RetentionGate(0, rig.usage),
                    over_cap=Changes(), changes=rig.changes, limiter=anyio.CapacityLimiter(1),
                    stats=rig.stats, log=LOG))
                request = await gc_rx.receive()  # this fake ack_logger never answers
                assert isinstance(request, RetireSegments) and request.segment_seqs == (1,)
                tg.cancel_scope.cancel()
            with pytest.raises(anyio.EndOfStream):  # the gc closed its end of the stream
                gc_rx.receive_nowait()
    rig.ack_rx.close()
    rig.file.close()
    assert rig.files() == [1, 2] and rig.stats.delete_batches.value == 0


def by_label(series: Series, label: str) -> dict[str, int]:
    """A counter family's values summed per label value, without the zero ones."""
    return {k: int(v) for k, v in series.by_label(label).items() if v}
