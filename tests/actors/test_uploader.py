"""The uploader actor in process: real deliveries, real Parquet files, the fs store and
the SQLite catalog; a recording stand-in for the dispatchers' ack path.

No outcome here depends on the clock. Files rotate on size (``ROTATE_EACH``: every
bundle's first row group fills the file) or, where bundles must share a file, on window
pressure right after the last one was added; never on ``file_duration_ms`` racing the
test (a catalog write slowed by load let the timer rotate a file before its second
bundle came, or before its first).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.acks import format as ackfmt
from quiverd.kernel.metrics import Metrics
from quiverd.lake.health import LakeHealth
from quiverd.lake.model import REGISTERED, Coverage, FileRow, FileState
from quiverd.lake.tier import Tier
from quiverd_actors.dispatcher import Session
from quiverd_actors.messages import LocalDelivery
from quiverd_actors.uploader import Uploader
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import LOG, open_test_tier


class Acks:
    """Stands in for the dispatchers: records (segment_seq, bundle_index, outcome)."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[int, int, int]] = []
        self.changed = anyio.Event()

    async def feedback(self, session: Session, segment_seq: int, bundle_index: int,
                       outcome: int) -> None:
        self.outcomes.append((segment_seq, bundle_index, outcome))
        self.changed.set()
        self.changed = anyio.Event()

    async def until(self, done: Callable[[list[tuple[int, int, int]]], bool]) -> None:
        with anyio.fail_after(20):
            while not done(self.outcomes):
                await self.changed.wait()


def delivery(seg: int, idx: int, slots: dict[int, pa.Table], client: str = "app"
             ) -> LocalDelivery:
    return LocalDelivery(shard=0, segment_seq=seg, bundle_index=idx, client=client, txn=None,
                         ingestion_ts_ns=1_700_000_000_000_000_000 + idx, tables=slots)


# A file is written and rotated as soon as it holds a bundle (size), and never on time.
ROTATE_EACH = {"row_group_bytes": 1, "file_size_bytes": 1, "file_duration_ms": 3_600_000}
# A file rotates once two bundles are held (window pressure), and never on time.
ROTATE_AT_TWO = {"window_bundles": 4, "file_duration_ms": 3_600_000}


def rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"v": pa.array(range(start, start + n), pa.int64())})


@asynccontextmanager
async def running(tier: Tier) -> AsyncIterator[tuple[Acks, Uploader, Any]]:
    acks = Acks()
    tx, rx = anyio.create_memory_object_stream[LocalDelivery](256)
    unused_tx, unused_rx = anyio.create_memory_object_stream[LocalDelivery](1)
    session = Session(name="uploader", window=256, deliveries=unused_tx, local=True)
    uploader = Uploader(tier, [acks], session,  # type: ignore[list-item]
                        limiter=anyio.CapacityLimiter(2), log=LOG, metrics=Metrics(),
                        health=LakeHealth(log=LOG))
    # Closed however the test ends: a stream left open by a failing test raised its
    # ResourceWarning (an error here) in whichever later test the collector ran.
    with tx, rx, unused_tx, unused_rx:
        async with anyio.create_task_group() as tg:
            await tg.start(uploader.run, rx)
            try:
                yield acks, uploader, tx
            finally:
                tg.cancel_scope.cancel()


async def registered(tier: Tier) -> list[FileRow]:
    return await tier.catalog.list_files(states=REGISTERED)


@pytest.mark.asyncio
async def test_uploader_acks_two_slot_bundle_once_both_files_registered(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, **ROTATE_EACH) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: rows(5), 1: pa.table({"note": ["x"]})}))
        await tx.send(delivery(1, 1, {0: rows(5, 5)}))
        await acks.until(lambda o: len(o) == 2)
        files = await registered(tier)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.ACK), (1, 1, ackfmt.ACK)]
        # Slot 0's rows are in one file or two (the second bundle may come before the
        # first file's row group is written): either way each bundle once, in order.
        slot0 = sorted((f for f in files if f.slot == 0), key=lambda f: f.first_bundle)
        assert [(f.slot, f.row_count) for f in files if f.slot == 1] == [(1, 1)]
        assert sum(f.bundle_count for f in slot0) == 2
        back = pa.concat_tables(pq.read_table(uri_path(f.uri)) for f in slot0)
        assert back["v"].to_pylist() == list(range(10))
        assert back["_quiver_bundle"].to_pylist() == [0] * 5 + [1] * 5
        assert (slot0[0].first_segment, slot0[0].first_bundle, slot0[-1].last_bundle) == (1, 0, 1)


@pytest.mark.asyncio
async def test_uploader_skips_slots_a_registered_file_holds(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, **ROTATE_EACH) as tier:
        held = FileRow(file_id="01HOLD0000000000000000000A", client_name="app",
                       source_id=tier.source_id, shard=0, slot=0, node_id=tier.node_id)
        await tier.catalog.register(held, [Coverage(segment_seq=5, bundle_indexes=(0,))])
        async with running(tier) as (acks, uploader, tx):
            await tx.send(delivery(5, 0, {0: rows(3), 1: pa.table({"note": ["y"]})}))
            await acks.until(lambda o: len(o) == 1)
            assert acks.outcomes == [(5, 0, ackfmt.ACK)]
            files = await registered(tier)
            assert sorted(f.slot for f in files) == [0, 1]  # only slot 1 was new
            assert uploader.m.lake_bundles_skipped.total() == 1
            await tx.send(delivery(5, 0, {0: rows(3)}))  # fully held: acked at once
            await acks.until(lambda o: len(o) == 2)
            assert len(await registered(tier)) == 2


@pytest.mark.asyncio
async def test_uploader_abandons_file_and_nacks_on_duplicate_coverage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_test_tier(tmp_path, **ROTATE_AT_TWO) as tier, \
            running(tier) as (acks, uploader, tx):
        looked_up = anyio.Event()
        covered = tier.catalog.covered_parts

        async def covered_then_tell(*args: Any) -> Any:
            found = await covered(*args)
            looked_up.set()  # the uploader caches it before the test runs again
            return found

        monkeypatch.setattr(tier.catalog, "covered_parts", covered_then_tell)
        await tx.send(delivery(7, 0, {0: rows(2)}))  # caches "nothing held" for segment 7
        with anyio.fail_after(10):
            await looked_up.wait()
        # Another writer registers bundle (7, 1) behind the uploader's back.
        other = FileRow(file_id="01OTHER000000000000000000A", client_name="app",
                        source_id=tier.source_id, shard=0, slot=0)
        await tier.catalog.register(other, [Coverage(segment_seq=7, bundle_indexes=(1,))])
        await tx.send(delivery(7, 1, {0: rows(2)}))
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(7, 0, ackfmt.NACK), (7, 1, ackfmt.NACK)]
        mine = await tier.catalog.list_files(states=[FileState.ABANDONED])
        assert len(mine) == 1
        assert not list(tier.data.objects.rglob("*.parquet"))  # its object was deleted


@pytest.mark.asyncio
async def test_uploader_rotates_on_schema_change_and_window_pressure(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, file_duration_ms=60_000, window_bundles=16) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: pa.table({"v": pa.array([1], pa.int64())})}))
        await tx.send(delivery(1, 1, {0: pa.table({"v": pa.array(["one"])})}))  # utf8 vs int
        for i in range(2, 9):  # the second file now holds 8: half the window (16)
            await tx.send(delivery(1, i, {0: pa.table({"v": pa.array([str(i)])})}))
        await acks.until(lambda o: len(o) == 9)
        assert {o for _, _, o in acks.outcomes} == {ackfmt.ACK}
        reasons = uploader.m.lake_rotations.by_label("reason")
        assert reasons.get("schema") == 1 and reasons.get("window", 0) >= 1
        files = await registered(tier)
        assert sum(f.row_count for f in files) == 9
        assert len({f.schema_hash for f in files}) == 2


@pytest.mark.asyncio
async def test_uploader_nacks_file_whose_values_no_cast_can_hold(tmp_path: Path) -> None:
    far = pa.array([253_402_300_000], pa.timestamp("s"))  # year 9999: overflows ns
    async with open_test_tier(tmp_path, **ROTATE_AT_TWO) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: pa.table({"t": far})}))
        await tx.send(delivery(1, 1, {0: pa.table({"t": pa.array([1], pa.timestamp("ns"))})}))
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.NACK), (1, 1, ackfmt.NACK)]
        assert uploader.m.lake_errors.by_label("kind").get("write") == 1
        assert [r.state for r in await tier.catalog.list_files()] == [FileState.ABANDONED]
        # The uploader goes on: the next bundles, of another client, are uploaded.
        await tx.send(delivery(2, 0, {0: rows(3)}, client="other"))
        await tx.send(delivery(2, 1, {0: rows(3, 3)}, client="other"))
        await acks.until(lambda o: len(o) == 4)
        assert sorted(acks.outcomes[2:]) == [(2, 0, ackfmt.ACK), (2, 1, ackfmt.ACK)]


@pytest.mark.asyncio
async def test_uploader_refuses_bundle_with_a_column_named_twice(tmp_path: Path) -> None:
    twice = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])
    async with open_test_tier(tmp_path, **ROTATE_EACH) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: twice}))
        await tx.send(delivery(1, 1, {0: rows(2)}))
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.NACK), (1, 1, ackfmt.ACK)]
        assert uploader.m.lake_errors.by_label("kind").get("schema") == 1


@pytest.mark.asyncio
async def test_uploader_time_column_falls_back_when_not_a_time(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, **ROTATE_EACH, time_column="msg") as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: pa.table({"msg": ["hello"]})}))
        await acks.until(lambda o: len(o) == 1)
        [f] = await registered(tier)
        assert f.start_ts == f.end_ts == 1_700_000_000_000_000_000  # the ingestion time


@pytest.mark.asyncio
async def test_uploader_redelivery_skips_slots_a_file_in_flight_holds(tmp_path: Path) -> None:
    """A bundle of two slots whose slot-0 file fails is nacked while its slot-1 piece
    is still in an open file; the redelivery must not add that piece again (that file
    registered it twice: one coverage row, two copies of its rows; the catalog's
    duplicate check cannot see it). Found as "more rows than sent" under a full staging
    disk (tests/daemon/test_lake_disk_full.py)."""
    far = pa.array([253_402_300_000], pa.timestamp("s"))  # year 9999: overflows ns
    near = pa.array([1], pa.timestamp("ns"))
    note = pa.table({"note": ["x"]})
    async with open_test_tier(tmp_path, **ROTATE_AT_TWO) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: pa.table({"t": far})}))
        # Two slots: window pressure (3 held) rotates the oldest file, slot 0's, whose
        # row group cannot be written (the far value as ns): both bundles are nacked;
        # slot 1's file stays open with bundle (1, 1) in it.
        await tx.send(delivery(1, 1, {0: pa.table({"t": near}), 1: note}))
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.NACK), (1, 1, ackfmt.NACK)]
        # Redelivered: its slot 0 now in a file of its own (it failed a file once).
        await tx.send(delivery(1, 1, {0: pa.table({"t": near}), 1: note}))
        for i in (2, 3):  # window pressure rotates the slot-1 file, then these two's
            await tx.send(delivery(1, i, {0: pa.table({"t": near})}))
        await acks.until(lambda o: len(o) == 5)
        assert sorted(acks.outcomes[2:]) == [(1, i, ackfmt.ACK) for i in (1, 2, 3)]
        files = await registered(tier)
        assert [(f.slot, f.row_count) for f in files if f.slot == 1] == [(1, 1)]
        assert sum(f.row_count for f in files if f.slot == 0) == 3
