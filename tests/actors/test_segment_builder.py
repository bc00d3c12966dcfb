"""segment_builder actor: which SealedSegments come out, when, why, and in what order.

Each test drives ``actors.segment_builder.run`` in a task group with memory streams,
feeds DurableBatches of real Arrow bundles and checks every SealedSegment: its
``segment_seq`` (consecutive from ``first_segment_seq``), its ``reason`` (size, streams,
age timer, ``seal_early`` pressure, shutdown at end of stream) and the bundles inside,
plus recovered bundles, end of stream and cancellation on a full outbox.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.config import SegmentConfig
from quiverd.kernel.metrics import Metrics, SegmentMetrics
from quiverd.segments.open_segment import OpenSegment
from quiverd_actors import segment_builder
from quiverd_actors.messages import DurableBatch, SealedSegment

NEVER_MS = 60_000  # an age limit no test reaches


class Log:
    def __getattr__(self, level: str) -> Callable[..., None]:  # info/warning/error
        return lambda *a, **k: None


def bundle(seq: int, slot: int = 0) -> Bundle:
    """A durable bundle as the WAL writer stamps it: sequence and ingestion time set."""
    table = pa.table({"seq": pa.array([seq] * 50, pa.int64()), "s": [f"row-{seq}"] * 50})
    return Bundle(client="app", slots=(make_slot(slot, table),), ingestion_ts_ns=1_000 + seq,
                  sequence=seq)


PAYLOAD = bundle(1).payload_bytes


def batch(*seqs: int) -> DurableBatch:
    return DurableBatch(bundles=tuple(bundle(s) for s in seqs))


class Harness:
    """The builder's two streams, its stats and how its coroutine ended."""

    def __init__(self, outbox_size: int) -> None:
        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[DurableBatch](0)
        self._out_tx, self.out = anyio.create_memory_object_stream[SealedSegment](outbox_size)
        self.metrics = Metrics()
        self.stats = SegmentMetrics(self.metrics, 0)
        self.outcome: list[str] = []

    async def run(self, cfg: SegmentConfig, *, task_status: Any,
                  recovered: list[Bundle] | None = None, first_segment_seq: int = 7,
                  seal_early: Callable[[], bool] | None = None) -> None:
        try:
            await segment_builder.run(
                self._inbox_rx, self._out_tx, cfg=cfg, first_segment_seq=first_segment_seq,
                recovered=recovered or [], limiter=anyio.CapacityLimiter(1), stats=self.stats,
                seal_early=seal_early, log=Log(), task_status=task_status)
        except anyio.get_cancelled_exc_class():
            self.outcome.append("cancelled")
            raise
        self.outcome.append("returned")

    def close(self) -> None:
        for s in (self.inbox, self._inbox_rx, self._out_tx, self.out):
            s.close()


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(*, outbox_size: int = 8) -> Harness:
        made.append(Harness(outbox_size))
        return made[-1]

    yield factory
    for h in made:
        h.close()


def config(**kw: Any) -> SegmentConfig:
    return SegmentConfig(**{"max_open_duration_ms": NEVER_MS, **kw})


def summary(sealed: SealedSegment) -> tuple[int, str, list[int]]:
    """(segment_seq, reason, WAL sequences of its bundles in order)."""
    return (sealed.segment_seq, sealed.reason, [e.sequence for e in sealed.segment.entries])


async def sealed_until_end(h: Harness) -> list[tuple[int, str, list[int]]]:
    """Close the inbox, then everything the builder seals until it closes its outbox."""
    h.inbox.close()
    return [summary(s) async for s in h.out]


@pytest.mark.asyncio
async def test_segment_builder_seals_on_size_with_consecutive_segment_seqs(make):
    h = make()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(target_size_bytes=2 * PAYLOAD)))
            for seq in (1, 2, 3):
                await h.inbox.send(batch(seq))
            await h.inbox.send(batch(4, 5))
            first, second = summary(await h.out.receive()), summary(await h.out.receive())
            await h.inbox.send(batch(6))
            rest = await sealed_until_end(h)
    assert first == (7, "size", [1, 2])
    assert second == (8, "size", [3, 4, 5])
    assert rest == [(9, "shutdown", [6])]
    assert (h.outcome, h.metrics.segments_sealed.total()) == (["returned"], 3)


@pytest.mark.asyncio
async def test_segment_builder_seals_on_stream_count(make):
    h = make()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(max_streams=2)))
            await h.inbox.send(DurableBatch(bundles=(bundle(1, slot=0), bundle(2, slot=0))))
            await h.inbox.send(DurableBatch(bundles=(bundle(3, slot=4),)))
            sealed = await h.out.receive()
            rest = await sealed_until_end(h)
    assert summary(sealed) == (7, "streams", [1, 2, 3])
    assert [s.slot for s in sealed.segment.streams] == [0, 4]
    assert rest == []


@pytest.mark.asyncio
async def test_segment_builder_seals_on_age_timer_without_new_input(make):
    h = make()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(max_open_duration_ms=50)))
            await h.inbox.send(batch(1, 2))
            sent_at = anyio.current_time()
            sealed = await h.out.receive()
            waited = anyio.current_time() - sent_at
            with anyio.move_on_after(0.15):  # nothing open: no timer, no empty segments
                pytest.fail(f"sealed again: {summary(await h.out.receive())}")
            await h.inbox.send(batch(3))
            again = summary(await h.out.receive())
            rest = await sealed_until_end(h)
    assert summary(sealed) == (7, "age", [1, 2])
    assert 0.04 <= waited < 0.4
    assert again == (8, "age", [3])  # the timer restarts with the next open segment
    assert rest == []


@pytest.mark.asyncio
async def test_segment_builder_seals_under_pressure_when_seal_early_true(make):
    h = make()
    answers, asked = [False, True, False], []

    def seal_early() -> bool:
        asked.append(h.stats.open_bundles.value)
        return answers[len(asked) - 1]

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(), seal_early=seal_early))
            await h.inbox.send(batch(1))
            await h.inbox.send(batch(2, 3))
            sealed = summary(await h.out.receive())
            await h.inbox.send(batch(4))
            rest = await sealed_until_end(h)
    assert sealed == (7, "pressure", [1, 2, 3])
    assert asked == [1, 3, 1]  # asked after every batch, with that batch already added
    assert rest == [(8, "shutdown", [4])]


@pytest.mark.asyncio
async def test_segment_builder_seals_open_segment_at_end_of_stream(make):
    h = make()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config()))
            await h.inbox.send(batch(1, 2))
            await h.inbox.send(batch(3))
            sealed = await sealed_until_end(h)
            with pytest.raises(anyio.EndOfStream):
                await h.out.receive()
    assert sealed == [(7, "shutdown", [1, 2, 3])]
    assert (h.outcome, h.stats.open_bundles.value, h.metrics.segments_sealed.total()) == (
        ["returned"], 0, 1)


@pytest.mark.asyncio
async def test_segment_builder_puts_recovered_bundles_into_first_segment(make):
    h = make()
    recovered = [bundle(11), bundle(12)]
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(), recovered=recovered,
                                             first_segment_seq=42))
            # Ready first; the recovered bundles still go in ahead of any new one.
            await h.inbox.send(batch(13))
            h.inbox.close()
            sealed = [s async for s in h.out]
    assert [summary(s) for s in sealed] == [(42, "shutdown", [11, 12, 13])]
    segment = sealed[0].segment
    assert (segment.first_sequence, segment.last_sequence) == (11, 13)
    assert (segment.min_ts, segment.max_ts) == (1_011, 1_013)


@pytest.mark.asyncio
async def test_segment_builder_seals_a_large_recovery_at_the_target_size_after_ready(make):
    """A WAL of many GiB must not become one segment, nor hold up ready until it is
    all finalized: it is sealed at the target size, like live bundles."""
    h = make(outbox_size=0)  # nothing may be sealed before ready: ready would block
    recovered = [bundle(s) for s in (1, 2, 3)]
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(target_size_bytes=PAYLOAD),
                                             recovered=recovered))
            rest = await sealed_until_end(h)
    assert rest == [(7, "size", [1]), (8, "size", [2]), (9, "size", [3])]


@pytest.mark.asyncio
async def test_segment_builder_cancel_with_full_outbox_ends_promptly(make):
    h = make(outbox_size=1)  # nobody reads it
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(target_size_bytes=1)))
            await h.inbox.send(batch(1))  # sealed into the outbox's one place
            await h.inbox.send(batch(2))  # sealed, then waits for room
            with anyio.move_on_after(0.2) as blocked:
                await h.inbox.send(batch(3))  # unbuffered: only taken if the builder reads
            started = anyio.current_time()
            tg.cancel_scope.cancel()
    assert blocked.cancelled_caught, "the builder took input while its outbox was full"
    assert anyio.current_time() - started < 1.0
    assert h.outcome == ["cancelled"]
    assert summary(h.out.receive_nowait()) == (7, "size", [1])
    with pytest.raises(anyio.EndOfStream):
        h.out.receive_nowait()



@pytest.mark.asyncio
async def test_segment_builder_cancel_during_shutdown_seal_is_not_swallowed(make):
    h = make(outbox_size=1)  # nobody reads it
    with h._out_tx.clone() as other:  # fill the outbox's one place before the builder runs
        other.send_nowait(SealedSegment(segment_seq=0, segment=OpenSegment(), reason="size"))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, config(), recovered=[bundle(1)]))
            h.inbox.close()  # the open segment is sealed at end of stream: no room for it
            await anyio.wait_all_tasks_blocked()
            assert (h.metrics.segments_sealed.total(),
                    h.out.statistics().tasks_waiting_send) == (1, 1)
            started = anyio.current_time()
            tg.cancel_scope.cancel()
    assert anyio.current_time() - started < 1.0
    assert h.outcome == ["cancelled"]
    assert h.out.receive_nowait().segment_seq == 0  # the filler; the shutdown seal never went
    with pytest.raises(anyio.EndOfStream):
        h.out.receive_nowait()
