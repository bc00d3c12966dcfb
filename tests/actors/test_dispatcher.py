"""The dispatcher actor (quiverd_actors.dispatcher) in process, against the real ack_logger.

Real segment files, a real ack.log; sessions get their encoded DELIVERY frames
(``OutgoingDelivery``, decoded here with the client's FrameDecoder) on memory
streams and the RecordOutcome requests pass through a tap on their way to the
ack_logger, so each test compares what comes out: order and window, slot
contents, acks, nack backoff, detach, a removed subscriber, cancellation.
"""

from __future__ import annotations

import random
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.acks import format as fmt
from quiverd.acks.recovery import recover_acks
from quiverd.acks.state import AckState
from quiverd.kernel import logs
from quiverd.kernel.bundle import Bundle, make_slot, read_ipc_stream
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import SubscriberEntry
from quiverd.kernel.layout import DataDir
from quiverd.kernel.metrics import AckLogMetrics, DispatchMetrics, Metrics
from quiverd.kernel.reply import Reply
from quiverd.net.rawsock import RawStream
from quiverd.protocol.codec import FrameDecoder, max_frame_bytes
from quiverd.protocol.frames import Delivery
from quiverd.segments.files import segment_info, write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader
from quiverd.segments.table import SegmentTable
from quiverd_actors import ack_logger
from quiverd_actors import dispatcher as dispatcher_mod
from quiverd_actors.dispatcher import BACKOFF_BASE_S, Dispatcher, OutgoingDelivery, Session
from quiverd_actors.messages import (
    AckLogRequest,
    ChangeSubscriber,
    LocalDelivery,
    RecordOutcome,
)
from tests.segments.test_format import bundle_of, dict_col, three_slot_bundles

LOG = logs.get("test")
SEGMENTS = {1: 3, 2: 2}  # segment_seq -> bundles


def table(seq: int, idx: int) -> pa.Table:
    return pa.table({"x": [seq, idx], "s": [f"row-{seq}-{idx}"] * 2})


def ts_of(seq: int, idx: int) -> int:
    return 1_000_000 * seq + idx


@dataclass
class Rig:
    """Segments 1 (3 bundles) and 2 (2 bundles) on disk, subscriber "a", the actors' streams."""

    state: AckState
    dispatcher: Dispatcher
    ack_logger: Callable[..., Coroutine[Any, Any, None]]
    ack_tx: MemoryObjectSendStream[AckLogRequest]  # the test's own requests
    outcomes: MemoryObjectReceiveStream[AckLogRequest]  # what the dispatcher sent, tapped
    tap: tuple[MemoryObjectReceiveStream[AckLogRequest], MemoryObjectSendStream[AckLogRequest],
               MemoryObjectSendStream[AckLogRequest]]


def standard_bundles() -> dict[int, list[Bundle]]:
    return {seq: [Bundle(client=f"app{seq}", slots=(make_slot(0, table(seq, i)),),
                         ingestion_ts_ns=ts_of(seq, i), sequence=10 * seq + i)
                  for i in range(count)] for seq, count in SEGMENTS.items()}


def make_rig(tmp_path: Path, bundles: dict[int, list[Bundle]] | None = None,
             max_dictionary_cardinality: int = 64) -> Rig:
    """Segments written by the real encoder (``standard_bundles`` unless given)."""
    shard = DataDir(tmp_path).shard(0)
    for d in shard.directories():
        d.mkdir(parents=True, exist_ok=True)
    infos = []
    by_seq = standard_bundles() if bundles is None else bundles
    for seq, seg_bundles in by_seq.items():
        segment = OpenSegment()
        for b in seg_bundles:
            segment.add(b)
        write_segment(shard.segment(seq), encode_segment(
            segment, max_dictionary_cardinality=max_dictionary_cardinality))
        with SegmentReader.open(shard.segment(seq)) as reader:
            infos.append(segment_info(shard.segment(seq), seq, reader))
    counts = {seq: len(b) for seq, b in by_seq.items()}
    rec = recover_acks(shard, counts, [SubscriberEntry(name="a")], LOG)
    segments, changes = SegmentTable(infos), Changes()
    ack_tx, ack_rx = anyio.create_memory_object_stream[AckLogRequest](64)
    tap_tx, tap_rx = anyio.create_memory_object_stream[AckLogRequest](64)
    seen_tx, seen_rx = anyio.create_memory_object_stream[AckLogRequest](64)
    run_ack_logger = partial(
        ack_logger.run, ack_rx, state=rec.state, file=rec.file, segments=segments,
        changes=changes, limiter=anyio.CapacityLimiter(1), stats=AckLogMetrics(Metrics(), 0),
        log=LOG)
    dispatcher = Dispatcher(0, rec.state, segments.view(), tap_tx, changes,
                            anyio.CapacityLimiter(1), LOG, DispatchMetrics(Metrics(), 0))
    return Rig(rec.state, dispatcher, run_ack_logger, ack_tx, seen_rx,
               (tap_rx, ack_tx.clone(), seen_tx))


async def tap(rx: MemoryObjectReceiveStream[AckLogRequest],
              tx: MemoryObjectSendStream[AckLogRequest],
              seen: MemoryObjectSendStream[AckLogRequest]) -> None:
    async with rx, tx, seen:
        async for msg in rx:
            seen.send_nowait(msg)
            await tx.send(msg)


@asynccontextmanager
async def running(rig: Rig) -> AsyncIterator[anyio.CancelScope]:
    """ack_logger, then the dispatcher; yields the dispatcher's scope, cancelled on leaving."""
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            await tg.start(rig.ack_logger)
            async with rig.ack_tx, rig.outcomes, anyio.create_task_group() as services:
                services.start_soon(tap, *rig.tap)
                await services.start(rig.dispatcher.run)
                yield services.cancel_scope
                services.cancel_scope.cancel()


def decoded(frame: OutgoingDelivery) -> Delivery:
    """The DELIVERY frame as a subscriber's decoder reads it off the wire."""
    msgs = FrameDecoder(max_frame_bytes(1 << 26), from_client=False).feed(
        b"".join(bytes(p) for p in frame.parts))
    assert len(msgs) == 1 and isinstance(msgs[0], Delivery)
    d = msgs[0]
    assert (d.shard, d.segment_seq, d.bundle_index) == (
        frame.shard, frame.segment_seq, frame.bundle_index)
    return d


@contextmanager
def attached(rig: Rig, window: int) -> Iterator[tuple[
        Session, MemoryObjectReceiveStream[OutgoingDelivery]]]:
    """A session of subscriber "a" attached; its streams close on leaving (no detach)."""
    tx, rx = anyio.create_memory_object_stream[OutgoingDelivery](window)
    session = Session(name="a", window=window, deliveries=tx)
    rig.dispatcher.attach(session)
    with tx, rx:
        yield session, rx


async def take(rx: MemoryObjectReceiveStream[OutgoingDelivery], n: int) -> list[tuple[int, int]]:
    """The ids of the next ``n`` deliveries, then checks that nothing more is coming."""
    got = [await rx.receive() for _ in range(n)]
    await anyio.sleep(0.05)
    with pytest.raises(anyio.WouldBlock):
        rx.receive_nowait()
    return [(d.segment_seq, d.bundle_index) for d in got]


async def settled(rig: Rig, idx: tuple[int, int], outcome: int) -> None:
    """The dispatcher sent this outcome; wait until the ack_logger made it durable."""
    msg = await rig.outcomes.receive()
    assert isinstance(msg, RecordOutcome)
    assert (msg.subscriber, msg.segment_seq, msg.bundle_index, msg.outcome) == ("a", *idx,
                                                                                 outcome)
    await msg.reply.wait()


@pytest.mark.asyncio
async def test_dispatcher_delivers_oldest_first_up_to_window(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 4) as (session, rx):
            got = [decoded(await rx.receive()) for _ in range(4)]
            assert await take(rx, 0) == []
    assert [(d.segment_seq, d.bundle_index) for d in got] == [(1, 0), (1, 1), (1, 2), (2, 0)]
    for d in got:
        assert (d.shard, d.client, d.txn) == (0, f"app{d.segment_seq}", None)
        assert d.ingestion_ts_ns == ts_of(d.segment_seq, d.bundle_index)
        assert [s.slot for s in d.slots] == [0]
        assert read_ipc_stream(d.slots[0].ipc).equals(table(d.segment_seq, d.bundle_index))
    assert (session.unacked, _total(rig.dispatcher.stats, 'delivered')) == (4, 4)


@pytest.mark.asyncio
async def test_dispatcher_fills_a_wide_window_past_one_read_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A window wider than one read batch is filled at once, not one batch per wake-up
    # (an uploader holding its bundles until a file is registered starved on that).
    monkeypatch.setattr(dispatcher_mod, "READ_BATCH", 2)
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 5) as (_, rx):
            assert await take(rx, 5) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]


@pytest.mark.asyncio
async def test_dispatcher_local_session_gets_the_segments_tables(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        tx, rx = anyio.create_memory_object_stream[LocalDelivery](2)
        with tx, rx:
            rig.dispatcher.attach(Session(name="a", window=2, deliveries=tx, local=True))
            got = [await rx.receive() for _ in range(2)]
    assert [(d.segment_seq, d.bundle_index) for d in got] == [(1, 0), (1, 1)]
    for d in got:
        assert list(d.tables) == [0] and d.client == f"app{d.segment_seq}"
        assert d.tables[0].equals(table(d.segment_seq, d.bundle_index))  # no IPC round trip


@pytest.mark.asyncio
async def test_dispatcher_ack_made_durable_not_redelivered(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 2) as (first, rx):
            assert await take(rx, 2) == [(1, 0), (1, 1)]
            await rig.dispatcher.feedback(first, 1, 0, fmt.ACK)
            await settled(rig, (1, 0), fmt.ACK)
            assert await take(rx, 1) == [(1, 2)]  # the ack freed one place in the window
        rig.dispatcher.detach(first)
        with attached(rig, 8) as (second, rx):
            assert await take(rx, 4) == [(1, 1), (1, 2), (2, 0), (2, 1)]
    assert rig.state.gap_set("a") == {(1, 0)}
    stats = rig.dispatcher.stats
    assert (_total(stats, 'acks'), _total(stats, 'redelivered')) == (1, 2)


@pytest.mark.asyncio
async def test_dispatcher_nack_redelivered_after_doubling_backoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "uniform", lambda lo, hi: hi)  # no jitter
    rig = make_rig(tmp_path)
    waited = []
    async with running(rig):
        with attached(rig, 5) as (session, rx):
            assert len(await take(rx, 5)) == 5
            for _ in range(2):
                await rig.dispatcher.feedback(session, 1, 1, fmt.NACK)
                await settled(rig, (1, 1), fmt.NACK)
                start = anyio.current_time()
                again = await rx.receive()
                waited.append(anyio.current_time() - start)
                assert (again.segment_seq, again.bundle_index) == (1, 1)
    assert BACKOFF_BASE_S * 0.9 <= waited[0] < BACKOFF_BASE_S * 1.9
    assert BACKOFF_BASE_S * 1.9 <= waited[1] < BACKOFF_BASE_S * 3.9
    assert rig.state.nack_count("a", 1, 1) == 2
    stats = rig.dispatcher.stats
    assert (_total(stats, 'nacks'), _total(stats, 'redelivered')) == (2, 2)


@pytest.mark.asyncio
async def test_dispatcher_detach_gives_inflight_to_next_session(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 2) as (first, rx):
            assert await take(rx, 2) == [(1, 0), (1, 1)]
        rig.dispatcher.detach(first)
        assert first.closed and rig.dispatcher.inflight == {}
        with attached(rig, 2) as (second, rx):
            assert await take(rx, 2) == [(1, 0), (1, 1)]
        assert set(rig.dispatcher.inflight.values()) == {second}
    assert _total(rig.dispatcher.stats, 'redelivered') == 2


@pytest.mark.asyncio
async def test_dispatcher_removed_subscriber_session_ended(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 1) as (session, rx):
            assert await take(rx, 1) == [(1, 0)]
            with anyio.CancelScope() as scope:  # the connection's scope
                session.scope = scope
                remove = ChangeSubscriber(op="remove", name="a", reply=Reply())
                await rig.ack_tx.send(remove)
                await remove.reply.wait()
                await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert session.ended == "subscriber 'a' was removed"


@pytest.mark.asyncio
async def test_dispatcher_cancelled_ends_run_and_detaches(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig) as dispatcher_scope:
        with attached(rig, 2) as (session, rx):
            assert await take(rx, 2) == [(1, 0), (1, 1)]
        dispatcher_scope.cancel()
    assert session.closed and rig.dispatcher.sessions == []
    assert rig.dispatcher.inflight == {} and len(rig.dispatcher.readers) == 0
    with pytest.raises(anyio.ClosedResourceError):  # run() closed its ack_log stream
        rig.dispatcher.ack_log.send_nowait(ChangeSubscriber(op="add", name="b", reply=Reply()))


@pytest.mark.asyncio
async def test_dispatcher_idle_when_backoff_expires_with_window_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(tmp_path)
    rounds = 0
    fill = rig.dispatcher._fill

    async def counted_fill() -> None:
        nonlocal rounds
        rounds += 1
        await fill()

    async with running(rig):
        with attached(rig, 2) as (session, rx):
            assert await take(rx, 2) == [(1, 0), (1, 1)]
            await rig.dispatcher.feedback(session, 1, 0, fmt.NACK)
            await settled(rig, (1, 0), fmt.NACK)
            assert await take(rx, 1) == [(1, 2)]  # the window is full again
            monkeypatch.setattr(rig.dispatcher, "_fill", counted_fill)
            await anyio.sleep(0.4)  # the nack's backoff (<= 0.1 s) expires meanwhile
    assert rounds <= 5


class CountingDict(dict[tuple[str, int, int], Session]):
    lookups = 0

    def __contains__(self, key: object) -> bool:
        CountingDict.lookups += 1
        return super().__contains__(key)


@pytest.mark.asyncio
async def test_dispatcher_pick_skips_bundles_still_in_flight(tmp_path: Path) -> None:
    # A wide window's in-flight bundles are not walked again on every wake-up; a
    # bundle that leaves flight (nack settled) is found again.
    rig = make_rig(tmp_path)
    rig.dispatcher.inflight = CountingDict()
    async with running(rig):
        with attached(rig, 8) as (session, rx):
            assert len(await take(rx, 5)) == 5
            CountingDict.lookups = 0
            assert rig.dispatcher._pick(session) == [] and CountingDict.lookups == 0
            await rig.dispatcher.feedback(session, 1, 2, fmt.NACK)
            await settled(rig, (1, 2), fmt.NACK)
            again = await rx.receive()
            assert (again.segment_seq, again.bundle_index) == (1, 2)


@pytest.mark.asyncio
async def test_dispatcher_detach_hands_inflight_to_a_session_already_attached(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 3) as (first, rx1):
            assert await take(rx1, 3) == [(1, 0), (1, 1), (1, 2)]
            with attached(rig, 8) as (second, rx2):
                assert await take(rx2, 2) == [(2, 0), (2, 1)]
                rig.dispatcher.detach(first)
                assert await take(rx2, 3) == [(1, 0), (1, 1), (1, 2)]


# ---- what a socket session gets: the stored IPC bytes -------------------------------
def every_kind_of_slot() -> dict[int, list[Bundle]]:
    """Segment 1: slots absent and present, two-batch slots, schema and field metadata
    variants, an empty slot, a txn tag, a bundle with no user slots, fixed-vocabulary
    and nested dictionaries (sliced as stored). Segment 2: dictionaries that change
    per bundle (remapped at finalize: restored), a widened index and schema drift."""
    words = pa.array([f"w{i}" for i in range(300)])
    fixed = pa.DictionaryArray.from_arrays(pa.array([2, 0, None, 1], pa.int8()),
                                           pa.array(["DEBUG", "INFO", "WARN"]))
    nested = pa.StructArray.from_arrays([fixed], names=["level"])
    one = pa.table({"level": fixed, "n": [1, 2, 3, 4], "nested": nested})
    first = three_slot_bundles()
    first[3] = bundle_of(3, {0: pa.concat_tables([one, one.slice(2)]), 7: one.slice(1, 1)})
    changing = [["a", "b", "c"], ["c", "a"], ["b"], ["a", "b", "c"]]
    second = [bundle_of(100 + i, {0: pa.table({"k": dict_col(v), "i": [i] * len(v)})})
              for i, v in enumerate(changing)]
    # Its own dictionary is the vocabulary, but the index widens to uint16: restored.
    second.append(bundle_of(104, {0: pa.table({"k": pa.DictionaryArray.from_arrays(
        pa.array([0, 255], pa.uint8()), words)})}))
    second.append(bundle_of(105, {0: pa.table({"k": dict_col(["w3", "w1"], pa.uint8())})}))
    second.append(bundle_of(106, {0: pa.table({"k": dict_col(["x"]), "extra": [1.5]})}))
    return {1: first, 2: second}


def sent_tables(b: Bundle) -> dict[int, pa.Table]:
    return {s.slot: read_ipc_stream(s.ipc) for s in b.slots}


def assert_delivered_as_sent(got: Delivery, sent: Bundle) -> None:
    assert (got.client, got.txn, got.ingestion_ts_ns) == (sent.client, sent.txn,
                                                          sent.ingestion_ts_ns)
    assert [s.slot for s in got.slots] == [s.slot for s in sent.slots]
    for slot, original in sent_tables(sent).items():
        (delivered,) = [s for s in got.slots if s.slot == slot]
        table = read_ipc_stream(delivered.ipc)  # what the consumer client decodes
        assert delivered.row_count == original.num_rows
        assert table.equals(original, check_metadata=True), (got.bundle_index, slot)
        assert [f.metadata for f in table.schema] == [f.metadata for f in original.schema]
        if original.num_rows:
            assert [b.num_rows for b in table.to_batches()] == [
                b.num_rows for b in original.to_batches()]
        for name in original.column_names:
            if pa.types.is_dictionary(original.schema.field(name).type) and original.num_rows:
                for a, b in zip(table.column(name).chunks, original.column(name).chunks,
                                strict=True):
                    assert a.dictionary.equals(b.dictionary) and a.indices.equals(b.indices)


@pytest.mark.asyncio
async def test_dispatcher_socket_session_gets_every_slot_as_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles = every_kind_of_slot()
    restored: list[tuple[str, int]] = []
    real_bundle = SegmentReader.bundle

    def spy(self: SegmentReader, index: int) -> Any:
        restored.append((Path(self.path).name, index))
        return real_bundle(self, index)

    monkeypatch.setattr(SegmentReader, "bundle", spy)
    rig = make_rig(tmp_path, bundles, max_dictionary_cardinality=1 << 20)
    total = sum(len(b) for b in bundles.values())
    async with running(rig):
        with attached(rig, total) as (_, rx):
            got = [decoded(await rx.receive()) for _ in range(total)]
    for d in got:
        assert_delivered_as_sent(d, bundles[d.segment_seq][d.bundle_index])
    # Only the bundles whose dictionaries were remapped or widened were decoded.
    assert sorted(restored) == [(f"{2:016d}.qseg", i) for i in (1, 2, 4, 5)]


@pytest.mark.asyncio
async def test_dispatcher_socket_session_never_reencodes_a_bundle_stored_as_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The old path decoded every bundle (SegmentReader.bundle) and encoded each slot
    # anew: both are forbidden here, and the record batch goes out as a view of the
    # mapped segment file, byte for byte.
    def forbidden(*args: object) -> Any:
        raise AssertionError("decoded or re-encoded")

    monkeypatch.setattr(SegmentReader, "bundle", forbidden)
    monkeypatch.setattr(dispatcher_mod, "_ipc_stream", forbidden)
    big = pa.table({"n": pa.array(range(50_000), pa.int64())})
    sent = [Bundle(client="big", slots=(make_slot(0, big),), ingestion_ts_ns=5, sequence=1)]
    rig = make_rig(tmp_path, {1: sent})
    async with running(rig):
        with attached(rig, 1) as (_, rx):
            frame = await rx.receive()
    assert_delivered_as_sent(decoded(frame), sent[0])
    views = [p for p in frame.parts if isinstance(p, memoryview) and p.nbytes > 400_000]
    assert len(views) == 1
    on_disk = DataDir(tmp_path).shard(0).segment(1).read_bytes()
    assert bytes(views[0]) in on_disk


@pytest.mark.asyncio
async def test_dispatcher_frames_cross_a_real_socket_with_sendmsg(tmp_path: Path) -> None:
    bundles = every_kind_of_slot()
    rig = make_rig(tmp_path, bundles, max_dictionary_cardinality=1 << 20)
    total = sum(len(b) for b in bundles.values())
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    right.setblocking(False)
    decoder = FrameDecoder(max_frame_bytes(1 << 26), from_client=False)
    got: list[Delivery] = []
    async with running(rig), RawStream(left) as stream:
        with attached(rig, total) as (_, rx):

            async def receive() -> None:
                while len(got) < total:
                    await anyio.wait_readable(right)
                    got.extend(decoder.feed(right.recv(1 << 20)))  # type: ignore[misc]

            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                for _ in range(total):
                    await stream.send_parts(list((await rx.receive()).parts))
    right.close()
    assert len(got) == total
    for d in got:
        assert_delivered_as_sent(d, bundles[d.segment_seq][d.bundle_index])


def _total(stats: DispatchMetrics, name: str) -> int:
    """A dispatcher counter summed over subscribers (``delivered``, ``acks``, ...)."""
    series = {"delivered": stats._m.delivered, "redelivered": stats._m.redelivered,
              "acks": stats._m.subscriber_acks, "nacks": stats._m.subscriber_nacks}[name]
    return int(series.total())
