"""Feedback as messages: the dispatcher's bounded inbox (quiverd_actors.feedback), the
ack_logger's ``RecordOutcomes`` (one append for a batch, one refused outcome changing
only itself), and the dispatcher applying queued feedback in its own pass, including
feedback from a session that detached before the pass came."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from quiverd.acks import format as fmt
from quiverd.acks.state import UnknownBundle
from quiverd.kernel.changes import Changes
from quiverd.kernel.reply import Reply
from quiverd_actors.dispatcher import OutgoingDelivery, Session
from quiverd_actors.feedback import FeedbackInbox
from quiverd_actors.messages import Feedback, RecordOutcome, RecordOutcomes
from tests.actors import test_ack_logger as acklog
from tests.actors.test_dispatcher import Rig, attached, make_rig, running, take


def session_of(name: str = "a") -> Session:
    tx, rx = anyio.create_memory_object_stream[OutgoingDelivery](1)
    tx.close()
    rx.close()
    return Session(name=name, window=1, deliveries=tx)


def fb(session: Session, *outcomes: tuple[int, int, int]) -> Feedback:
    return Feedback(session=session, outcomes=outcomes)


# ---- the inbox ------------------------------------------------------------------
@pytest.mark.asyncio
async def test_feedback_inbox_sender_waits_past_bound_until_taken() -> None:
    changes, session = Changes(), session_of()
    inbox = FeedbackInbox(changes, bound=2)
    await inbox.post(fb(session, (1, 0, fmt.ACK), (1, 1, fmt.ACK)))  # reaches the bound
    assert changes.version == 1
    posted = anyio.Event()

    async def third() -> None:
        await inbox.post(fb(session, (1, 2, fmt.NACK)))
        posted.set()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await anyio.sleep(0.05)
            assert not posted.is_set()  # bounded: the sender waits for the pass
            assert [f.outcomes for f in inbox.take()] == [((1, 0, fmt.ACK), (1, 1, fmt.ACK))]
            await posted.wait()
    assert [f.outcomes for f in inbox.take()] == [((1, 2, fmt.NACK),)]
    assert inbox.take() == []


@pytest.mark.asyncio
async def test_feedback_inbox_closed_refuses_and_releases_waiting_senders() -> None:
    session = session_of()
    inbox = FeedbackInbox(Changes(), bound=1)
    await inbox.post(fb(session, (1, 0, fmt.ACK)))
    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            async def waiting() -> None:
                with pytest.raises(anyio.ClosedResourceError):
                    await inbox.post(fb(session, (1, 1, fmt.ACK)))

            tg.start_soon(waiting)
            await anyio.sleep(0.05)
            inbox.close()
    assert inbox.take() == []  # what was queued is dropped: delivered again later
    with pytest.raises(anyio.ClosedResourceError):
        await inbox.post(fb(session, (1, 2, fmt.ACK)))


# ---- the ack_logger -------------------------------------------------------------
@pytest.mark.asyncio
async def test_ack_logger_record_outcomes_one_append_refusal_is_per_outcome(
        tmp_path: Path) -> None:
    rig = acklog.make_rig(tmp_path, {1: 3})
    request = RecordOutcomes(outcomes=(("a", 1, 0, fmt.ACK), ("a", 9, 0, fmt.ACK),
                                       ("a", 1, 2, fmt.NACK), ("a", 1, 1, fmt.ACK)),
                             reply=Reply())
    async with acklog.running(rig) as tx:
        await tx.send(request)
        errors = await request.reply.wait()
    assert [type(e) if e else None for e in errors] == [None, UnknownBundle, None, None]
    assert (rig.stats.fsyncs.value, rig.stats.records.value) == (1, 3)
    assert rig.state.gap_set("a") == {(1, 0), (1, 1)} and rig.state.nack_count("a", 1, 2) == 1
    assert rig.replayed().gap_set("a") == {(1, 0), (1, 1)}


# ---- the dispatcher ---------------------------------------------------------------
def acklog_fsyncs(rig: Rig) -> int:
    return int(rig.ack_logger.keywords["stats"].fsyncs.value)  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_dispatcher_queued_feedback_applied_in_one_pass_one_append(
        tmp_path: Path) -> None:
    # The uploader's acks of a registered file: calls that do not yield in between
    # reach ack.log as one RecordOutcomes and one append, and free the window at once.
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 4) as (session, rx):
            assert await take(rx, 4) == [(1, 0), (1, 1), (1, 2), (2, 0)]
            before = acklog_fsyncs(rig)
            for idx in range(3):
                await rig.dispatcher.feedback(session, 1, idx, fmt.ACK)
            msg = await rig.outcomes.receive()
            assert isinstance(msg, RecordOutcomes)
            assert msg.outcomes == tuple(("a", 1, i, fmt.ACK) for i in range(3))
            assert session.unacked == 1  # room came back when the pass applied them
            assert await msg.reply.wait() == (None, None, None)
            assert await take(rx, 1) == [(2, 1)]
            assert acklog_fsyncs(rig) == before + 1
    assert rig.state.covered_below("a") == 2


@pytest.mark.asyncio
async def test_dispatcher_feedback_of_detached_session_ack_settles_nack_redelivers(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 3) as (first, rx):
            assert await take(rx, 3) == [(1, 0), (1, 1), (1, 2)]
            # Queued, and the session gone, before the dispatcher's next pass.
            await rig.dispatcher.feedback(first, 1, 0, fmt.ACK)
            await rig.dispatcher.feedback(first, 1, 1, fmt.NACK)
            rig.dispatcher.detach(first)
        assert first.unacked == 3  # a detached session's window is not touched
        msg = await rig.outcomes.receive()
        assert isinstance(msg, RecordOutcomes)
        assert await msg.reply.wait() == (None, None)
        await _settled(rig)
        with attached(rig, 8) as (second, rx):
            # The ack is durable: (1, 0) is never delivered again; (1, 2) comes back at
            # once, the nacked (1, 1) after its backoff.
            got = await take(rx, 4)
            assert sorted(got) == [(1, 1), (1, 2), (2, 0), (2, 1)]
            assert set(rig.dispatcher.inflight.values()) == {second}
    assert rig.state.gap_set("a") == {(1, 0)} and rig.state.nack_count("a", 1, 1) == 1


@pytest.mark.asyncio
async def test_dispatcher_stale_ack_after_redelivery_leaves_new_session_in_flight(
        tmp_path: Path) -> None:
    # A stale ack is applied after the bundle went to the next session: that session
    # keeps it in flight (and its window slot) until it answers itself.
    rig = make_rig(tmp_path)
    async with running(rig):
        with attached(rig, 1) as (first, rx1):
            assert await take(rx1, 1) == [(1, 0)]
            await rig.dispatcher.feedback(first, 1, 0, fmt.ACK)
            rig.dispatcher.detach(first)
            with attached(rig, 1) as (second, rx2):
                msg = await rig.outcomes.receive()
                assert isinstance(msg, RecordOutcome)
                got = await rx2.receive()  # not yet durable when the pass filled
                assert (got.segment_seq, got.bundle_index) == (1, 0)
                await msg.reply.wait()
                await _settled(rig)
                assert rig.dispatcher.inflight.get(("a", 1, 0)) is second
                assert second.unacked == 1
                await rig.dispatcher.feedback(second, 1, 0, fmt.ACK)  # a duplicate: no record
                again = await rig.outcomes.receive()
                assert isinstance(again, RecordOutcome)
                await again.reply.wait()  # None: nothing refused
                assert await take(rx2, 1) == [(1, 1)]
    assert rig.state.gap_set("a") == {(1, 0)}


class RecordingLog:
    """Stands in for the dispatcher's logger: keeps (event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    error = warning = info


@pytest.mark.asyncio
async def test_dispatcher_refused_outcomes_logged_once_per_batch_others_settle(
        tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    log = RecordingLog()
    rig.dispatcher.log = log  # type: ignore[assignment]
    async with running(rig):
        with attached(rig, 2) as (session, rx):
            assert await take(rx, 2) == [(1, 0), (1, 1)]
            for seg, idx in ((1, 0), (9, 0), (9, 1), (1, 1)):  # segment 9 never existed
                await rig.dispatcher.feedback(session, seg, idx, fmt.ACK)
            msg = await rig.outcomes.receive()
            assert isinstance(msg, RecordOutcomes)
            errors = await msg.reply.wait()
            assert [type(e) for e in errors if e is not None] == [UnknownBundle] * 2
            assert await take(rx, 2) == [(1, 2), (2, 0)]  # both acks freed their place
            await _settled(rig)
            assert set(rig.dispatcher.inflight) == {("a", 1, 2), ("a", 2, 0)}
    assert [(e, f["outcomes"], f["segment_seq"]) for e, f in log.events
            if e == "subscriber_feedback_ignored"] == [("subscriber_feedback_ignored", 2, 9)]
    assert rig.state.gap_set("a") == {(1, 0), (1, 1)}


async def _settled(rig: Rig) -> None:
    """The dispatcher's pass after a durable reply has settled what it sent."""
    await anyio.wait_all_tasks_blocked()
    assert rig.dispatcher.awaiting == []
