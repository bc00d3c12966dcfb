"""The janitor and compaction on hour-partitioned keys: another node's objects are never
judged whatever their layout, this node's old-layout objects still are, and compaction
never merges files of different hours."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pyarrow as pa
import pytest
from ulid import ULID

from quiverd.kernel.config import CompactionConfig, LakeConfig
from quiverd.lake.compaction import compact, plan
from quiverd.lake.janitor import sweep
from quiverd.lake.model import FileRow, FileState
from quiverd.lake.parquet import file_name
from quiverd.lake.partitions import NS_PER_HOUR, hour_dirs, key_partition, parse_object_key
from quiverd.lake.tier import Tier
from tests.lake.helpers import GRACE_S, LOG, add_file, open_test_tier
from tests.lake.test_janitor import age, keys, put_object


def new_key(node_id: str, hour: int | None = 0) -> str:
    name = file_name(node_id, time.time_ns(), str(ULID()), "stable")
    return f"client=app/slot=0/{hour_dirs(hour)}/{name}"


def old_key(node_id: str) -> str:
    name = f"app_20240610T061320123456789Z_{ULID()}_stable.parquet"
    return f"client=app/slot=0/{node_id}/{name}"


def table(n: int = 3, start: int = 0) -> pa.Table:
    return pa.table({"v": pa.array(range(start, start + n), pa.int64())})


@pytest.mark.asyncio
async def test_sweep_judges_only_this_nodes_objects_in_both_layouts(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d", node_id="n1") as tier:
        live = await add_file(tier, table(), segment=1)
        mine_new, mine_old = new_key("n1", 100), old_key("n1")
        mine_null = new_key("n1", None)
        # Another node whose id is a prefix or suffix of ours, in the same hour directory.
        theirs = [new_key("n2", 100), new_key("n1x", 100), new_key("xn1", None),
                  old_key("n2")]
        for key in (mine_new, mine_old, mine_null, *theirs):
            await put_object(tier, tmp_path, key)
            age(tier.data.objects / key, 2 * GRACE_S)
        age(tier.data.objects / live.object_key, 2 * GRACE_S)

        report = await sweep(tier)

        assert sorted(report.orphan_objects) == sorted([mine_new, mine_old, mine_null])
        assert await keys(tier) == {live.object_key, *theirs}
        assert report.objects_seen == 4  # live + this node's three orphans
        assert not report.failures


async def hours_of_files(tier: Tier, hours: list[int]) -> list[FileRow]:
    return [await add_file(tier, table(2, 10 * i), segment=i,
                           ts_ns=hour * NS_PER_HOUR + 60 * 10**9 * i)
            for i, hour in enumerate(hours)]


@pytest.mark.asyncio
async def test_compact_never_merges_files_of_different_hours(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        rows = await hours_of_files(tier, [470_000, 470_001, 470_000, 470_001, 470_002])
        results = await compact(tier, limiter=anyio.CapacityLimiter(2), log=LOG)
        assert sorted(len(r.inputs) for r in results) == [2, 2]  # hour 470_002 alone
        for result in results:
            assert result.outcome == "compacted", result
            new = await tier.catalog.get(result.output)
            assert new is not None and new.state is FileState.META_REGISTERED
            inputs = [r for r in rows if r.file_id in result.inputs]
            assert {key_partition(r.object_key) for r in inputs} == {
                key_partition(new.object_key)}
            parsed = parse_object_key(new.object_key)
            assert parsed is not None and parsed.node_id == tier.node_id


def test_compaction_plan_leaves_old_layout_files_alone() -> None:
    def row(key: str) -> FileRow:
        return FileRow(file_id=str(ULID()), client_name="app", slot=0, shard=0,
                       object_key=key, state=FileState.META_REGISTERED, compressed_size=10,
                       uncompressed_size=10, row_count=1)

    lake = LakeConfig(compaction=CompactionConfig(min_files=2))
    old = [row(old_key("n1")) for _ in range(3)]
    new = [row(new_key("n1", 5)) for _ in range(2)]
    tasks = plan([*old, *new], lake)
    assert [sorted(r.file_id for r in t.rows) for t in tasks] == [
        sorted(r.file_id for r in new)]
    assert tasks[0].key == ("app", 0, 0, hour_dirs(5))
