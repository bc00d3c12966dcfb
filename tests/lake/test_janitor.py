"""lake.janitor.sweep on real Parquet files, a real catalog and a real object store.

Files are written with the uploader's parts (ActiveFile, put_file, register), so each
test checks what a sweep deletes, keeps and reports against the store's listing, the
catalog's rows and the staging directory: orphans past the grace (and not before),
another node's objects, dry runs, rows without objects, replaced files after the
delete grace, abandoned rows, stale staging files. One test runs on PostgreSQL + S3.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pyarrow as pa
import pytest
from ulid import ULID

from quiverd.kernel.config import (
    CompactionConfig,
    JanitorConfig,
    LakeScrubConfig,
    StoreConfig,
)
from quiverd.kernel.errors import CatalogUnavailable
from quiverd.kernel.metrics import Metrics
from quiverd.lake.compaction import compact
from quiverd.lake.janitor import JanitorReport, sweep
from quiverd.lake.model import FileRow, FileState, ObjectInfo
from quiverd.lake.parquet import crc32c_file, file_name
from quiverd.lake.tier import Tier
from quiverd_actors.janitor import Janitor
from tests.lake.helpers import (
    DELETE_GRACE_S,
    GRACE_S,
    LOG,
    NS,
    add_file,
    open_test_tier,
)


async def put_object(tier: Tier, tmp: Path, key: str) -> None:
    src = tmp / f"blob-{ULID()}"
    src.write_bytes(b"not parquet, but an object all the same")
    await tier.store.put_file(key, src, size=src.stat().st_size, crc32c=crc32c_file(src))


def orphan_key(tier: Tier, *, node_id: str | None = None, ts_ns: int | None = None) -> str:
    name = file_name("app", ts_ns or time.time_ns(), str(ULID()), "stable")
    return f"client=app/slot=0/{node_id or tier.node_id}/{name}"


def age(path: Path, seconds: int) -> None:
    """Set ``path``'s mtime ``seconds`` into the past."""
    when = time.time() - seconds
    os.utime(path, (when, when))


async def keys(tier: Tier) -> set[str]:
    return {o.key for o in await tier.store.list("")}


def table(n: int = 3, start: int = 0) -> pa.Table:
    return pa.table({"v": pa.array(range(start, start + n), pa.int64())})


# ---- orphans ---------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_sweep_orphans_old_deleted_young_kept_other_node_untouched(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        live = await add_file(tier, table(), segment=1)
        old, young = orphan_key(tier), orphan_key(tier)
        theirs = orphan_key(tier, node_id="n2")
        for key in (old, young, theirs):
            await put_object(tier, tmp_path, key)
        objects = tier.data.objects
        for key in (old, theirs):
            age(objects / key, 2 * GRACE_S)
        age(objects / live.object_key, 2 * GRACE_S)

        report = await sweep(tier)

        assert report.orphan_objects == [old]
        assert report.young_objects == [young]
        assert await keys(tier) == {live.object_key, young, theirs}
        assert not report.rows_missing_objects and not report.failures
        assert report.objects_seen == 3  # this node's: live, old, young
        got = await tier.catalog.get(live.file_id)
        assert got is not None and got.state is FileState.META_REGISTERED


@pytest.mark.asyncio
async def test_sweep_dry_run_deletes_nothing(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        old = orphan_key(tier)
        await put_object(tier, tmp_path, old)
        age(tier.data.objects / old, 2 * GRACE_S)
        stale = tier.data.staging_stable / file_name("app", 1, str(ULID()), "stable")
        stale.write_bytes(b"x")
        age(stale, 2 * GRACE_S)
        abandoned = FileRow(file_id=str(ULID()), client_name="app", node_id=tier.node_id,
                            source_id=tier.source_id, state=FileState.RECEIVED)
        await tier.catalog.insert_file(abandoned)
        await tier.catalog.set_state(abandoned.file_id, FileState.ABANDONED)

        report = await sweep(tier, dry_run=True, now_ns=time.time_ns() + GRACE_S * NS)

        assert report.dry_run
        assert report.orphan_objects == [old]
        assert report.stale_staging_files == [str(stale)]
        assert report.abandoned_removed == [abandoned.file_id]
        assert await keys(tier) == {old}
        assert stale.exists()
        assert await tier.catalog.get(abandoned.file_id) is not None


@pytest.mark.asyncio
async def test_sweep_orphan_without_store_time_aged_by_its_ulid(tmp_path: Path) -> None:
    from quiverd.lake.janitor import _born_ns

    ulid = ULID.from_timestamp(1_700_000_000.5)
    name = file_name("app", 5, str(ulid), "stable")
    assert _born_ns(ObjectInfo(key=f"client=app/slot=0/n1/{name}", size=1)) == \
        1_700_000_000_500_000_000
    assert _born_ns(ObjectInfo(key="client=app/slot=0/n1/x", size=1, last_modified_ns=7)) == 7
    assert _born_ns(ObjectInfo(key="client=app/slot=0/n1/x", size=1)) is None


@pytest.mark.asyncio
async def test_sweep_keeps_the_object_a_quarantined_row_names(tmp_path: Path) -> None:
    """A quarantined file's key is where its restored copy goes: an object there (put
    back from a backup, or from the store's versioning) is never an orphan, however old.
    (It was deleted as one before `quiverd files restore` existed; Lost rows: see
    tests/lake/test_restore.py.)"""
    async with open_test_tier(tmp_path / "d") as tier:
        bad = await add_file(tier, table(), segment=1, keep_local=False)
        good = await add_file(tier, table(start=10), segment=2, keep_local=False)
        assert await tier.catalog.set_state_if(bad.file_id, FileState.QUARANTINED,
                                               (FileState.META_REGISTERED,))
        for row in (bad, good):
            age(tier.data.objects / row.object_key, 2 * GRACE_S)
        report = await sweep(tier, now_ns=time.time_ns() + 2 * GRACE_S * NS)
        assert report.orphan_objects == [] and not report.failures
        assert await keys(tier) == {bad.object_key, good.object_key}


# ---- rows -------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_sweep_row_without_object_reported_never_deleted(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        lost = await add_file(tier, table(), segment=1, keep_local=False)
        kept = await add_file(tier, table(), segment=2)
        await tier.store.delete(lost.object_key)

        metrics = Metrics()
        janitor = Janitor(tier, log=LOG, metrics=metrics)
        report = await janitor.sweep_once()

        assert report.rows_missing_objects == [lost.file_id]
        assert janitor.last_report is report
        assert metrics.lake_errors.by_label("kind") == {"missing_object": 1}
        got = await tier.catalog.get(lost.file_id)
        assert got is not None and got.state is FileState.META_REGISTERED
        assert await keys(tier) == {kept.object_key}


@pytest.mark.asyncio
async def test_sweep_compacted_objects_deleted_after_delete_grace(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        inputs = [await add_file(tier, table(2, 10 * i), segment=i) for i in range(3)]
        [result] = await compact(tier, limiter=anyio.CapacityLimiter(1), log=LOG)
        assert result.outcome == "compacted"
        new = await tier.catalog.get(result.output)
        assert new is not None

        within = await sweep(tier, now_ns=time.time_ns() + (DELETE_GRACE_S - 60) * NS)
        assert within.compacted_removed == [] and within.orphan_objects == []
        assert await keys(tier) == {new.object_key, *(r.object_key for r in inputs)}

        after = await sweep(tier, now_ns=time.time_ns() + (DELETE_GRACE_S + 1) * NS)
        assert sorted(after.compacted_removed) == sorted(r.file_id for r in inputs)
        assert await keys(tier) == {new.object_key}
        for r in inputs:
            assert await tier.catalog.get(r.file_id) is None
            assert not await anyio.Path(r.local_path).exists()
        assert await tier.catalog.covered(tier.source_id, 0, 1) == {0: {0}}
        assert not after.rows_missing_objects and not after.failures


@pytest.mark.asyncio
async def test_sweep_abandoned_row_dropped_with_its_object_after_grace(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        key = orphan_key(tier)
        await put_object(tier, tmp_path, key)
        row = FileRow(file_id=str(ULID()), client_name="app", node_id=tier.node_id,
                      source_id=tier.source_id, object_key=key, state=FileState.RECEIVED)
        await tier.catalog.insert_file(row)
        await tier.catalog.set_state(row.file_id, FileState.UPLOADED)

        unfinished = await sweep(tier, now_ns=time.time_ns() + 2 * GRACE_S * NS)
        assert unfinished.orphan_objects == [] and await keys(tier) == {key}

        await tier.catalog.set_state(row.file_id, FileState.ABANDONED)
        young = await sweep(tier)
        assert young.abandoned_removed == [] and await keys(tier) == {key}

        old = await sweep(tier, now_ns=time.time_ns() + GRACE_S * NS)
        assert old.abandoned_removed == [row.file_id]
        assert old.orphan_objects == []  # handled as the row's object, not twice
        assert await keys(tier) == set()
        assert await tier.catalog.get(row.file_id) is None


# ---- staging ----------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_sweep_stale_staging_file_removed_live_ones_kept(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        live = await add_file(tier, table(), segment=1)
        receiving = FileRow(file_id=str(ULID()), client_name="app", node_id=tier.node_id,
                            source_id=tier.source_id, state=FileState.RECEIVED)
        await tier.catalog.insert_file(receiving)
        data = tier.data
        open_active = data.staging_active / file_name("app", 1, receiving.file_id, "active")
        stale_active = data.staging_active / file_name("app", 1, str(ULID()), "active")
        stale_stable = data.staging_stable / file_name("app", 1, str(ULID()), "stable")
        junk = data.staging_stable / "leftover.tmp"
        fresh = data.staging_stable / file_name("app", 1, str(ULID()), "stable")
        # A download of a live file in progress (compaction's), and a dead one's.
        downloading = data.staging_active / (file_name("app", 1, live.file_id, "active")
                                             + ".tmp")
        dead_download = data.staging_active / (stale_active.name + ".tmp")
        for path in (open_active, stale_active, stale_stable, junk, fresh, downloading,
                     dead_download):
            path.write_bytes(b"x")
        for path in (open_active, stale_active, stale_stable, junk, Path(live.local_path),
                     downloading, dead_download):
            age(path, 2 * GRACE_S)

        report = await sweep(tier)

        assert sorted(report.stale_staging_files) == sorted(
            str(p) for p in (stale_active, stale_stable, junk, dead_download))
        assert {p.name for p in data.staging_active.iterdir()} == {open_active.name,
                                                                   downloading.name}
        assert {p.name for p in data.staging_stable.iterdir()} == {
            Path(live.local_path).name, fresh.name}


@pytest.mark.asyncio
async def test_sweep_stale_upload_temp_files_removed_after_grace(tmp_path: Path) -> None:
    # A crash mid-upload to the fs store leaves OpenDAL's temp file in <objects>/.tmp.
    async with open_test_tier(tmp_path / "d") as tier:
        temps = tier.data.objects / ".tmp"
        old, young = temps / "a.parquet.123", temps / "b.parquet.456"
        for path in (old, young):
            path.write_bytes(b"partial")
        age(old, 2 * GRACE_S)
        dry = await sweep(tier, dry_run=True)
        assert dry.stale_upload_temps == [str(old)] and old.exists()
        report = await sweep(tier)
        assert report.stale_upload_temps == [str(old)]
        assert not old.exists() and young.exists()


# ---- the actor --------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_janitor_actor_sweeps_on_its_timer_and_counts_failures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_test_tier(tmp_path / "d", janitor=JanitorConfig(interval_s=1, grace_s=0),
                              compaction=CompactionConfig(interval_s=0)) as tier:
        old = orphan_key(tier)
        await put_object(tier, tmp_path, old)
        metrics = Metrics()
        janitor = Janitor(tier, log=LOG, metrics=metrics)
        swept = anyio.Event()
        real_sweep = janitor.sweep_once

        async def observed() -> JanitorReport:
            try:
                return await real_sweep()
            finally:
                swept.set()

        monkeypatch.setattr(janitor, "sweep_once", observed)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(janitor.run)
                await swept.wait()
                tg.cancel_scope.cancel()
        assert isinstance(janitor.last_report, JanitorReport)
        assert janitor.last_report.orphan_objects == [old]
        assert not metrics.lake_errors.by_label("kind")

        async def down(**_: object) -> list[FileRow]:
            raise CatalogUnavailable("catalog down (test)")

        monkeypatch.setattr(tier.catalog, "list_files", down)
        swept = anyio.Event()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(janitor.run)
                await swept.wait()  # the sweep failed; the timer counted it and goes on
                assert metrics.lake_errors.by_label("kind") == {"janitor": 1}
                tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_janitor_actor_returns_when_every_timer_is_off(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d", janitor=JanitorConfig(interval_s=0),
                              compaction=CompactionConfig(interval_s=0),
                              scrub=LakeScrubConfig(rate_mb_per_s=0)) as tier:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                await tg.start(Janitor(tier, log=LOG, metrics=Metrics()).run)


# ---- PostgreSQL + S3 --------------------------------------------------------------------

@pytest.mark.asyncio
async def test_sweep_postgres_s3_orphans_missing_rows_and_compacted(
        tmp_path: Path, pg_catalog_dsn: str, s3_bucket: dict[str, str]) -> None:
    store = StoreConfig(scheme="s3", root="/lake", options=s3_bucket, max_attempts=2)
    async with open_test_tier(tmp_path / "d", store=store, dsn=pg_catalog_dsn) as tier:
        rows = [await add_file(tier, table(2, 10 * i), segment=i) for i in range(2)]
        lost = await add_file(tier, table(), slot=1, segment=9, keep_local=False)
        await tier.store.delete(lost.object_key)
        orphan, theirs = orphan_key(tier), orphan_key(tier, node_id="n2")
        for key in (orphan, theirs):
            await put_object(tier, tmp_path, key)
        [result] = await compact(tier, limiter=anyio.CapacityLimiter(1), log=LOG)
        new = await tier.catalog.get(result.output)
        assert new is not None and new.uri.startswith("s3://")

        within = await sweep(tier)
        assert within.young_objects == [orphan] and within.orphan_objects == []
        assert within.rows_missing_objects == [lost.file_id]

        later = time.time_ns() + (GRACE_S + 1) * NS
        dry = await sweep(tier, now_ns=later, dry_run=True)
        assert dry.orphan_objects == [orphan]
        assert await keys(tier) == {orphan, theirs, new.object_key,
                                    *(r.object_key for r in rows)}

        done = await sweep(tier, now_ns=later)
        assert done.orphan_objects == [orphan]
        assert sorted(done.compacted_removed) == sorted(r.file_id for r in rows)
        assert done.rows_missing_objects == [lost.file_id]
        assert await keys(tier) == {theirs, new.object_key}


@pytest.mark.asyncio
async def test_sweep_never_deletes_the_object_of_a_file_still_being_uploaded(
        tmp_path: Path) -> None:
    """The sim's finding (tests/sim/test_detsim.py, seed 11): an upload whose verify
    timed out has its object in the store while its row is still Rotated, with no key.
    However old, that object is the upload's, not an orphan; and a delete judged from an
    older listing asks the catalog again before each attempt."""
    async with open_test_tier(tmp_path / "d") as tier:
        file_id = str(ULID())
        key = f"client=app/slot=0/{tier.node_id}/" + file_name(
            tier.node_id, time.time_ns(), file_id, "stable")
        await put_object(tier, tmp_path, key)
        await tier.catalog.insert_file(FileRow(
            file_id=file_id, client_name="app", node_id=tier.node_id,
            source_id=tier.source_id, state=FileState.RECEIVED))
        await tier.catalog.set_state(file_id, FileState.ROTATED)
        report = await sweep(tier, now_ns=time.time_ns() + 2 * GRACE_S * NS)
        assert report.orphan_objects == [] and await keys(tier) == {key}
        # The listing said orphan; by the delete the catalog names this key: kept.
        from quiverd.lake.janitor import _still_orphan
        from quiverd.lake.parquet import parse_file_name
        await tier.catalog.set_state(file_id, FileState.UPLOADED, object_key=key)
        name = parse_file_name(key.rsplit("/", 1)[-1])
        await tier.store.delete(key, still=_still_orphan(tier, key, name))
        assert await keys(tier) == {key}
        await tier.catalog.set_state(file_id, FileState.ABANDONED)
        await tier.store.delete(key, still=_still_orphan(tier, key, name))
        assert await keys(tier) == set()
