"""The scrubber actor (quiverd_actors.scrubber) in process, against the real ack_logger.

Real segment files and ack.log: a segment with a flipped stream byte is found by a
pass at the configured rate (no sooner than its bytes allow), then quarantined the
way recovery does it: out of the table, moved to quarantine/, its bundles reported
lost with their ids, forgotten by ack.log. A bad segment reported by a read
(``SegmentChecks.open_reader``, from a worker thread) is quarantined the same way.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import anyio
import pyarrow as pa
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from quiverd.acks.recovery import recover_acks
from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import SubscriberEntry
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.layout import DataDir, ShardLayout
from quiverd.kernel.metrics import AckLogMetrics, Metrics, ScrubMetrics
from quiverd.segments.files import segment_info, write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader
from quiverd.segments.table import SegmentInfo, SegmentTable
from quiverd_actors import ack_logger, scrubber
from quiverd_actors.messages import AckLogRequest, SegmentsDeleted
from tests.daemon.helpers import flip
from tests.recording import Log

SEGMENT_BYTES = 1 << 20


def make_segment(shard: ShardLayout, seq: int) -> SegmentInfo:
    """About 1 MiB of incompressible rows in 4 bundles; bundle i is WAL sequence 10*seq+i."""
    segment = OpenSegment()
    for i in range(4):
        blob = os.urandom(SEGMENT_BYTES // 4)
        table = pa.table({"b": pa.array([blob], pa.binary())})
        segment.add(Bundle(client="app", slots=(make_slot(0, table),), ingestion_ts_ns=i,
                           sequence=10 * seq + i))
    path = shard.segment(seq)
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1024))
    with SegmentReader.open(path) as reader:
        return segment_info(path, seq, reader)




async def tap(rx: MemoryObjectReceiveStream[AckLogRequest],
              tx: MemoryObjectSendStream[AckLogRequest], forgotten: anyio.Event) -> None:
    async with rx, tx:
        async for msg in rx:
            await tx.send(msg)
            if isinstance(msg, SegmentsDeleted):
                forgotten.set()


async def run_scrubber(tmp_path: Path, *, rate: float, bad: int,
                       reader_finds_it: bool = False) -> tuple[float, dict[str, object]]:
    shard = DataDir(tmp_path).shard(0)
    for d in shard.directories():
        d.mkdir(parents=True, exist_ok=True)
    infos = [make_segment(shard, seq) for seq in (1, 2, 3)]
    flip(infos[bad - 1].path, 1000)  # inside its stream bytes
    rec = recover_acks(shard, {s.segment_seq: s.bundle_count for s in infos},
                       [SubscriberEntry(name="a")], Log())
    table = SegmentTable(infos)
    checks = scrubber.SegmentChecks({1, 2, 3})
    log, metrics = Log(), Metrics()
    stats = ScrubMetrics(metrics, 0)
    to_tap, from_scrubber = anyio.create_memory_object_stream[AckLogRequest](16)
    to_logger, inbox = anyio.create_memory_object_stream[AckLogRequest](16)
    forgotten = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(
                ack_logger.run, inbox, state=rec.state, file=rec.file, segments=table,
                changes=Changes(), limiter=anyio.CapacityLimiter(1),
                stats=AckLogMetrics(metrics, 0), log=log))
            tg.start_soon(tap, from_scrubber, to_logger, forgotten)
            started = anyio.current_time()
            async with anyio.create_task_group() as actors:
                await actors.start(partial(
                    scrubber.run, to_tap, shard=0, layout=shard, segments=table.view(),
                    checks=checks, rate_bytes_per_s=rate, pass_interval_s=3600,
                    limiter=anyio.CapacityLimiter(1), stats=stats, log=log))
                if reader_finds_it:
                    with pytest.raises(CorruptRecord):
                        await anyio.to_thread.run_sync(checks.open_reader, bad,
                                                       shard.segment(bad))
                    assert not checks.is_unverified(1) or rate == 0
                    opened = await anyio.to_thread.run_sync(checks.open_reader, 1,
                                                            shard.segment(1))
                    opened.close()
                    assert not checks.is_unverified(1)  # its first read checked it
                await forgotten.wait()
                elapsed = anyio.current_time() - started
                actors.cancel_scope.cancel()
    assert bad not in table and bad not in rec.state.live_segments()
    assert not shard.segment(bad).exists()
    assert (shard.quarantine_dir / shard.segment(bad).name).exists()
    assert all(seg != bad for seg, _ in rec.state.pending_for("a"))
    [lost] = [kw for event, kw in log.events if event == "bundles_lost"]
    assert lost["bundle_ids"] == f"(0, {bad}, 0..3)" and lost["bundle_count"] == 4
    assert (lost["first_sequence"], lost["last_sequence"]) == (10 * bad, 10 * bad + 3)
    assert stats.bundles_lost.value == 4
    return elapsed, {"found_by": lost["found_by"], "scrubbed": stats.bytes.value,
                     "quarantined": list(checks.quarantined)}


@pytest.mark.asyncio
async def test_scrubber_finds_a_flipped_stream_byte_at_its_rate(tmp_path: Path) -> None:
    rate = 4 * SEGMENT_BYTES  # bytes per second: segment 2 is done after ~0.5 s
    elapsed, seen = await run_scrubber(tmp_path, rate=rate, bad=2)
    assert seen["found_by"] == "scrub"
    scrubbed = seen["scrubbed"]
    assert isinstance(scrubbed, float | int) and scrubbed >= 2 * SEGMENT_BYTES
    # Bounded by the rate: segment 1 and all but the last chunk of segment 2 were paced.
    assert elapsed >= (2 * SEGMENT_BYTES - SEGMENT_BYTES // 2) / rate * 0.9, elapsed
    assert elapsed < 5


@pytest.mark.asyncio
async def test_scrubber_quarantines_what_a_first_read_found(tmp_path: Path) -> None:
    _, seen = await run_scrubber(tmp_path, rate=0, bad=3, reader_finds_it=True)
    assert seen["found_by"] == "read"
    assert seen["scrubbed"] == 0  # no passes at rate 0: the read found it
    [q] = seen["quarantined"]  # type: ignore[misc]
    assert q["segment_seq"] == 3 and q["found_by"] == "read"
