"""``quiverd files restore`` / ``forget`` (lake.restore) on real lake files: a file is
damaged in the store, the scrub quarantines it, then a backup is put back, checked and
made live; the janitor keeps an object a quarantined row names (it deleted it as an
orphan before), and a wrong copy is refused with nothing changed. fs + SQLite, and S3
(moto) + PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiverd.kernel.config import StoreConfig
from quiverd.kernel.errors import (
    CatalogUnavailable,
    ConfigError,
    LakeFileCorrupt,
    LakeFileMissing,
)
from quiverd.lake.catalog import StateConflict
from quiverd.lake.janitor import sweep
from quiverd.lake.model import REGISTERED, FileRow, FileState
from quiverd.lake.restore import forget_file, restore_file
from quiverd.lake.scrub import QUARANTINE_PREFIX, check_object, scrub_pass
from quiverd.lake.tier import Tier
from tests.lake.helpers import NS, open_test_tier
from tests.lake.test_scrub import damaged, files


async def quarantine_one(tier: Tier, tmp_path: Path, *, s3: Any = None,
                         bucket: str = "") -> tuple[FileRow, Path, list[FileRow]]:
    """Three files; the middle one's object damaged and quarantined by a scrub pass.
    Returns it, a good backup of it on local disk, and every row."""
    rows = await files(tier)
    bad = rows[1]
    original = await tier.store.read(bad.object_key)
    backup = tmp_path / f"backup-{bad.file_id}.parquet"
    backup.write_bytes(original)
    if s3 is None:
        await tier.store.delete(bad.object_key)
        key = tier.data.objects / bad.object_key
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(damaged(original))
    else:
        await anyio.to_thread.run_sync(lambda: s3.put_object(
            Bucket=bucket, Key=f"lake/{bad.object_key}", Body=damaged(original)))
    report = await scrub_pass(tier, rate_bytes_per_s=100e6)
    assert [c.file_id for c in report.corrupt] == [bad.file_id]
    assert (await tier.catalog.get(bad.file_id)).state is FileState.QUARANTINED  # type: ignore[union-attr]
    return bad, backup, rows


async def assert_live(tier: Tier, row: FileRow, rows: list[FileRow]) -> None:
    back = await tier.catalog.get(row.file_id)
    assert back is not None and back.state is FileState.EVICTED
    assert {r.file_id for r in await tier.catalog.list_files(states=REGISTERED)} == \
        {r.file_id for r in rows}
    assert await check_object(tier, row) is None
    assert await tier.catalog.covered(tier.source_id, 0, row.first_segment) == {0: {0}}


def far_future(tier: Tier) -> int:
    """A sweep's clock past every grace (janitor.grace_s, compaction.delete_grace_s)."""
    lake = tier.cfg.lake
    return time.time_ns() + (max(lake.janitor.grace_s, lake.compaction.delete_grace_s) + 1) * NS


@pytest.mark.asyncio
async def test_restore_from_backup_makes_the_file_live_and_janitor_keeps_it(
        tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        bad, backup, rows = await quarantine_one(tier, tmp_path)
        # A wrong copy (another file's bytes) is refused before anything is uploaded.
        other = tmp_path / "other.parquet"
        other.write_bytes(await tier.store.read(rows[0].object_key))
        with pytest.raises(LakeFileCorrupt, match=f"is not lake file {bad.file_id}: .*nothing "
                           "was uploaded"):
            await restore_file(tier, bad.file_id, other)
        assert await tier.store.stat(bad.object_key) is None
        # Without --from and nothing at the key: it says where to put the copy.
        with pytest.raises(LakeFileMissing, match="the store has no object at"):
            await restore_file(tier, bad.file_id)

        done = await restore_file(tier, bad.file_id, backup)
        assert done.changed and done.state == "Evicted" and done.rows == bad.row_count
        await assert_live(tier, bad, rows)
        assert await tier.store.stat(QUARANTINE_PREFIX + bad.object_key) is not None  # kept
        again = await restore_file(tier, bad.file_id)  # idempotent: checks, changes nothing
        assert not again.changed
        report = await sweep(tier, now_ns=far_future(tier))
        assert bad.object_key not in report.orphan_objects
        await assert_live(tier, bad, rows)
        later = await scrub_pass(tier, rate_bytes_per_s=100e6)
        assert later.files_checked == 3 and not later.corrupt


@pytest.mark.asyncio
async def test_janitor_keeps_an_object_put_back_at_a_quarantined_key(tmp_path: Path) -> None:
    """The operator puts the backup at the key (as the hints said) before running restore,
    or restores it from the store's versioning: a sweep a day later must not delete it."""
    async with open_test_tier(tmp_path / "d") as tier:
        bad, backup, rows = await quarantine_one(tier, tmp_path)
        path = tier.data.objects / bad.object_key
        path.write_bytes(backup.read_bytes())
        report = await sweep(tier, now_ns=far_future(tier))
        assert report.orphan_objects == [] and path.exists()
        await scrub_pass(tier, rate_bytes_per_s=100e6)  # a sound copy: not moved away
        assert path.exists()
        done = await restore_file(tier, bad.file_id)  # the object already at its key
        assert done.changed and done.source == "store"
        await assert_live(tier, bad, rows)


@pytest.mark.asyncio
async def test_restore_run_again_after_a_crash_between_upload_and_row_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upload landed, the catalog did not (the process died, or the catalog was
    down): the object waits at its key (the janitor keeps it) and the same command,
    run again, finishes the job."""
    async with open_test_tier(tmp_path / "d") as tier:
        bad, backup, rows = await quarantine_one(tier, tmp_path)

        async def down(file_id: str) -> bool:
            raise CatalogUnavailable("catalog down at the row change")

        with monkeypatch.context() as m:
            m.setattr(tier.catalog, "restore", down)
            with pytest.raises(CatalogUnavailable):
                await restore_file(tier, bad.file_id, backup)
        assert await check_object(tier, bad) is None  # uploaded
        assert (await tier.catalog.get(bad.file_id)).state is FileState.QUARANTINED  # type: ignore[union-attr]
        assert (await sweep(tier, now_ns=far_future(tier))).orphan_objects == []
        done = await restore_file(tier, bad.file_id, backup)  # the same command again
        assert done.changed
        await assert_live(tier, bad, rows)


@pytest.mark.asyncio
async def test_restore_refuses_a_damaged_object_at_the_key(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        bad, backup, _ = await quarantine_one(tier, tmp_path)
        path = tier.data.objects / bad.object_key
        path.write_bytes(damaged(backup.read_bytes()))
        with pytest.raises(LakeFileCorrupt, match="is not this file: CRC-32C .* the row stays "
                           "Quarantined"):
            await restore_file(tier, bad.file_id)
        with pytest.raises(LakeFileCorrupt, match="already holds another object"):
            await restore_file(tier, bad.file_id, backup)
        assert (await tier.catalog.get(bad.file_id)).state is FileState.QUARANTINED  # type: ignore[union-attr]
        # A crash between the quarantine's row change and its delete leaves such an object:
        # the next scrub pass finishes the move (the damaged bytes go to quarantine/).
        await tier.store.delete(QUARANTINE_PREFIX + bad.object_key)
        report = await scrub_pass(tier, rate_bytes_per_s=100e6)
        assert not report.failures and not path.exists()
        assert await tier.store.read(QUARANTINE_PREFIX + bad.object_key) == \
            damaged(backup.read_bytes())
        done = await restore_file(tier, bad.file_id, backup)
        assert done.changed


@pytest.mark.asyncio
async def test_forget_records_the_loss_once_and_restore_still_works(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path / "d") as tier:
        bad, backup, rows = await quarantine_one(tier, tmp_path)
        with pytest.raises(StateConflict, match="only a quarantined file can be forgotten"):
            await forget_file(tier, rows[0].file_id)
        row, moved = await forget_file(tier, bad.file_id)
        assert moved and row.state is FileState.LOST
        row, moved = await forget_file(tier, bad.file_id)
        assert not moved and row.state is FileState.LOST
        with pytest.raises(ConfigError, match="no lake file 'NOPE'"):
            await forget_file(tier, "NOPE")
        # A backup put at a Lost file's key is kept too: it can still be restored.
        path = tier.data.objects / bad.object_key
        path.write_bytes(backup.read_bytes())
        assert (await sweep(tier, now_ns=far_future(tier))).orphan_objects == []
        assert path.exists()
        path.unlink()
        done = await restore_file(tier, bad.file_id, backup)
        assert done.changed
        await assert_live(tier, bad, rows)


@pytest.mark.asyncio
async def test_restore_s3_postgres(tmp_path: Path, pg_catalog_dsn: str,
                                   s3_bucket: dict[str, str], s3_server: Any) -> None:
    store = StoreConfig(scheme="s3", root="/lake", options=s3_bucket, max_attempts=2)
    async with open_test_tier(tmp_path / "d", store=store, dsn=pg_catalog_dsn) as tier:
        bad, backup, rows = await quarantine_one(tier, tmp_path, s3=s3_server.client(),
                                                 bucket=s3_bucket["bucket"])
        assert await tier.store.stat(bad.object_key) is None
        done = await restore_file(tier, bad.file_id, backup)
        assert done.changed
        await assert_live(tier, bad, rows)
        report = await sweep(tier, now_ns=far_future(tier))
        assert bad.object_key not in report.orphan_objects
        assert await check_object(tier, bad) is None
