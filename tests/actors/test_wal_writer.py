"""wal_writer actor on a real WAL: replies, DurableBatches, capacity, end of stream, cancel.

Each test drives ``actors.wal_writer.run`` in a task group with memory streams and a
WalFiles opened the way recovery opens it. A probe wrapped around the WalFiles records
the last sequence written and the last one a *returned* fdatasync covered, and can hold
every fdatasync, so each Ack is checked against the sync that must precede it.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, MetaCodec, make_slot
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import WalConfig
from quiverd.kernel.layout import DataDir, ShardLayout
from quiverd.kernel.metrics import Metrics, WalMetrics
from quiverd.protocol.frames import Ack, Error, ErrorCode
from quiverd.wal import format as walformat
from quiverd.wal.files import EntryToWrite, WalFiles, WalNoSpace
from quiverd.wal.replay import ReplayedEntry, WalState, replay_wal
from quiverd_actors import wal_writer
from quiverd_actors.messages import AppendRequest, DurableBatch, ProducerReply, WalReleased
from quiverd_actors.retention_gate import RetentionGate

HASH = walformat.DEFAULT_CFG_HASH
MAX_ENTRY = 1 << 20
SLOW_MS = 10_000  # a flush timer that never fires within a test
SHARD = 3


class Log:
    def __getattr__(self, level: str) -> Callable[..., None]:  # info/warning/error
        return lambda *a, **k: None


class RecLog:
    """Records (event, fields) of every level."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda event, **kw: self.events.append((event, kw))

    def names(self) -> list[str]:
        return [e for e, _ in self.events]


def bundle(tag: int) -> Bundle:
    """~10 KiB of payload: above a block, so a release always frees space."""
    table = pa.table({"tag": pa.array([tag] * 200, pa.int64()), "s": [f"{tag:040d}"] * 200})
    return Bundle(client="app", slots=(make_slot(0, table),))


ENTRY_BYTES = walformat.entry_size((*bundle(0).slots, MetaCodec().encode("app", None)))
FULL_AFTER_ONE = walformat.HEADER_LEN + ENTRY_BYTES + ENTRY_BYTES // 2


def replay(shard: ShardLayout) -> WalState:
    return replay_wal(shard.wal_dir, shard.quarantine_dir, cfg_hash=HASH,
                      max_entry_bytes=MAX_ENTRY, log=Log())


class SyncProbe:
    """Wraps one WalFiles: last sequence written, last one a *returned* fdatasync covered.

    Clearing ``writes`` or ``allow`` holds every write or fdatasync in its worker thread.
    """

    def __init__(self, wal: WalFiles) -> None:
        self.appending = self.written = self.durable = self.released = self.syncs = 0
        self.writes, self.allow, self.changes = threading.Event(), threading.Event(), Changes()
        self.writes.set()
        self.allow.set()
        self._append, self._sync, self._release = wal.append, wal.sync, wal.release
        wal.append, wal.sync, wal.release = (  # type: ignore[method-assign]
            self.append, self.sync, self.release)

    def append(self, entries: list[EntryToWrite], *, sync: bool) -> None:
        self.appending = entries[-1][0]
        self._notify()
        assert self.writes.wait(5), "the held write was never let go"
        try:
            self._append(entries, sync=False)
        except WalNoSpace as full:  # the first `written` entries made it
            if full.written:
                self.written = entries[full.written - 1][0]
            raise
        self.written = entries[-1][0]
        self._notify()
        if sync:
            self.sync()

    def sync(self) -> None:
        covered = self.written
        assert self.allow.wait(5), "the held fdatasync was never let go"
        self._sync()
        self.syncs += 1
        self.durable = max(self.durable, covered)

    def release(self, upto_sequence: int) -> bool:
        freed = self._release(upto_sequence)
        self.released = upto_sequence
        self._notify()
        return freed

    def _notify(self) -> None:
        anyio.from_thread.run_sync(self.changes.notify)

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self.changes.wait_beyond(self.changes.version)


class Harness:
    """One shard's WAL with the writer's streams and one producer connection."""

    def __init__(self, tmp_path: Path, *, max_size: int, outbox_size: int) -> None:
        self.layout = DataDir(tmp_path).shard(0)
        self.wal = WalFiles.open(self.layout.wal_dir, replay(self.layout), cfg_hash=HASH,
                                 max_size_bytes=max_size, max_chunks=2, log=Log())
        self.probe = SyncProbe(self.wal)
        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[AppendRequest](16)
        self._out_tx, self.out = anyio.create_memory_object_stream[DurableBatch](outbox_size)
        self.releases, self._releases_rx = anyio.create_memory_object_stream[WalReleased](4)
        self._reply_tx, self.replies = anyio.create_memory_object_stream[ProducerReply](64)
        self.stats = WalMetrics(Metrics(), 3)
        self.outcome: list[str] = []
        self.durable: list[Bundle] = []  # from the DurableBatches, once the outbox ended
        self.log: Any = Log()

    async def run(self, cfg: WalConfig, *, next_sequence: int = 1, task_status: Any,
                  **deps: Any) -> None:
        try:
            await wal_writer.run(
                self._inbox_rx, self._out_tx, self._releases_rx, shard=SHARD, wal=self.wal,
                cfg=cfg, next_sequence=next_sequence, limiter=anyio.CapacityLimiter(2),
                stats=self.stats, log=self.log, task_status=task_status, **deps)
        except anyio.get_cancelled_exc_class():
            self.outcome.append("cancelled")
            raise
        self.outcome.append("returned")

    async def append(self, request_id: int, tag: int = 0) -> None:
        await self.inbox.send(AppendRequest(request_id=request_id, bundle=bundle(tag),
                                            reply=self._reply_tx))

    async def ack(self) -> Ack:
        reply = await self.replies.receive()
        assert isinstance(reply, Ack), reply
        assert reply.sequence <= self.probe.durable, "acked before its fdatasync returned"
        return reply

    def close(self) -> None:
        self.probe.writes.set()
        self.probe.allow.set()
        for s in (self.inbox, self._inbox_rx, self._out_tx, self.out, self.releases,
                  self._releases_rx, self._reply_tx, self.replies):
            s.close()
        self.wal.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(*, max_size: int = 1 << 30, outbox_size: int = 16,
                root: Path | None = None) -> Harness:
        made.append(Harness(root or tmp_path, max_size=max_size, outbox_size=outbox_size))
        return made[-1]

    yield factory
    for h in made:
        h.close()


def interval(**kw: Any) -> WalConfig:
    return WalConfig(flush_policy="interval", flush_interval_ms=SLOW_MS, flush_bytes=0, **kw)


@asynccontextmanager
async def running(h: Harness, cfg: WalConfig, **deps: Any) -> AsyncIterator[None]:
    """The writer in a task group; on a clean exit, end its inbox and then its releases."""
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, cfg, **deps))
            yield
            h.inbox.close()
            h.durable = [b async for batch in h.out for b in batch.bundles]
            h.releases.close()


async def no_reply_within(h: Harness, seconds: float) -> None:
    with anyio.move_on_after(seconds):
        pytest.fail(f"unexpected reply {await h.replies.receive()}")


def sequences(items: Sequence[Bundle | ReplayedEntry]) -> list[int]:
    return [b.sequence for b in items]


@pytest.mark.asyncio
async def test_wal_writer_acks_consecutive_sequences_with_request_id_and_shard(make):
    h = make()
    async with running(h, interval(), next_sequence=41):
        for i in range(5):
            await h.append(100 + i, tag=i)
        acks = [await h.ack() for _ in range(5)]
    assert [(a.request_id, a.shard, a.sequence) for a in acks] == [
        (100 + i, SHARD, 41 + i) for i in range(5)]
    assert sequences(h.durable) == [41, 42, 43, 44, 45]
    assert [(b.client, bytes(b.slots[0].ipc)) for b in h.durable] == [
        ("app", bytes(bundle(i).slots[0].ipc)) for i in range(5)]
    stamps = [b.ingestion_ts_ns for b in h.durable]
    assert stamps[0] > 0 and stamps == sorted(stamps)
    assert (h.outcome, h.stats.acks.value, h.stats.last_sequence.value) == (["returned"], 5, 45)
    assert sequences(replay(h.layout).entries) == [41, 42, 43, 44, 45]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["always", "interval"])
async def test_wal_writer_withholds_ack_while_fdatasync_blocked(make, policy):
    h = make()
    async with running(h, WalConfig(flush_policy=policy, flush_interval_ms=SLOW_MS)):
        h.probe.allow.clear()
        await h.append(7)
        await h.probe.until(lambda: h.probe.written == 1)
        await no_reply_within(h, 0.2)
        with pytest.raises(anyio.WouldBlock):
            h.out.receive_nowait()
        h.probe.allow.set()
        ack = await h.ack()
    assert (ack.request_id, ack.sequence, h.probe.syncs, h.stats.fsyncs.value) == (7, 1, 1, 1)
    assert sequences(h.durable) == [1]


@pytest.mark.asyncio
async def test_wal_writer_acks_without_fdatasync_under_never_policy(make):
    h = make()
    async with running(h, WalConfig(flush_policy="never")):
        h.probe.allow.clear()  # would hold any fdatasync: "never" must not need one
        for i in range(3):
            await h.append(i)
        replies = [await h.replies.receive() for _ in range(3)]
    assert replies == [Ack(request_id=i, shard=SHARD, sequence=i + 1) for i in range(3)]
    assert sequences(h.durable) == [1, 2, 3]
    assert (h.probe.syncs, h.stats.fsyncs.value) == (0, 0)


@pytest.mark.asyncio
async def test_wal_writer_rejects_at_capacity_when_wal_full(make):
    h = make(max_size=FULL_AFTER_ONE)
    async with running(h, interval(at_capacity="reject")):
        await h.append(1)
        first = await h.ack()
        refused = []
        for rid in (2, 3):
            await h.append(rid)
            refused.append(await h.replies.receive())
    assert first == Ack(request_id=1, shard=SHARD, sequence=1)
    assert [(r.request_id, r.code) for r in refused if isinstance(r, Error)] == [
        (2, ErrorCode.AT_CAPACITY), (3, ErrorCode.AT_CAPACITY)]
    assert all("WAL is at capacity" in r.message for r in refused if isinstance(r, Error))
    assert sequences(h.durable) == [1]
    assert (h.stats.rejected.value, h.stats.acks.value, h.probe.written) == (2, 1, 1)
    assert sequences(replay(h.layout).entries) == [1]


@pytest.mark.asyncio
async def test_wal_writer_rejects_at_capacity_when_one_batch_overfills_empty_wal(make):
    h = make(max_size=FULL_AFTER_ONE)
    for rid in (1, 2, 3):  # queued before the writer starts: drained as one batch
        await h.append(rid)
    async with running(h, WalConfig(flush_policy="always", at_capacity="reject")):
        replies = [await h.replies.receive() for _ in range(3)]
    assert sorted((r.request_id, type(r).__name__) for r in replies) == [
        (1, "Ack"), (2, "Error"), (3, "Error")]
    assert h.wal.file_count <= h.wal.max_chunks
    assert h.wal.live_bytes <= h.wal.max_size_bytes


@pytest.mark.asyncio
async def test_wal_writer_syncs_when_inbox_runs_empty_after_rejected_batch(make):
    h = make(max_size=FULL_AFTER_ONE)
    async with running(h, interval(at_capacity="reject")):
        h.probe.writes.clear()
        await h.append(1)
        await h.probe.until(lambda: h.probe.appending == 1)
        await h.append(2)  # queued while 1 is written: rejected in the next batch
        h.probe.writes.set()
        refused = await h.replies.receive()
        acked = None
        with anyio.move_on_after(0.5):  # flush_interval_ms is 10 s
            acked = await h.ack()
    assert isinstance(refused, Error) and refused.request_id == 2
    assert acked == Ack(request_id=1, shard=SHARD, sequence=1)


@pytest.mark.asyncio
async def test_wal_writer_rejects_at_capacity_when_retention_gate_over_cap(make):
    h, usage = make(), [1000]
    gate, over_cap = RetentionGate(cap_bytes=100, usage=lambda: usage[0]), Changes()
    async with running(h, interval(at_capacity="reject"), gate=gate, over_cap=over_cap,
                       next_sequence=9):
        await h.append(1)
        refused = await h.replies.receive()
        with pytest.raises(anyio.WouldBlock):
            h.out.receive_nowait()
        usage[0] = 10
        gate.refresh()
        await h.append(2)
        ack = await h.ack()
    assert isinstance(refused, Error) and refused.request_id == 1
    assert refused.code == ErrorCode.AT_CAPACITY and "retention size cap" in refused.message
    assert (h.stats.throttled.value, over_cap.version, h.stats.rejected.value) == (1, 1, 1)
    assert ack == Ack(request_id=2, shard=SHARD, sequence=9)  # the refusal used no sequence
    assert sequences(h.durable) == [9]


@pytest.mark.asyncio
async def test_wal_writer_waits_for_release_when_wal_full(make):
    h = make(max_size=FULL_AFTER_ONE)
    async with running(h, interval(at_capacity="wait")):
        await h.append(1)
        first = await h.ack()
        await h.append(2)
        await no_reply_within(h, 0.2)
        assert (h.stats.capacity_waits.value, h.probe.written) == (1, 1)
        await h.releases.send(WalReleased(upto_sequence=1))
        with anyio.fail_after(0.5):  # woken by the release, not by the writer's 1 s recheck
            second = await h.ack()
    assert (first.sequence, second.request_id, second.sequence) == (1, 2, 2)
    assert sequences(h.durable) == [1, 2]
    assert (h.probe.released, h.stats.rejected.value) == (1, 0)
    assert sequences(replay(h.layout).entries) == [2]  # the sidecar moved past the released entry


@pytest.mark.asyncio
async def test_wal_writer_syncs_acks_and_closes_outbox_at_end_of_stream(make):
    h = make()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, interval()))
            h.probe.allow.clear()
            for i in range(3):
                await h.append(i)
            h.inbox.close()
            await h.probe.until(lambda: h.probe.written == 3)
            h.probe.allow.set()
            acks = [await h.ack() for _ in range(3)]
            durable = [b async for batch in h.out for b in batch.bundles]  # outbox ended
            assert h.outcome == []  # still serving releases until the finalizer is done
            await h.releases.send(WalReleased(upto_sequence=3))
            await h.probe.until(lambda: h.probe.released == 3)
            h.releases.close()
    assert [a.sequence for a in acks] == sequences(durable) == [1, 2, 3]
    assert (h.outcome, h.probe.durable) == (["returned"], 3)


@pytest.mark.asyncio
async def test_wal_writer_cancel_with_full_outbox_acks_nothing_unsynced(make):
    h = make(outbox_size=1)  # nobody reads it
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(h.run, interval()))
            await h.append(1)
            await h.ack()  # its DurableBatch fills the outbox
            await h.append(2)
            await h.ack()  # its DurableBatch waits for room, holding up every later sync
            await h.append(3)
            await h.probe.until(lambda: h.probe.written == 3)
            await no_reply_within(h, 0.2)
            started = anyio.current_time()
            tg.cancel_scope.cancel()
    assert anyio.current_time() - started < 1.0
    assert h.outcome == ["cancelled"]
    assert (h.probe.written, h.probe.durable, h.stats.acks.value) == (3, 2, 2)
    with pytest.raises(anyio.WouldBlock):
        h.replies.receive_nowait()
    assert sequences(h.out.receive_nowait().bundles) == [1]
    with pytest.raises(anyio.EndOfStream):
        h.out.receive_nowait()


# ---- disk full (issue 8 item 5): a real tmpfs where one can be mounted ----------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (request it before ``make`` so the WAL is closed before unmounting)."""
    from tests.daemon.mounts import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "fs", 1 << 20) as where:
        yield where


def leave_free(fs: Path, nbytes: int) -> Path:
    """A ballast file taking all of ``fs`` but about ``nbytes``."""
    from tests.daemon.mounts import fill

    st = os.statvfs(fs)
    ballast = fs / "ballast"
    fill(ballast, st.f_bavail * st.f_frsize - nbytes)
    return ballast


async def until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Tests only: the writer's counters are read, they have nothing to await."""
    for _ in range(int(timeout_s / 0.01)):
        if done():
            return
        await anyio.sleep(0.01)
    pytest.fail("timed out")


def drain_replies(h: Harness) -> list[ProducerReply]:
    out: list[ProducerReply] = []
    while True:
        try:
            out.append(h.replies.receive_nowait())
        except anyio.WouldBlock:
            return out


@pytest.mark.asyncio
async def test_wal_writer_holds_bundles_while_disk_full_and_resumes_without_gaps(small_fs, make):
    h = make(root=small_fs)
    h.log = RecLog()
    ballast = leave_free(small_fs, 6 * ENTRY_BYTES)
    async with running(h, WalConfig(flush_policy="interval", flush_interval_ms=5)):
        async with anyio.create_task_group() as tg:
            async def produce() -> None:
                for rid in range(1, 25):
                    await h.append(rid, tag=rid)
            tg.start_soon(produce)
            await until(lambda: h.stats.disk_full.value == 1)
            await anyio.sleep(0.3)  # held, retried with backoff: no ack, no error
            before = drain_replies(h)
            assert all(isinstance(r, Ack) for r in before)
            assert 0 < len(before) < 24
            assert h.stats.no_space.value >= 2  # retried, still full
            ballast.unlink()
            after = [await h.ack() for _ in range(24 - len(before))]
    acks = [r for r in before if isinstance(r, Ack)] + after
    assert [(a.request_id, a.sequence) for a in acks] == [(i, i) for i in range(1, 25)]
    assert sequences(h.durable) == list(range(1, 25))
    assert h.stats.disk_full.value == 0
    names = h.log.names()
    assert names.count("wal_disk_full") == 1 and names.count("wal_disk_space_back") == 1
    full = dict(h.log.events)["wal_disk_full"]
    assert full["reason"] == "enospc" and full["hint"]
    state = replay(h.layout)
    assert sequences(state.entries) == list(range(1, 25))
    assert (state.torn_tail_bytes, state.corrupt_entries) == (0, 0)


@pytest.mark.asyncio
async def test_wal_writer_rejects_at_capacity_while_disk_full_without_burning_sequences(
        small_fs, make):
    h = make(root=small_fs)
    ballast = leave_free(small_fs, 4 * ENTRY_BYTES)
    async with running(h, WalConfig(flush_policy="always", at_capacity="reject")):
        replies = []
        for rid in range(1, 11):
            await h.append(rid)
            replies.append(await h.replies.receive())
        ballast.unlink()
        for rid in range(11, 14):
            await h.append(rid)
            replies.append(await h.replies.receive())
    acked = [r for r in replies if isinstance(r, Ack)]
    refused = [r for r in replies if isinstance(r, Error)]
    assert refused and all(r.code == ErrorCode.AT_CAPACITY and "disk is full" in r.message
                           for r in refused)
    assert [r.request_id for r in refused] == list(range(len(acked) - 2, 11))
    # Refused bundles used no sequence: the acked ones are 1..n without a gap.
    assert [a.sequence for a in acked] == list(range(1, len(acked) + 1))
    assert [a.request_id for a in acked][-3:] == [11, 12, 13]
    assert h.stats.rejected.value == len(refused)
    state = replay(h.layout)
    assert sequences(state.entries) == [a.sequence for a in acked]
    assert (state.torn_tail_bytes, state.corrupt_entries) == (0, 0)


@pytest.mark.asyncio
async def test_wal_writer_acks_the_part_of_a_batch_written_before_the_disk_filled(make):
    """Space ends after a rotation: the entries before it are acked, the rest held."""
    h = make(max_size=2 * (walformat.HEADER_LEN + 5 * ENTRY_BYTES // 2))
    writes = {"n": 0}

    def hook(step: str) -> None:
        if step == "write":
            writes["n"] += 1
            if writes["n"] == 2:  # the second file's part of the first batch
                raise OSError(errno.ENOSPC, "injected: no space")
    h.wal.fault_hook = hook
    for rid in range(1, 5):  # queued before the writer starts: drained as one batch
        await h.append(rid)
    async with running(h, WalConfig(flush_policy="always")):
        acks = [await h.ack() for _ in range(4)]
    assert [(a.request_id, a.sequence) for a in acks] == [(i, i) for i in range(1, 5)]
    assert (h.stats.no_space.value, writes["n"]) == (1, 3)
    assert h.wal.file_count == 2
    assert sequences(replay(h.layout).entries) == [1, 2, 3, 4]
