"""The WAL writer's two threads: writes go on while an fdatasync is held, acks wait for theirs.

Drives ``wal_writer.run`` (and through it ``wal_threads.WalPipeline``) on a real WAL.
A probe wrapped around the WalFiles logs every write and every fdatasync start and
return, in order, and holds each fdatasync until the test lets that one go, so the
test can tell which sync an ack came after.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import WalConfig
from quiverd.kernel.layout import DataDir
from quiverd.kernel.metrics import Metrics, WalMetrics
from quiverd.protocol.frames import Ack
from quiverd.wal import format as walformat
from quiverd.wal.files import EntryToWrite, WalFiles
from quiverd.wal.replay import replay_wal
from quiverd_actors import wal_writer
from quiverd_actors.messages import AppendRequest, DurableBatch, ProducerReply, WalReleased

HASH = walformat.DEFAULT_CFG_HASH
SLOW_MS = 10_000  # a flush timer that never fires within a test
SHARD = 1


class Log:
    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda *a, **k: None


class HeldSyncs:
    """Wraps one WalFiles. ``log`` holds ("write", last sequence), ("sync", covered) at
    each fdatasync's start and ("synced", covered) at its return; fdatasync number n
    (from 1) returns only once ``let_go(n)`` was called."""

    def __init__(self, wal: WalFiles) -> None:
        self.log: list[tuple[str, int]] = []
        self.written = 0
        self.allowed = 0
        self.cv = threading.Condition()
        self.changes = Changes()
        self._append, self._sync = wal.append, wal.sync
        wal.append, wal.sync = self.append, self.sync  # type: ignore[method-assign]

    def append(self, entries: list[EntryToWrite], *, sync: bool) -> None:
        self._append(entries, sync=False)
        self.written = entries[-1][0]
        self._record("write", self.written)
        if sync:
            self.sync()

    def sync(self) -> None:
        covered = self.written  # what this fdatasync is sure to cover
        with self.cv:
            number = sum(1 for kind, _ in self.log if kind == "sync") + 1
        self._record("sync", covered)
        with self.cv:
            assert self.cv.wait_for(lambda: self.allowed >= number, 5), "sync never let go"
        self._sync()
        self._record("synced", covered)

    def let_go(self, number: int) -> None:
        with self.cv:
            self.allowed = number
            self.cv.notify_all()

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.log if k == kind)

    def _record(self, kind: str, sequence: int) -> None:
        with self.cv:
            self.log.append((kind, sequence))
        anyio.from_thread.run_sync(self.changes.notify)

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self.changes.wait_beyond(self.changes.version)


def bundle(tag: int) -> Bundle:
    table = pa.table({"tag": pa.array([tag] * 100, pa.int64())})
    return Bundle(client="app", slots=(make_slot(0, table),))


class Shard:
    """One shard's WAL writer with its streams and one producer's replies."""

    def __init__(self, root: Path) -> None:
        layout = DataDir(root).shard(0)
        state = replay_wal(layout.wal_dir, layout.quarantine_dir, cfg_hash=HASH,
                           max_entry_bytes=1 << 20, log=Log())
        self.wal = WalFiles.open(layout.wal_dir, state, cfg_hash=HASH, max_size_bytes=1 << 30,
                                 max_chunks=2, log=Log())
        self.probe = HeldSyncs(self.wal)
        self.inbox, self.inbox_rx = anyio.create_memory_object_stream[AppendRequest](16)
        self.out_tx, self.out = anyio.create_memory_object_stream[DurableBatch](16)
        self.releases, self.releases_rx = anyio.create_memory_object_stream[WalReleased](4)
        self.reply_tx, self.replies = anyio.create_memory_object_stream[ProducerReply](16)
        self.acked: list[tuple[int, int]] = []  # (request_id, sequence), as received

    async def run(self, cfg: WalConfig, *, task_status: Any) -> None:
        await wal_writer.run(self.inbox_rx, self.out_tx, self.releases_rx, shard=SHARD,
                             wal=self.wal, cfg=cfg, next_sequence=1,
                             limiter=anyio.CapacityLimiter(2), stats=WalMetrics(Metrics(), 2),
                             log=Log(), task_status=task_status)

    async def append(self, request_id: int) -> None:
        await self.inbox.send(AppendRequest(request_id=request_id, bundle=bundle(request_id),
                                            reply=self.reply_tx))

    async def ack(self) -> Ack:
        reply = await self.replies.receive()
        assert isinstance(reply, Ack), reply
        self.probe.log.append(("ack", reply.sequence))
        return reply

    async def sync_began(self, number: int) -> None:
        """Wait until fdatasync ``number`` began; fail if a reply comes first."""
        early: list[ProducerReply] = []
        async with anyio.create_task_group() as tg:
            async def reply() -> None:
                early.append(await self.replies.receive())
                tg.cancel_scope.cancel()

            async def began() -> None:
                await self.probe.until(lambda: self.probe.count("sync") >= number)
                tg.cancel_scope.cancel()
            tg.start_soon(reply)
            tg.start_soon(began)
        assert not early, f"{early[0]} came before fdatasync {number} began"

    async def no_reply_within(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            pytest.fail(f"unexpected reply {await self.replies.receive()}")

    def close(self) -> None:
        self.probe.let_go(1 << 30)
        for s in (self.inbox, self.inbox_rx, self.out_tx, self.out, self.releases,
                  self.releases_rx, self.reply_tx, self.replies):
            s.close()
        self.wal.close()


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[Shard]:
    s = Shard(tmp_path)
    yield s
    s.close()


@asynccontextmanager
async def running(s: Shard, cfg: WalConfig) -> AsyncIterator[None]:
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(s.run, cfg))
            yield
            s.inbox.close()
            assert [b.sequence async for batch in s.out for b in batch.bundles] == [1, 2]
            s.releases.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["interval", "always"])
async def test_wal_threads_write_next_batch_while_fdatasync_held_and_ack_it_after_its_own(
        shard, policy):
    probe = shard.probe
    async with running(shard, WalConfig(flush_policy=policy, flush_interval_ms=SLOW_MS)):
        await shard.append(1)
        await shard.sync_began(1)  # batch 1's fdatasync, held
        await shard.append(2)
        # The writer thread does not wait for the held sync to write batch 2.
        await probe.until(lambda: probe.written == 2)
        assert probe.log == [("write", 1), ("sync", 1), ("write", 2)]
        await shard.no_reply_within(0.1)

        probe.let_go(1)
        first = await shard.ack()
        await shard.sync_began(2)  # batch 2's own: sync 1's return acked only batch 1
        await shard.no_reply_within(0.1)  # held: batch 2 is not acked on sync 1's return
        probe.let_go(2)
        second = await shard.ack()
    assert (first.request_id, first.shard, first.sequence) == (1, SHARD, 1)
    assert (second.request_id, second.shard, second.sequence) == (2, SHARD, 2)
    # Sync 1 covered only batch 1; batch 2's ack came after a sync that began after
    # batch 2 was written, and returned.
    events = [e for e in probe.log if e[0] != "ack"]
    assert events == [("write", 1), ("sync", 1), ("write", 2), ("synced", 1), ("sync", 2),
                      ("synced", 2)]
    assert probe.log.index(("ack", 1)) > probe.log.index(("synced", 1))
    assert probe.log.index(("ack", 2)) > probe.log.index(("synced", 2))
