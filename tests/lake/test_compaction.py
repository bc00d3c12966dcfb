"""lake.compaction on real Parquet files, a real catalog and a real object store.

Inputs are written with the uploader's parts (tests.lake.test_janitor.add_file): small
files of drifting schemas merge into one object that plain pyarrow reads back as exactly
the inputs' rows; the catalog swaps them in one replace (coverage kept); the limits split
the work; a lost replace race deletes the output. One test runs on PostgreSQL + S3.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ulid import ULID

from quiverd.kernel.config import CompactionConfig, LakeConfig, StoreConfig
from quiverd.lake.compaction import CompactionResult, compact, plan
from quiverd.lake.model import FileRow, FileState
from quiverd.lake.partitions import key_partition
from quiverd.lake.tier import Tier
from quiverd_actors import uploader
from tests.lake.helpers import LOG, add_file, open_test_tier
from tests.lake.test_janitor import keys

EXTRA = [f.name for f in uploader.EXTRA_FIELDS]


def drifting(i: int) -> pa.Table:
    """File i's rows: `user` dictionary or plain, `score` only in even files, `n` int32/64."""
    users = [f"u{i}", f"u{i + 1}", None]
    user = (pa.array(users).dictionary_encode() if i % 2 else pa.array(users, pa.string()))
    columns: dict[str, Any] = {"user": user,
                               "n": pa.array([i, i + 1, i + 2],
                                             pa.int32() if i < 3 else pa.int64())}
    if i % 2 == 0:
        columns["score"] = pa.array([i / 2, None, 1.5])
    return pa.table(columns)


def expected_rows(rows: list[FileRow], tables: list[pa.Table]) -> list[dict[str, Any]]:
    """What the merged file must hold: every input row in input order, nulls for gaps."""
    out = []
    for row, t in zip(rows, tables, strict=True):
        for rec in t.to_pylist():
            out.append({"user": rec["user"], "n": rec["n"], "score": rec.get("score"),
                        "_quiver_segment": row.first_segment, "_quiver_bundle": 0})
    return out


async def read_object(tier: Tier, key: str) -> pa.Table:
    return pq.read_table(io.BytesIO(await tier.store.read(key)))


async def run(tier: Tier, **kwargs: Any) -> list[CompactionResult]:
    return await compact(tier, limiter=anyio.CapacityLimiter(2), log=LOG, **kwargs)


async def six_files(tier: Tier, **kwargs: Any) -> tuple[list[FileRow], list[pa.Table]]:
    tables = [drifting(i) for i in range(6)]
    rows = [await add_file(tier, t, segment=10 + i, ts_ns=1_000 * (1 + i), **kwargs)
            for i, t in enumerate(tables)]
    return rows, tables


async def check_merged(tier: Tier, result: CompactionResult, rows: list[FileRow],
                       tables: list[pa.Table]) -> FileRow:
    """The object, the new row, the old rows and coverage after one successful task."""
    assert result.outcome == "compacted", result
    assert result.inputs == [r.file_id for r in rows]
    new = await tier.catalog.get(result.output)
    assert new is not None and new.state is FileState.META_REGISTERED
    assert new.row_count == result.rows == sum(r.row_count for r in rows) == 3 * len(rows)
    assert (new.first_segment, new.last_segment) == (rows[0].first_segment,
                                                      rows[-1].last_segment)
    assert new.bundle_count == len(rows)
    assert (new.start_ts, new.end_ts) == (rows[0].start_ts, rows[-1].end_ts)
    assert new.object_key.startswith("client=app/slot=0/date=")  # the inputs' hour:
    assert key_partition(new.object_key) == key_partition(rows[0].object_key) != ""
    assert new.object_key.endswith(f"~{tier.node_id}_stable.parquet")
    assert new.local_path and await anyio.Path(new.local_path).exists()

    merged = await read_object(tier, new.object_key)
    assert merged.schema.field("user").type == pa.string()  # dictionaries decoded
    widest = pa.int64() if any(t.schema.field("n").type == pa.int64() for t in tables) \
        else pa.int32()
    assert merged.schema.field("n").type == widest
    assert merged.schema.field("score").type == pa.float64()
    got = merged.select(["user", "n", "score", "_quiver_segment", "_quiver_bundle"])
    assert got.to_pylist() == expected_rows(rows, tables)
    assert set(EXTRA) <= set(merged.schema.names)
    assert pq.read_metadata(io.BytesIO(await tier.store.read(new.object_key))
                            ).num_rows == new.row_count

    for r in rows:
        old = await tier.catalog.get(r.file_id)
        assert old is not None and old.state is FileState.COMPACTED
        assert old.compacted_into == new.file_id
        # Still covered (by the new file): a redelivered bundle is not uploaded again.
        assert await tier.catalog.covered(tier.source_id, 0, r.first_segment) == {0: {0}}
    return new


@pytest.mark.asyncio
async def test_compact_drifting_schemas_into_one_file(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d", compaction=CompactionConfig(min_files=4)) as tier:
        rows, tables = await six_files(tier)
        before = await keys(tier)

        [result] = await run(tier)

        new = await check_merged(tier, result, rows, tables)
        # The replaced objects stay for readers in flight (the janitor deletes them).
        assert await keys(tier) == before | {new.object_key}
        live = await tier.catalog.list_files(states=[FileState.META_REGISTERED])
        assert [r.file_id for r in live] == [new.file_id]
        assert not list(tier.data.staging_active.iterdir())  # task files cleaned up


@pytest.mark.asyncio
async def test_compact_downloads_evicted_inputs(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        rows, tables = await six_files(tier, keep_local=False)
        [result] = await run(tier)
        await check_merged(tier, result, rows, tables)


@pytest.mark.asyncio
async def test_compact_fewer_than_min_files_does_nothing(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d", compaction=CompactionConfig(min_files=4)) as tier:
        rows = [await add_file(tier, drifting(i), segment=i) for i in range(3)]
        assert await run(tier) == []
        assert await run(tier, client="other") == []
        # Enough files, but none is small.
        tier.cfg = msgspec.structs.replace(tier.cfg, lake=lake_with(
            tier.cfg.lake, min_files=2, small_file_bytes=1))
        assert await run(tier) == []
        for r in rows:
            got = await tier.catalog.get(r.file_id)
            assert got is not None and got.state is FileState.META_REGISTERED


@pytest.mark.asyncio
async def test_compact_dry_run_plans_and_writes_nothing(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        rows, _ = await six_files(tier)
        before = await keys(tier)
        [planned] = await run(tier, dry_run=True)
        assert planned.outcome == "planned" and planned.output == ""
        assert planned.inputs == [r.file_id for r in rows] and planned.rows == 18
        assert await keys(tier) == before
        got = await tier.catalog.get(rows[0].file_id)
        assert got is not None and got.state is FileState.META_REGISTERED


@pytest.mark.asyncio
async def test_compact_lost_replace_race_deletes_the_new_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        rows, _ = await six_files(tier)
        before = await keys(tier)
        real_replace = tier.catalog.replace
        rival = FileRow(file_id=str(ULID()), client_name="app", node_id=tier.node_id,
                        source_id=tier.source_id, row_count=6, bundle_count=2)

        async def racing(old_ids: list[str], new_row: FileRow) -> None:
            await real_replace(old_ids[:2], rival)  # another compaction got there first
            await real_replace(old_ids, new_row)

        monkeypatch.setattr(tier.catalog, "replace", racing)
        [result] = await run(tier)

        assert result.outcome == "conflict" and "not registered" in result.error
        assert await keys(tier) == before  # the new object is gone again
        lost = await tier.catalog.get(result.output)  # its Received row, abandoned
        assert lost is not None and lost.state is FileState.ABANDONED
        assert not any(result.output in p.name for p in tier.data.staging_stable.iterdir())
        for r in rows[2:]:
            got = await tier.catalog.get(r.file_id)
            assert got is not None and got.state is FileState.META_REGISTERED


@pytest.mark.asyncio
async def test_two_compactions_of_the_same_files_at_once_one_wins_the_other_conflicts(
        tmp_path: Path) -> None:
    """`quiverd compact` while the daemon's own pass takes the same files (found by
    bench/freshness.py: the CLI's task failed with FileNotFoundError): each task reads
    its inputs from paths of its own, so one replaces them and the other conflicts (its
    output deleted); the rows are in the lake once."""
    async with open_test_tier(tmp_path / "d") as tier:
        rows, tables = await six_files(tier)
        results: list[list[CompactionResult]] = []

        async def one() -> None:
            results.append(await run(tier))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        outcomes = sorted(r.outcome for rs in results for r in rs)
        assert outcomes == ["compacted", "conflict"], [r.error for rs in results for r in rs]
        [won] = [r for rs in results for r in rs if r.outcome == "compacted"]
        await check_merged(tier, won, rows, tables)
        assert list(tier.data.staging_active.iterdir()) == []  # no task left a file


@pytest.mark.asyncio
async def test_compact_max_files_and_memory_limit_split_the_work(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d",
                              compaction=CompactionConfig(min_files=2, max_files=3)) as tier:
        rows, tables = await six_files(tier)
        lake = tier.cfg.lake
        results = await run(tier)
        assert [len(r.inputs) for r in results] == [3, 3]
        for i, result in enumerate(results):
            await check_merged(tier, result, rows[3 * i:3 * i + 3], tables[3 * i:3 * i + 3])

    memory = max(r.uncompressed_size for r in rows) * 2
    assert [len(t.rows) for t in plan(rows, lake_with(
        lake, max_files=32, memory_limit_bytes=memory))] == [2, 2, 2]
    out_bytes = max(r.compressed_size for r in rows) * 4
    assert [len(t.rows) for t in plan(rows, lake_with(
        lake, max_files=32, file_size_bytes=out_bytes))] == [4, 2]
    # A leftover of one file is left alone.
    assert [len(t.rows) for t in plan(rows, lake_with(lake, max_files=5))] == [5]
    assert plan(rows[:1], lake_with(lake, min_files=1)) == []


@pytest.mark.asyncio
async def test_compact_unmergeable_schema_splits_the_task(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        tables = [drifting(0), drifting(1),
                  pa.table({"user": ["x", "y", "z"], "n": ["a", "b", "c"]}),  # n: string
                  drifting(3), drifting(4)]
        rows = [await add_file(tier, t, segment=i, ts_ns=1_000 * (1 + i))
                for i, t in enumerate(tables)]
        results = await run(tier)
        assert [r.inputs for r in results] == sorted(
            [[rows[0].file_id, rows[1].file_id], [rows[3].file_id, rows[4].file_id]])
        assert all(r.outcome == "compacted" for r in results)
        alone = await tier.catalog.get(rows[2].file_id)
        assert alone is not None and alone.state is FileState.META_REGISTERED


@pytest.mark.asyncio
async def test_compact_postgres_s3(tmp_path: Path, pg_catalog_dsn: str,
                                   s3_bucket: dict[str, str]) -> None:
    store = StoreConfig(scheme="s3", root="/lake", options=s3_bucket, max_attempts=2)
    async with open_test_tier(tmp_path / "d", store=store, dsn=pg_catalog_dsn) as tier:
        rows, tables = await six_files(tier, keep_local=False)
        [result] = await run(tier)
        new = await check_merged(tier, result, rows, tables)
        assert new.uri.startswith(f"s3://{s3_bucket['bucket']}/lake/")
        # A second run finds one (large enough) file per group: nothing to do.
        assert await run(tier) == []


def lake_with(lake: LakeConfig, *, file_size_bytes: int | None = None,
              **compaction_fields: Any) -> LakeConfig:
    """``lake`` with some [lake.compaction] settings (and the output size) changed."""
    comp = msgspec.structs.replace(lake.compaction, **compaction_fields)
    return msgspec.structs.replace(lake, compaction=comp,
                                   file_size_bytes=file_size_bytes or lake.file_size_bytes)


@pytest.mark.asyncio
async def test_a_janitor_sweep_with_no_grace_keeps_a_compaction_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep with ``grace_s = 0`` between the output's write and its upload, and again
    between the upload and the replace, finds the output named after its Received row:
    not an orphan (it deleted the output's files, and the task failed: found by the lake
    crash states)."""
    from quiverd.kernel.config import JanitorConfig
    from quiverd.lake.janitor import sweep

    async with open_test_tier(tmp_path / "d", janitor=JanitorConfig(grace_s=0)) as tier:
        rows, tables = await six_files(tier)
        real_put, real_replace = tier.store.put_file, tier.catalog.replace
        swept: list[Any] = []

        async def put_after_a_sweep(key: str, path: Path, **kw: Any) -> None:
            swept.append(await sweep(tier))
            await real_put(key, path, **kw)

        async def replace_after_a_sweep(old_ids: list[str], new_row: FileRow) -> None:
            swept.append(await sweep(tier))
            await real_replace(old_ids, new_row)

        monkeypatch.setattr(tier.store, "put_file", put_after_a_sweep)
        monkeypatch.setattr(tier.catalog, "replace", replace_after_a_sweep)
        [result] = await run(tier)
        assert result.outcome == "compacted", result
        assert all(not r.orphan_objects and not r.stale_staging_files for r in swept), swept
        out = await tier.catalog.get(result.output)
        assert out is not None and out.state is FileState.META_REGISTERED
        assert out.object_key in await keys(tier)
        assert sum(r.row_count for r in rows) == out.row_count
