"""The uploader's hour partitions: a bundle whose rows span hours becomes one file per hour
(nulls in a file of their own), each under its hour's key; a redelivery writes only
the hours not registered yet. Same rig as test_uploader (files rotate on size)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ulid import ULID

from quiverd.acks import format as ackfmt
from quiverd.lake.model import Coverage, FileRow
from quiverd.lake.parquet import file_name
from quiverd.lake.partitions import DEFAULT_PARTITION, hour_dirs, hour_of_ns, parse_object_key
from tests.actors.test_uploader import ROTATE_EACH, delivery, registered, running
from tests.actors.test_uploader_pipeline import eventually
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import open_test_tier


def at(hour: int, minute: int = 0) -> datetime:
    return datetime(2024, 6, 10, hour, minute, tzinfo=UTC)


def hour_of(when: datetime) -> int:
    return int(when.timestamp()) // 3600


def spanning() -> pa.Table:
    """Rows of three hours and two nulls, interleaved."""
    times = [at(5, 10), at(6, 0), None, at(7, 59), at(5, 59), at(6, 30), None]
    return pa.table({"ts": pa.array(times, pa.timestamp("us", tz="UTC")),
                     "i": pa.array(range(len(times)), pa.int64())})


@pytest.mark.asyncio
async def test_uploader_bundle_spanning_three_hours_one_file_per_hour(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, time_column="ts", **ROTATE_EACH) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: spanning()}))
        await acks.until(lambda o: len(o) == 1)
        assert acks.outcomes == [(1, 0, ackfmt.ACK)]  # once every hour's file is in
        files = await registered(tier)
        by_dirs: dict[str, list[int]] = {}
        for f in files:
            key = parse_object_key(f.object_key)
            assert key is not None and key.partitioned and key.node_id == tier.node_id
            assert f.object_key.startswith("client=app/slot=0/date=")
            back = pq.read_table(uri_path(f.uri))
            hours = {None if t is None else hour_of(t) for t in back["ts"].to_pylist()}
            assert hours == {key.hour}  # the file is within one hour: its key's
            by_dirs[hour_dirs(key.hour)] = back["i"].to_pylist()
        assert by_dirs == {"date=2024-06-10/hour=05": [0, 4], "date=2024-06-10/hour=06": [1, 5],
                           "date=2024-06-10/hour=07": [3],
                           f"date={DEFAULT_PARTITION}/hour={DEFAULT_PARTITION}": [2, 6]}
        await tx.send(delivery(1, 0, {0: spanning()}))  # redelivered: every hour is held
        await acks.until(lambda o: len(o) == 2)
        assert acks.outcomes[1] == (1, 0, ackfmt.ACK)
        assert len(await registered(tier)) == 4


@pytest.mark.asyncio
async def test_uploader_redelivery_writes_only_hours_not_registered(tmp_path: Path) -> None:
    """A crash between the registrations of one bundle's hours: the hour already in the
    lake is not written again, the others are."""
    async with open_test_tier(tmp_path, time_column="ts", **ROTATE_EACH) as tier:
        held_id = str(ULID())
        held_key = tier.object_key("app", 0, file_name(tier.node_id, 0, held_id, "stable"),
                                   hour_of(at(6)))
        held = FileRow(file_id=held_id, client_name="app", source_id=tier.source_id, shard=0,
                       slot=0, node_id=tier.node_id, object_key=held_key)
        await tier.catalog.register(held, [Coverage(segment_seq=9, bundle_indexes=(0,))])
        async with running(tier) as (acks, uploader, tx):
            await tx.send(delivery(9, 0, {0: spanning()}))
            await acks.until(lambda o: len(o) == 1)
            assert acks.outcomes == [(9, 0, ackfmt.ACK)]
            new = [f for f in await registered(tier) if f.file_id != held_id]
            written = sorted(i for f in new for i in pq.read_table(uri_path(f.uri))["i"]
                             .to_pylist())
            assert written == [0, 2, 3, 4, 6]  # all but hour 6's rows 1 and 5


@pytest.mark.asyncio
async def test_uploader_without_time_column_keys_by_ingestion_hour(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, time_column="ts", **ROTATE_EACH) as tier, \
            running(tier) as (acks, uploader, tx):
        d = delivery(2, 0, {0: pa.table({"v": pa.array([1, 2], pa.int64())}),
                            1: pa.table({"ts": pa.array([1, 2], pa.int64())})})  # not a time
        await tx.send(d)
        await acks.until(lambda o: len(o) == 1)
        want = hour_dirs(hour_of_ns(d.ingestion_ts_ns))
        keys = sorted(f.object_key for f in await registered(tier))
        assert [k.split("/")[:4] for k in keys] == [
            ["client=app", f"slot={slot}", *want.split("/")] for slot in (0, 1)]
        assert all(k.endswith(f"~{tier.node_id}_stable.parquet") for k in keys)


@pytest.mark.asyncio
async def test_uploader_late_rows_open_a_file_for_their_hour(tmp_path: Path) -> None:
    """Rows of an old hour after newer ones: a file for that hour, not the open one."""
    async with open_test_tier(tmp_path, time_column="ts", window_bundles=16,
                              file_duration_ms=3_600_000) as tier, \
            running(tier) as (acks, uploader, tx):
        def one(when: datetime, i: int) -> pa.Table:
            return pa.table({"ts": pa.array([when], pa.timestamp("ms", tz="UTC")),
                             "i": pa.array([i], pa.int64())})

        for i, when in enumerate([at(8), at(8, 5), at(3), at(8, 9)]):
            await tx.send(delivery(4, i, {0: one(when, i)}))
        await eventually(lambda: sum(len(f.bundles) for f in uploader.files.values()) == 4)
        hours = sorted((f.hour, [b for _, b in f.bundles]) for f in uploader.files.values())
        assert hours == [(hour_of(at(3)), [2]), (hour_of(at(8)), [0, 1, 3])]
