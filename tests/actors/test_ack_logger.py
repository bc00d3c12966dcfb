"""The ack_logger actor (quiverd_actors.ack_logger) in process: real streams, a real ack.log.

Each request kind is sent through a memory stream; the records that reach ack.log
(read back frame by frame and replayed), the AckState, the segment table, the
replies, ``Changes`` and the stats are compared with what must come out, along
with group commit, end of stream and cancellation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import pyarrow as pa
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile, replay_ack_log
from quiverd.acks.recovery import recover_acks
from quiverd.acks.registry import SubscriberExists, UnknownSubscriber
from quiverd.acks.state import AckState, UnknownBundle
from quiverd.kernel import logs
from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import SubscriberEntry
from quiverd.kernel.errors import DurabilityLost
from quiverd.kernel.layout import DataDir, ShardLayout
from quiverd.kernel.metrics import AckLogMetrics, Metrics
from quiverd.kernel.reply import Reply
from quiverd.segments.files import segment_info, write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader
from quiverd.segments.table import SegmentInfo, SegmentTable
from quiverd_actors import ack_logger
from quiverd_actors.messages import (
    AckLogRequest,
    ChangeSubscriber,
    RecordOutcome,
    Retired,
    RetireReason,
    RetireSegments,
    SegmentsDeleted,
    SegmentWritten,
)

LOG = logs.get("test")
ACK, DROPPED = fmt.ACK, fmt.DROPPED


def make_segment(shard: ShardLayout, seq: int, bundles: int) -> SegmentInfo:
    """A real segment file of ``bundles`` one-slot bundles, described as the finalizer would."""
    segment = OpenSegment()
    for i in range(bundles):
        segment.add(Bundle(client="app", slots=(make_slot(0, pa.table({"x": [seq, i]})),),
                           ingestion_ts_ns=1_000 + i, sequence=10 * seq + i))
    path = shard.segment(seq)
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1024))
    with SegmentReader.open(path) as reader:
        return segment_info(path, seq, reader)


def records_in(path: Path) -> list[fmt.Record | None]:
    """Every record of an ack.log, in file order (the first is recovery's checkpoint)."""
    scanner = fmt.RecordScanner()
    scanner.feed(path.read_bytes()[fmt.HEADER_LEN:])
    out: list[fmt.Record | None] = []
    while (frame := scanner.next()) is not None:
        assert isinstance(frame, fmt.Frame) and frame.crc_ok
        out.append(fmt.decode_record(frame.record_type, frame.body))
    return out


@dataclass
class Rig:
    """A recovered shard: its AckState, open ack.log, table and the actor's inbox."""

    shard: ShardLayout
    state: AckState
    file: AckLogFile
    table: SegmentTable
    tx: MemoryObjectSendStream[AckLogRequest]
    rx: MemoryObjectReceiveStream[AckLogRequest]
    changes: Changes = field(default_factory=Changes)
    stats: AckLogMetrics = field(default_factory=lambda: AckLogMetrics(Metrics(), 0))

    def replayed(self) -> AckState:
        return replay_ack_log(self.shard.ack_log, self.shard.quarantine_dir, log=LOG)

    def sub_id(self, name: str) -> int:
        return self.state.registry.get(name).subscriber_id


def make_rig(tmp_path: Path, on_disk: dict[int, int],
             subscribers: tuple[str, ...] = ("a",)) -> Rig:
    shard = DataDir(tmp_path).shard(0)
    for d in shard.directories():
        d.mkdir(parents=True, exist_ok=True)
    rec = recover_acks(shard, on_disk, [SubscriberEntry(name=n) for n in subscribers], LOG)
    return Rig(shard, rec.state, rec.file, SegmentTable(),
               *anyio.create_memory_object_stream[AckLogRequest](64))


async def start(tg: anyio.abc.TaskGroup, rig: Rig) -> None:
    await tg.start(partial(
        ack_logger.run, rig.rx, state=rig.state, file=rig.file, segments=rig.table,
        changes=rig.changes, limiter=anyio.CapacityLimiter(1), stats=rig.stats, log=LOG))


@asynccontextmanager
async def running(rig: Rig) -> AsyncIterator[MemoryObjectSendStream[AckLogRequest]]:
    """The actor on ``rig``; leaving closes its inbox and waits until it has returned."""
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            await start(tg, rig)
            async with rig.tx:
                yield rig.tx


async def cancel_while_idle(rig: Rig) -> None:
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            await start(tg, rig)
            tg.cancel_scope.cancel()


def outcome(sub: str, seq: int, idx: int, value: int = ACK) -> RecordOutcome:
    return RecordOutcome(subscriber=sub, segment_seq=seq, bundle_index=idx, outcome=value,
                         reply=Reply())


def assert_file_closed(file: AckLogFile) -> None:
    with pytest.raises(OSError):
        file.append([b"x"])


@pytest.mark.asyncio
async def test_ack_logger_segment_written_durable_then_listed(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {})
    info = make_segment(rig.shard, 1, 3)
    async with running(rig) as tx:
        await tx.send(SegmentWritten(info=info))
        await rig.changes.wait_beyond(0)
        assert rig.table.get(1) == info
        assert rig.state.live_segments() == {1: 3}
    assert records_in(rig.shard.ack_log)[1:] == [fmt.SegmentFinalized(segment_seq=1,
                                                                       bundle_count=3)]
    assert rig.replayed().live_segments() == {1: 3}
    assert (rig.stats.fsyncs.value, rig.stats.records.value) == (1, 1)
    assert_file_closed(rig.file)


@pytest.mark.asyncio
async def test_ack_logger_outcome_reply_given_after_fdatasync(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {1: 2})
    request = outcome("a", 1, 1)
    reply_done_at_sync: list[bool] = []

    class WatchedFile(AckLogFile):
        def sync(self) -> None:
            super().sync()
            reply_done_at_sync.append(request.reply.done)

    rig.file.close()
    rig.file = WatchedFile.open(rig.shard.ack_log)
    async with running(rig) as tx:
        await tx.send(request)
        await request.reply.wait()
        assert rig.state.gap_set("a") == {(1, 1)}
        assert reply_done_at_sync == [False]
    assert records_in(rig.shard.ack_log)[1:] == [fmt.Outcome(
        segment_seq=1, bundle_index=1, subscriber_id=rig.sub_id("a"), outcome=ACK)]
    assert rig.replayed().gap_set("a") == {(1, 1)}


@pytest.mark.parametrize(("sub", "seq", "idx", "value", "error"), [
    ("a", 9, 0, ACK, UnknownBundle),  # never finalized
    ("a", 1, 2, ACK, UnknownBundle),  # past the segment's bundle_count
    ("zz", 1, 0, ACK, UnknownSubscriber),
    ("a", 1, 0, 99, ValueError),  # not an outcome
])
@pytest.mark.asyncio
async def test_ack_logger_invalid_outcome_fails_reply_writes_nothing(
        tmp_path: Path, sub: str, seq: int, idx: int, value: int, error: type[Exception]) -> None:
    rig = make_rig(tmp_path, {1: 2})
    size = rig.shard.ack_log.stat().st_size
    request = outcome(sub, seq, idx, value)
    async with running(rig) as tx:
        await tx.send(request)
        with pytest.raises(error):
            await request.reply.wait()
    assert rig.shard.ack_log.stat().st_size == size
    assert (rig.stats.fsyncs.value, rig.stats.records.value) == (0, 0)
    assert list(rig.state.pending_for("a")) == [(1, 0), (1, 1)]


@pytest.mark.asyncio
async def test_ack_logger_change_subscriber_add_remove_durable(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {1: 1})
    add_b = ChangeSubscriber(op="add", name="b", start="latest", reply=Reply())
    remove_a = ChangeSubscriber(op="remove", name="a", reply=Reply())
    add_b_again = ChangeSubscriber(op="add", name="b", reply=Reply())
    async with running(rig) as tx:
        await tx.send(add_b)
        await add_b.reply.wait()
        b = rig.state.registry.get("b")
        assert b.start_segment == 2 and list(rig.state.pending_for("b")) == []
        await tx.send(remove_a)
        await remove_a.reply.wait()
        await tx.send(add_b_again)
        with pytest.raises(SubscriberExists):
            await add_b_again.reply.wait()
    a_id = b.subscriber_id - 1
    assert records_in(rig.shard.ack_log)[1:] == [
        fmt.SubscriberChange(subscriber_id=b.subscriber_id, op=fmt.OP_ADD, name="b",
                             start_segment=2),
        fmt.SubscriberChange(subscriber_id=a_id, op=fmt.OP_REMOVE, name="a", start_segment=0)]
    assert [s.name for s in rig.replayed().registry] == ["b"]
    assert rig.state.deletable_segments() == [1]  # "a" no longer holds segment 1


@pytest.mark.asyncio
async def test_ack_logger_queued_outcomes_one_fdatasync_one_notify(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {1: 20})
    requests = [outcome("a", 1, i) for i in range(20)]
    for request in requests:
        rig.tx.send_nowait(request)
    async with running(rig):
        for request in requests:
            await request.reply.wait()
        assert rig.changes.version == 1
    assert (rig.stats.fsyncs.value, rig.stats.records.value) == (1, 20)
    assert rig.state.covered_below("a") == 2
    assert rig.replayed().covered_below("a") == 2


@pytest.mark.asyncio
async def test_ack_logger_retire_acked_writes_nothing_then_deleted(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {1: 2})
    info = make_segment(rig.shard, 1, 2)
    rig.table.add(info)
    acks = [outcome("a", 1, i) for i in range(2)]
    retire = RetireSegments(segment_seqs=(1,), reason="acked", reply=Reply())
    async with running(rig) as tx:
        for request in acks:
            tx.send_nowait(request)
        await acks[1].reply.wait()
        fsyncs = rig.stats.fsyncs.value
        await tx.send(retire)
        assert await retire.reply.wait() == Retired(segments=(info,), dropped_by_subscriber={},
                                                    segments_with_drops=0)
        assert rig.stats.fsyncs.value == fsyncs and len(rig.table) == 0
        assert rig.state.live_segments() == {1: 2}  # still in ack.log until unlinked
        version = rig.changes.version
        await tx.send(SegmentsDeleted(segment_seqs=(1,), reason="acked"))
        await rig.changes.wait_beyond(version)
    assert records_in(rig.shard.ack_log)[-1] == fmt.SegmentDeleted(segment_seq=1)
    assert rig.replayed().live_segments() == {}


@pytest.mark.parametrize("reason", ["max_age", "size_cap"])
@pytest.mark.asyncio
async def test_ack_logger_retire_for_retention_drops_durable_first(
        tmp_path: Path, reason: RetireReason) -> None:
    rig = make_rig(tmp_path, {1: 2, 2: 1}, subscribers=("a", "b"))
    infos = (make_segment(rig.shard, 1, 2), make_segment(rig.shard, 2, 1))
    for info in infos:
        rig.table.add(info)
    ack = outcome("a", 1, 0)
    retire = RetireSegments(segment_seqs=(1, 2), reason=reason, reply=Reply())
    async with running(rig) as tx:
        await tx.send(ack)
        await ack.reply.wait()
        await tx.send(retire)
        retired = await retire.reply.wait()
        assert len(rig.table) == 0
    assert retired == Retired(segments=infos, dropped_by_subscriber={"a": 2, "b": 3},
                              segments_with_drops=2,
                              dropped_bytes=sum(i.size_bytes for i in infos))
    a, b = rig.sub_id("a"), rig.sub_id("b")
    assert records_in(rig.shard.ack_log)[2:] == [
        fmt.Outcome(segment_seq=seq, bundle_index=idx, subscriber_id=sub, outcome=DROPPED)
        for seq, idx, sub in ((1, 1, a), (1, 0, b), (1, 1, b), (2, 0, a), (2, 0, b))]
    replayed = rig.replayed()
    assert (replayed.covered_below("a"), replayed.covered_below("b")) == (3, 3)
    assert replayed.deletable_segments() == [1, 2]


@pytest.mark.asyncio
async def test_ack_logger_end_of_stream_drains_queue_then_closes_file(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {1: 1})
    request = outcome("a", 1, 0)
    rig.tx.send_nowait(request)
    rig.tx.close()
    async with running(rig):
        pass
    assert request.reply.done and request.reply.error is None
    assert rig.replayed().covered_below("a") == 2
    assert_file_closed(rig.file)


@pytest.mark.asyncio
async def test_ack_logger_cancelled_while_idle_ends_promptly(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {})
    await cancel_while_idle(rig)
    with pytest.raises(anyio.BrokenResourceError):  # the actor closed its inbox
        rig.tx.send_nowait(SegmentsDeleted(segment_seqs=(1,), reason="acked"))
    rig.tx.close()
    assert rig.stats.fsyncs.value == 0


@pytest.mark.asyncio
async def test_ack_logger_cancelled_closes_file(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {})
    try:
        await cancel_while_idle(rig)
        assert_file_closed(rig.file)
    finally:
        rig.tx.close()
        rig.file.close()


@pytest.mark.asyncio
async def test_ack_logger_segment_below_floor_stops_the_shard(tmp_path: Path) -> None:
    # A repeated segment number is a bug that would lose the segment's bundles (its
    # file reads as a deleted segment's orphan at restart): the shard stops instead.
    rig = make_rig(tmp_path, {5: 1})  # floor 6: segment 3 can no longer be announced
    info = make_segment(rig.shard, 3, 1)
    with pytest.raises(ExceptionGroup) as raised, anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await start(tg, rig)
            await rig.tx.send(SegmentWritten(info=info))
    assert raised.group_contains(DurabilityLost, match="segment 3 cannot be recorded")
    rig.tx.close()
    assert rig.state.live_segments() == {5: 1}
    assert rig.stats.records.value == 0
    assert 3 not in rig.table
