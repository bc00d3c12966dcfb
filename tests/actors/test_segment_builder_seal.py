"""segment_builder: ``SealRequests`` (a committed job asks for its bundles now, SPEC §7).

The builder's age limit is out of reach in every test: a segment sealed here was sealed
by the request (reason ``commit``), at once, or when a bundle of the job arrived; an
open segment without a bundle of the job is left open."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from quiverd.kernel.bundle import Bundle, TxnTag
from quiverd.kernel.config import SegmentConfig
from quiverd.kernel.metrics import Metrics, SegmentMetrics
from quiverd_actors import segment_builder
from quiverd_actors.messages import DurableBatch, SealedSegment
from tests.actors.test_segment_builder import NEVER_MS, Log, bundle

pytestmark = pytest.mark.asyncio
CFG = SegmentConfig(target_size_bytes=1 << 30, max_open_duration_ms=NEVER_MS)


def tagged(seq: int, job: str | None) -> Bundle:
    b = bundle(seq)
    if job is None:
        return b
    return Bundle(client=b.client, slots=b.slots, ingestion_ts_ns=b.ingestion_ts_ns,
                  sequence=seq, txn=TxnTag(job_id=job, partition=0, attempt=1,
                                           row_offset=seq))


def batch(*items: tuple[int, str | None]) -> DurableBatch:
    return DurableBatch(bundles=tuple(tagged(seq, job) for seq, job in items))


async def _run(seals: segment_builder.SealRequests, next_sequence: int,
               body: Any) -> list[SealedSegment]:
    inbox, inbox_rx = anyio.create_memory_object_stream[DurableBatch](0)
    out_tx, out = anyio.create_memory_object_stream[SealedSegment](16)
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: segment_builder.run(
            inbox_rx, out_tx, cfg=CFG, first_segment_seq=7, recovered=[],
            limiter=anyio.CapacityLimiter(1), stats=SegmentMetrics(Metrics(), 0),
            log=Log(), seals=seals, next_sequence=next_sequence, task_status=task_status))
        with anyio.fail_after(10):
            await body(inbox, out)
        await inbox.aclose()
    sealed = []
    async with out:
        async for s in out:
            sealed.append(s)
    return sealed


async def test_seal_through_seals_the_open_segment_at_once() -> None:
    seals = segment_builder.SealRequests()
    answers: list[int] = []

    async def body(inbox: Any, out: Any) -> None:
        await inbox.send(batch((10, None), (11, "j")))
        await inbox.send(batch((12, None)))
        answers.append(await seals.sealed_through("j", 12))  # all of it sealed together
        first = out.receive_nowait()
        assert (first.segment_seq, first.reason) == (7, "commit")
        assert [e.sequence for e in first.segment.entries] == [10, 11, 12]
        await inbox.send(batch((13, "other")))
        answers.append(await seals.sealed_through("j", 12))  # sealed already: nothing new
        with pytest.raises(anyio.WouldBlock):
            out.receive_nowait()  # 13 is not of the job: its segment stays open

    sealed = await _run(seals, 10, body)
    assert answers == [7, 7] and seals.jobs == {}
    assert [(s.segment_seq, s.reason) for s in sealed] == [(8, "shutdown")]


async def test_seal_through_waits_for_a_bundle_still_on_its_way() -> None:
    seals = segment_builder.SealRequests()
    answers: list[int] = []

    async def body(inbox: Any, out: Any) -> None:
        async with anyio.create_task_group() as tg:
            async def ask() -> None:
                answers.append(await seals.sealed_through("j", 21))

            tg.start_soon(ask)
            await anyio.sleep(0.05)
            assert answers == []  # 21 has not reached the builder: not yet
            await inbox.send(batch((20, "j")))
            await anyio.sleep(0.05)
            first = out.receive_nowait()  # a bundle of the job: sealed at once
            assert [e.sequence for e in first.segment.entries] == [20]
            assert answers == []
            await inbox.send(batch((21, "j"), (22, None)))
        second = out.receive_nowait()
        assert [e.sequence for e in second.segment.entries] == [21, 22]
        assert second.reason == "commit"

    await _run(seals, 20, body)
    assert answers == [8]


async def test_seal_through_nothing_of_the_job_open_answers_at_once() -> None:
    seals = segment_builder.SealRequests()

    async def body(inbox: Any, out: Any) -> None:
        assert await seals.sealed_through("j", 99) == -1  # below 100: all sealed before
        await inbox.send(batch((100, None), (101, "k")))
        assert await seals.sealed_through("j", 101) == -1  # open, but none of j's
        with pytest.raises(anyio.WouldBlock):
            out.receive_nowait()

    sealed = await _run(seals, 100, body)
    assert [(s.segment_seq, s.reason) for s in sealed] == [(7, "shutdown")]
