"""A subscriber connection's feedback path (quiverd.net.consumers): one read batch of
ACK_BUNDLE / NACK_BUNDLE frames becomes one Feedback per shard, applied by each shard's
real dispatcher and made durable by its real ack_logger in one ack.log append."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import anyio
import pytest

from quiverd.acks import format as fmt
from quiverd.kernel.errors import ProtocolError
from quiverd.net import consumers
from quiverd.net.consumers import SubscriberHub
from quiverd.net.reader import FrameReader
from quiverd.protocol import codec as protocol
from quiverd_actors import ranges
from quiverd_actors.dispatcher import OutgoingDelivery, Session
from quiverd_actors.messages import Feedback, RecordOutcome, RecordOutcomes
from tests.actors.test_dispatcher import Rig, make_rig, running


class NoMoreFrames:
    """The connection's reader after the batch under test: end of stream."""

    async def receive(self, phase: str, what: str = "") -> None:
        return None


NO_MORE = cast(FrameReader, NoMoreFrames())


class Recorded:
    """A dispatcher inbox's ``post`` that keeps what it was given."""

    def __init__(self, post: Callable[[Feedback], Awaitable[None]], seen: list[Feedback]
                 ) -> None:
        self.post, self.seen = post, seen

    async def __call__(self, fb: Feedback) -> None:
        self.seen.append(fb)
        await self.post(fb)


@asynccontextmanager
async def two_shards(tmp_path: Path, window: int) -> AsyncIterator[tuple[
        SubscriberHub, list[Rig], Session, list[list[Feedback]]]]:
    """Two shards (segments 1: 3 bundles, 2: 2 bundles each), subscriber "a" attached to
    both with one shared window that every pending bundle fits in; yields the hub,
    the rigs, the session and, per shard, the Feedback messages its dispatcher got."""
    rigs = [make_rig(tmp_path / f"s{n}") for n in range(2)]
    hub = SubscriberHub()
    hub.dispatchers = [rig.dispatcher for rig in rigs]
    posted: list[list[Feedback]] = [[], []]
    for shard, d in enumerate(hub.dispatchers):
        d.shard = shard
        d.inbox.post = Recorded(d.inbox.post, posted[shard])  # type: ignore[method-assign]
    tx, rx = anyio.create_memory_object_stream[OutgoingDelivery](window)
    session = Session(name="a", window=window, deliveries=tx)
    async with AsyncExitStack() as stack:
        for rig in rigs:
            await stack.enter_async_context(running(rig))
        with tx, rx:
            for d in hub.dispatchers:
                d.attach(session)
            with anyio.fail_after(2):
                got = [await rx.receive() for _ in range(window)]
            assert sorted((d.shard, d.segment_seq, d.bundle_index) for d in got) == [
                (s, seg, i) for s in (0, 1) for seg, i in ((1, 0), (1, 1), (1, 2), (2, 0), (2, 1))]
            yield hub, rigs, session, posted


def fsyncs(rig: Rig) -> int:
    return int(rig.ack_logger.keywords["stats"].fsyncs.value)  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_read_feedback_batch_for_both_shards_one_feedback_and_append_per_shard(
        tmp_path: Path) -> None:
    async with two_shards(tmp_path, 10) as (hub, rigs, session, posted):
        before = [fsyncs(rig) for rig in rigs]
        frames: list[protocol.Message] = [
            protocol.AckBundle(shard=0, segment_seq=1, bundle_index=0),
            protocol.AckBundle(shard=1, segment_seq=1, bundle_index=0),
            protocol.AckBundle(shard=0, segment_seq=1, bundle_index=1),
            protocol.NackBundle(shard=1, segment_seq=2, bundle_index=1),
            protocol.AckBundle(shard=1, segment_seq=1, bundle_index=1),
        ]
        await consumers._read_feedback(hub, NO_MORE, session, frames)
        assert [[f.outcomes for f in p] for p in posted] == [
            [((1, 0, fmt.ACK), (1, 1, fmt.ACK))],
            [((1, 0, fmt.ACK), (2, 1, fmt.NACK), (1, 1, fmt.ACK))]]
        for rig, shard_fbs in zip(rigs, posted, strict=True):
            msg = await rig.outcomes.receive()
            assert isinstance(msg, RecordOutcomes)
            assert [o[1:] for o in msg.outcomes] == list(shard_fbs[0].outcomes)
            assert all(e is None for e in await msg.reply.wait())
        assert session.unacked == 5  # both dispatchers gave the window's room back
        assert [fsyncs(rig) - b for rig, b in zip(rigs, before, strict=True)] == [1, 1]
    assert rigs[0].state.gap_set("a") == {(1, 0), (1, 1)}
    assert rigs[1].state.gap_set("a") == {(1, 0), (1, 1)}
    assert rigs[1].state.nack_count("a", 2, 1) == 1


@pytest.mark.asyncio
async def test_read_feedback_bad_frame_sends_outcomes_before_it_then_refuses(
        tmp_path: Path) -> None:
    async with two_shards(tmp_path, 10) as (hub, rigs, session, posted):
        frames: list[protocol.Message] = [
            protocol.AckBundle(shard=0, segment_seq=1, bundle_index=0),
            protocol.AckBundle(shard=2, segment_seq=1, bundle_index=1),  # no such shard
            protocol.AckBundle(shard=1, segment_seq=1, bundle_index=0),
        ]
        with pytest.raises(ProtocolError, match="no shard 2"):
            await consumers._read_feedback(hub, NO_MORE, session, frames)
        assert [[f.outcomes for f in p] for p in posted] == [[((1, 0, fmt.ACK),)], []]
        msg = await rigs[0].outcomes.receive()
        assert isinstance(msg, RecordOutcome)
        await msg.reply.wait()  # raises had ack.log refused it


@pytest.mark.asyncio
async def test_fetch_names_a_segment_deleted_while_the_range_is_read(tmp_path: Path) -> None:
    """Retention unlinks a segment of the range after the fetch picked it: the bundles
    sent stay sent, the rest of that segment is named lost, no error."""
    rig = make_rig(tmp_path)
    rig.dispatcher.segments[2].path.unlink()  # still in the table: gone under the fetch
    sent: list[object] = []

    async def send_parts(parts: list[object]) -> None:
        sent.append(parts)

    reader = cast(FrameReader, SimpleNamespace(stream=SimpleNamespace(send_parts=send_parts)))
    req = consumers._Fetch(subscriber="a", shard=0, after=(1, -1),
                           through=(2, ranges.END_OF_SEGMENT))
    async with running(rig):
        reply = await consumers._fetch(rig.dispatcher, reader, req)
    assert reply["bundles"] == 3 and len(sent) == 3  # segment 1's bundles
    assert reply["lost"] == [{"shard": 0, "after": [2, -1],
                              "through": [2, ranges.END_OF_SEGMENT], "segments": [2, 2],
                              "dropped_bundles": 0}]
