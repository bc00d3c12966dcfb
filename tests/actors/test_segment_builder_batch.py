"""segment_builder with ``from_wal``: each DurableBatch goes into the open segment at once.

Bundles with validation facts are added on the loop (``OpenSegment.add_batch``); from the
first bundle whose payload must be decoded on, the rest of the batch goes to one worker
thread. Either way the sealed segment is the one ``add(b, from_wal=True)`` bundle by
bundle builds, and the open-segment gauges are set once per batch.
"""

from __future__ import annotations

import anyio
import pytest

from quiverd.kernel.bundle import Bundle
from quiverd.kernel.config import SegmentConfig
from quiverd.kernel.metrics import Metrics, SegmentMetrics
from quiverd.segments.open_segment import OpenSegment
from quiverd_actors import segment_builder
from quiverd_actors.messages import DurableBatch, SealedSegment
from tests.segments.test_open_segment_batch import bundles, state


class Log:
    def __getattr__(self, level: str):  # type: ignore[no-untyped-def]
        return lambda *a, **k: None


async def build(batches: list[tuple[Bundle, ...]]) -> SealedSegment:
    """Every batch through the builder (from_wal); the one segment it seals at the end."""
    inbox_tx, inbox_rx = anyio.create_memory_object_stream[DurableBatch](len(batches))
    out_tx, out_rx = anyio.create_memory_object_stream[SealedSegment](4)
    stats = SegmentMetrics(Metrics(), 0)
    cfg = SegmentConfig(max_open_duration_ms=60_000)
    for b in batches:
        inbox_tx.send_nowait(DurableBatch(bundles=b))
    inbox_tx.close()
    with anyio.fail_after(10):
        await segment_builder.run(inbox_rx, out_tx, cfg=cfg, first_segment_seq=1, recovered=[],
                                  limiter=anyio.CapacityLimiter(1), stats=stats, log=Log(),
                                  from_wal=True)
    with out_rx:
        sealed = [s async for s in out_rx]
    assert len(sealed) == 1
    assert stats.open_bundles.value == 0  # shown after the seal
    return sealed[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("cuts", [(), (3, 10, 29, 30), (28,)])
async def test_segment_builder_from_wal_batches_build_the_bundle_by_bundle_segment(cuts):
    bs = bundles(shared=True)
    edges = [0, *cuts, len(bs)]
    sealed = await build([tuple(bs[lo:hi]) for lo, hi in zip(edges, edges[1:], strict=False)])
    expected = OpenSegment()
    for b in bs:
        expected.add(b, from_wal=True)
    assert (sealed.segment_seq, sealed.reason) == (1, "shutdown")
    assert state(sealed.segment) == state(expected)


@pytest.mark.asyncio
async def test_segment_builder_decodes_in_a_thread_only_from_the_first_bundle_without_facts(
        monkeypatch):
    bs = bundles(shared=True)[20:32]  # bundle 29 (index 9 here) has a slot without facts
    calls: list[tuple[bool, int]] = []
    real = OpenSegment.add_batch

    def spy(self: OpenSegment, batch, *, decode: bool = True) -> int:  # type: ignore[no-untyped-def]
        calls.append((decode, len(batch)))
        return real(self, batch, decode=decode)

    monkeypatch.setattr(OpenSegment, "add_batch", spy)
    sealed = await build([tuple(bs)])
    assert calls == [(False, 12), (True, 3)]  # 9 on the loop, the rest in one thread hop
    assert [e.sequence for e in sealed.segment.entries] == [b.sequence for b in bs]
