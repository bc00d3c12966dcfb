"""finalizer actor on real files: segment written durably, then WalReleased, then SegmentWritten.

Each test drives ``actors.finalizer.run`` in a task group with memory streams and a real
shard directory under ``tmp_path``. It checks the segment file (name, mode 0440, no temp
file left, contents read back with SegmentReader, the SegmentInfo recovery would build),
the FLOOR marker, the order of the two messages out, a failed write, end of stream and
cancellation on a full outbox.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, make_slot, read_ipc_stream
from quiverd.kernel.errors import DurabilityLost
from quiverd.kernel.layout import DataDir, ShardLayout
from quiverd.kernel.metrics import Metrics, SegmentMetrics
from quiverd.segments.files import Floor, read_marker, segment_info
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader
from quiverd_actors import finalizer
from quiverd_actors.messages import SealedSegment, SealReason, SegmentWritten, WalReleased
from tests.recording import Log


def bundle(seq: int) -> Bundle:
    table = pa.table({"seq": pa.array([seq] * 20, pa.int64()), "msg": [f"m{seq}"] * 20})
    return Bundle(client=f"c{seq % 2}", slots=(make_slot(seq % 3, table),),
                  ingestion_ts_ns=5_000 + seq, sequence=seq)


def sealed(segment_seq: int, seqs: range, reason: SealReason = "size") -> SealedSegment:
    segment = OpenSegment()
    for s in seqs:
        segment.add(bundle(s))
    return SealedSegment(segment_seq=segment_seq, segment=segment, reason=reason)


class Harness:
    """A shard directory with the finalizer's three streams."""

    def __init__(self, tmp_path: Path, *, outbox_size: int, releases_size: int) -> None:
        self.shard: ShardLayout = DataDir(tmp_path).shard(0)
        for d in self.shard.directories():
            d.mkdir(parents=True)
        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[SealedSegment](1)
        self._out_tx, self.out = anyio.create_memory_object_stream[SegmentWritten](outbox_size)
        self._rel_tx, self.releases = anyio.create_memory_object_stream[WalReleased](
            releases_size)
        self.stats, self.log = SegmentMetrics(Metrics(), 0), Log()
        self.outcome: list[str] = []

    async def run(self, *, task_status: Any, hook: Callable[[str], None] | None = None) -> None:
        try:
            await finalizer.run(
                self._inbox_rx, self._out_tx, self._rel_tx, shard=self.shard,
                max_dictionary_cardinality=1 << 20, limiter=anyio.CapacityLimiter(1),
                stats=self.stats, log=self.log, hook=hook, task_status=task_status)
        except anyio.get_cancelled_exc_class():
            self.outcome.append("cancelled")
            raise
        self.outcome.append("returned")

    def files(self) -> list[str]:
        return sorted(p.name for p in self.shard.segments_dir.iterdir())

    def floor(self) -> int:
        return read_marker(self.shard.floor, Floor).segment_seq

    def close(self) -> None:
        for s in (self.inbox, self._inbox_rx, self._out_tx, self.out, self._rel_tx,
                  self.releases):
            s.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(*, outbox_size: int = 4, releases_size: int = 4) -> Harness:
        made.append(Harness(tmp_path, outbox_size=outbox_size, releases_size=releases_size))
        return made[-1]

    yield factory
    for h in made:
        h.close()


@pytest.mark.asyncio
async def test_finalizer_writes_read_only_segment_and_announces_what_recovery_reads(make):
    h = make()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(h.run)
            await h.inbox.send(sealed(5, range(10, 13)))
            released = await h.releases.receive()
            written = await h.out.receive()
            h.inbox.close()
    path = h.shard.segment(5)
    assert released == WalReleased(upto_sequence=12)
    assert (path.name, h.files()) == ("0000000000000005.qseg", ["0000000000000005.qseg", "FLOOR"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o440
    with SegmentReader.open(path) as reader:
        assert written.info == segment_info(path, 5, reader)
        read = list(reader.bundles())
    assert (written.info.first_sequence, written.info.last_sequence) == (10, 12)
    assert (written.info.min_ts_ns, written.info.max_ts_ns, written.info.bundle_count) == (
        5_010, 5_012, 3)
    assert [(b.sequence, b.client, b.ingestion_ts_ns) for b in read] == [
        (s, f"c{s % 2}", 5_000 + s) for s in (10, 11, 12)]
    for b in read:
        sent = bundle(b.sequence).slots[0]
        assert b.slots[sent.slot].equals(read_ipc_stream(sent.ipc))
    assert h.floor() == 5
    assert (h.stats.finalized.value, h.stats.finalized_bytes.value) == (
        1, path.stat().st_size)
    assert h.log.events == [("segment_finalized", {
        "segment_seq": 5, "bytes": path.stat().st_size, "bundles": 3, "streams": 3,
        "reason": "size"})]


@pytest.mark.asyncio
async def test_finalizer_releases_wal_before_announcing_segment(make):
    h = make(releases_size=0)  # unbuffered: WalReleased waits for the test to take it
    floor_written = anyio.Event()

    def hook(step: str) -> None:
        if step == "floor_written":
            anyio.from_thread.run_sync(floor_written.set)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, hook=hook))
            await h.inbox.send(sealed(1, range(1, 4)))
            await floor_written.wait()
            with anyio.move_on_after(0.1):
                pytest.fail(f"announced before the WAL release: {await h.out.receive()}")
            durable_at_release = (h.files(), h.floor())
            released = await h.releases.receive()
            written = await h.out.receive()
            h.inbox.close()
    assert released == WalReleased(upto_sequence=3)
    assert durable_at_release == (["0000000000000001.qseg", "FLOOR"], 1)
    assert (written.info.segment_seq, written.info.last_sequence) == (1, 3)


@pytest.mark.asyncio
async def test_finalizer_raises_floor_per_segment_and_ends_both_streams_at_end_of_stream(make):
    h = make()
    floors = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(h.run)
            await h.inbox.send(sealed(3, range(1, 3)))
            await h.releases.receive()
            floors.append(h.floor())
            await h.inbox.send(sealed(4, range(3, 6), reason="shutdown"))
            h.inbox.close()
            released = [r.upto_sequence async for r in h.releases]
            written = [w.info async for w in h.out]
    assert floors + [h.floor()] == [3, 4]
    assert released == [5]  # the first one was taken above
    assert [(i.segment_seq, i.first_sequence, i.last_sequence) for i in written] == [
        (3, 1, 2), (4, 3, 5)]
    assert h.files() == ["0000000000000003.qseg", "0000000000000004.qseg", "FLOOR"]
    assert [e[1]["reason"] for e in h.log.events] == ["size", "shutdown"]
    assert h.outcome == ["returned"]


@pytest.mark.asyncio
async def test_finalizer_releases_nothing_when_directory_fsync_fails(make):
    h = make()

    def hook(step: str) -> None:
        if step == "dir_fsynced":
            raise OSError(errno.EIO, "injected: directory fsync failed")

    with pytest.raises(ExceptionGroup) as failed:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(functools.partial(h.run, hook=hook))
                await h.inbox.send(sealed(2, range(1, 3)))
    lost = failed.value.subgroup(DurabilityLost)  # renamed, durability unknown: fatal
    assert lost is not None and isinstance(lost.exceptions[0].__cause__, OSError)
    with pytest.raises(anyio.EndOfStream):
        h.releases.receive_nowait()
    with pytest.raises(anyio.EndOfStream):
        h.out.receive_nowait()
    assert (h.floor(), h.stats.finalized.value, h.log.events) == (0, 0, [])
    assert h.outcome == []


@pytest.mark.asyncio
async def test_finalizer_cancel_with_full_outbox_ends_promptly(make):
    h = make(outbox_size=1)  # nobody reads it
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(h.run)
            await h.inbox.send(sealed(1, range(1, 3)))
            await h.inbox.send(sealed(2, range(3, 5)))
            released = [await h.releases.receive() for _ in range(2)]  # then blocks on out
            started = anyio.current_time()
            tg.cancel_scope.cancel()
    assert anyio.current_time() - started < 1.0
    assert h.outcome == ["cancelled"]
    assert [r.upto_sequence for r in released] == [2, 4]
    assert h.out.receive_nowait().info.segment_seq == 1
    for closed in (h.out, h.releases):
        with pytest.raises(anyio.EndOfStream):
            closed.receive_nowait()
    assert (h.floor(), h.files()) == (
        2, ["0000000000000001.qseg", "0000000000000002.qseg", "FLOOR"])


# ---- failed segment writes (issue 8 item 6) ------------------------------------------


def failing(step: str, code: int, times: int, calls: list[str] | None = None
            ) -> Callable[[str], None]:
    """A hook failing ``step`` its first ``times`` times (and recording every step)."""
    seen = {"n": 0}

    def hook(at: str) -> None:
        if calls is not None:
            calls.append(at)
        if at == step:
            seen["n"] += 1
            if seen["n"] <= times:
                raise OSError(code, f"injected at {at}")
    return hook


@pytest.mark.asyncio
@pytest.mark.parametrize("step,code", [("tmp_written", errno.ENOSPC),
                                       ("tmp_written", errno.EIO),
                                       ("tmp_fsynced", errno.EIO),
                                       ("renamed", errno.EIO)])
async def test_finalizer_retries_segment_write_failed_before_rename(make, step, code):
    h = make()
    calls: list[str] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, hook=failing(step, code, 2, calls)))
            await h.inbox.send(sealed(4, range(1, 4)))
            released = await h.releases.receive()
            written = await h.out.receive()
            h.inbox.close()
    assert released == WalReleased(upto_sequence=3)
    assert written.info.segment_seq == 4 and h.floor() == 4
    assert h.files() == ["0000000000000004.qseg", "FLOOR"]  # no temp file left behind
    with SegmentReader.open(h.shard.segment(4)) as reader:
        assert [b.sequence for b in reader.bundles()] == [1, 2, 3]
    assert calls.count("tmp_written") == 3  # written three times, encoded once
    events = [e for e, _ in h.log.events]
    assert events == ["segment_write_failed", "segment_write_failed",
                      "segment_write_recovered", "segment_finalized"]
    failed = h.log.events[0][1]
    assert failed["errno"] == errno.errorcode[code] and failed["segment_seq"] == 4
    assert (h.stats.write_failures.value, h.stats.no_space.value) == (
        2, 2 if code == errno.ENOSPC else 0)


@pytest.mark.asyncio
async def test_finalizer_holds_release_while_segment_write_fails(make):
    h = make()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, hook=failing("tmp_written", errno.ENOSPC,
                                                                 1_000_000)))
            await h.inbox.send(sealed(1, range(1, 3)))
            await anyio.sleep(0.5)
            with pytest.raises(anyio.WouldBlock):
                h.releases.receive_nowait()  # nothing durable: the WAL keeps everything
            assert h.files() == [] and h.stats.write_failures.value >= 3
            tg.cancel_scope.cancel()
    assert h.outcome == ["cancelled"]


@pytest.mark.asyncio
async def test_finalizer_retries_floor_without_writing_the_segment_again(make):
    h = make()
    calls: list[str] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(
                h.run, hook=failing("floor_tmp_written", errno.ENOSPC, 1, calls)))
            await h.inbox.send(sealed(7, range(1, 3)))
            released = await h.releases.receive()
            h.inbox.close()
    assert released == WalReleased(upto_sequence=2) and h.floor() == 7
    assert calls.count("tmp_written") == 1 and calls.count("floor_tmp_written") == 2
    assert h.files() == ["0000000000000007.qseg", "FLOOR"]


@pytest.mark.asyncio
@pytest.mark.parametrize("step", ["dir_fsynced", "floor_dir_fsynced"])
async def test_finalizer_stops_when_fsync_after_rename_fails(make, step):
    h = make()
    with pytest.raises(ExceptionGroup) as failed:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(functools.partial(h.run, hook=failing(step, errno.EIO, 1)))
                await h.inbox.send(sealed(2, range(1, 3)))
    assert failed.value.subgroup(DurabilityLost) is not None
    assert h.stats.write_failures.value == 0  # never retried
    with pytest.raises(anyio.EndOfStream):
        h.releases.receive_nowait()


@pytest.mark.asyncio
async def test_finalizer_retries_after_real_enospc_and_finalizes_when_space_returns(tmp_path):
    from tests.daemon.mounts import fill, mounted_tmpfs

    with mounted_tmpfs(tmp_path / "fs", 1 << 20) as fs:
        h = Harness(fs, outbox_size=4, releases_size=4)
        try:
            st = os.statvfs(fs)
            ballast = fs / "ballast"
            fill(ballast, st.f_bavail * st.f_frsize - 8192)
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    await tg.start(h.run)
                    await h.inbox.send(sealed(3, range(1, 40)))  # ~30 KiB: does not fit
                    for _ in range(500):  # the counter has nothing to await
                        if h.stats.no_space.value >= 2:
                            break
                        await anyio.sleep(0.01)
                    assert not list(h.shard.segments_dir.glob("*.tmp"))  # removed each time
                    ballast.unlink()
                    released = await h.releases.receive()
                    h.inbox.close()
        finally:
            h.close()
    assert released == WalReleased(upto_sequence=39)
    assert ("segment_write_failed" in [e for e, _ in h.log.events])
    assert "No space left" in dict(h.log.events)["segment_write_failed"]["error"]
