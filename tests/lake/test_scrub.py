"""The lake scrub on real files: lake files written, uploaded and registered as the
uploader does (fs store + SQLite, S3 on moto + PostgreSQL), one object damaged in place
(32 bytes flipped inside a data page), then a pass: the damaged file is quarantined
and reported, the others are left alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.kernel.config import StoreConfig
from quiverd.kernel.errors import LakeFileCorrupt
from quiverd.kernel.metrics import Metrics
from quiverd.lake.model import REGISTERED, FileRow, FileState
from quiverd.lake.scrub import QUARANTINE_PREFIX, check_object, scrub_pass
from quiverd.lake.tier import Tier
from quiverd.lake.verified import read_verified
from quiverd_actors.janitor import Janitor
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import LOG, add_file, open_test_tier

ROWS = 20_000


def floats(seed: int) -> pa.Table:
    return pa.table({"seed": pa.array([seed] * ROWS, pa.int64()),
                     "x": np.random.default_rng(seed).random(ROWS)})


def damaged(data: bytes, column: str = "x", nbytes: int = 32) -> bytes:
    """``data`` (a Parquet file) with ``nbytes`` flipped 4 KiB into a page of ``column``."""
    meta = pq.read_metadata(pa.BufferReader(data))
    leaf = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == column)
    chunk = meta.row_group(0).column(leaf)
    at = (chunk.dictionary_page_offset or chunk.data_page_offset) + 4096
    assert chunk.total_compressed_size > 8192
    out = bytearray(data)
    out[at:at + nbytes] = bytes(b ^ 0x5A for b in out[at:at + nbytes])
    return bytes(out)


def overwrite(path: Path, data: bytes) -> None:
    os.chmod(path, 0o640)
    with open(path, "wb") as f:
        f.write(data)


async def files(tier: Tier) -> list[FileRow]:
    return [await add_file(tier, floats(i), segment=i, keep_local=False) for i in range(3)]


async def assert_quarantined(tier: Tier, bad: FileRow, good: list[FileRow],
                             original: bytes) -> None:
    row = await tier.catalog.get(bad.file_id)
    assert row is not None and row.state is FileState.QUARANTINED
    assert await tier.store.stat(bad.object_key) is None  # moved out of the readers' way
    kept = await tier.store.read(QUARANTINE_PREFIX + bad.object_key)
    assert kept == damaged(original)  # the damaged bytes, kept for a post-mortem
    live = {r.file_id for r in await tier.catalog.list_files(states=REGISTERED)}
    assert live == {r.file_id for r in good}
    for r in good:
        assert await check_object(tier, r) is None


@pytest.mark.asyncio
async def test_scrub_fs_quarantines_damaged_object_and_reports_it(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path) as tier:
        rows = await files(tier)
        bad = rows[1]
        path = Path(uri_path(bad.uri))
        original = await tier.store.read(bad.object_key)
        await anyio.to_thread.run_sync(overwrite, path, damaged(original))
        # Read with page checksums, the damage is an error naming the file, not values.
        with pytest.raises(LakeFileCorrupt, match=f"lake file {bad.file_id} .* failed its "
                           "page checksum"):
            read_verified(path, file_id=bad.file_id, uri=bad.uri)

        dry = await scrub_pass(tier, rate_bytes_per_s=100e6, quarantine=False)
        assert [c.file_id for c in dry.corrupt] == [bad.file_id]
        assert dry.corrupt[0].reason.startswith("CRC-32C ") and not dry.corrupt[0].quarantined_to
        assert (await tier.catalog.get(bad.file_id)).state is FileState.META_REGISTERED  # type: ignore[union-attr]

        m = Metrics()
        janitor = Janitor(tier, log=LOG, metrics=m)
        report = await janitor.scrub_once()
        assert report.files_checked == 3 and not report.failures and not report.missing
        [found] = report.corrupt
        assert found.file_id == bad.file_id
        assert found.quarantined_to == tier.store.uri(QUARANTINE_PREFIX + bad.object_key)
        assert m.lake_objects_corrupt.total() == 1
        assert m.lake_errors.by_label("kind")["corrupt_object"] == 1
        await assert_quarantined(tier, bad, [rows[0], rows[2]], original)
        again = await janitor.scrub_once()  # the quarantined file is no longer checked
        assert again.files_checked == 2 and not again.corrupt


@pytest.mark.asyncio
async def test_scrub_reports_a_truncated_object_by_size(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path) as tier:
        rows = await files(tier)
        path = Path(uri_path(rows[0].uri))
        os.chmod(path, 0o640)
        os.truncate(path, rows[0].compressed_size - 100)
        assert await check_object(tier, rows[0]) == (
            f"{rows[0].compressed_size - 100} bytes in the store, the catalog says "
            f"{rows[0].compressed_size}")
        await anyio.to_thread.run_sync(path.unlink)
        report = await scrub_pass(tier, rate_bytes_per_s=100e6)
        assert report.missing == [rows[0].file_id] and not report.corrupt


@pytest.mark.asyncio
async def test_scrub_s3_postgres_quarantines_damaged_object(
        tmp_path: Path, pg_catalog_dsn: str, s3_bucket: dict[str, str], s3_server: Any
        ) -> None:
    store = StoreConfig(scheme="s3", root="/lake", options=s3_bucket, max_attempts=2)
    async with open_test_tier(tmp_path, store=store, dsn=pg_catalog_dsn) as tier:
        rows = await files(tier)
        bad = rows[2]
        original = await tier.store.read(bad.object_key)
        client = s3_server.client()
        await anyio.to_thread.run_sync(lambda: client.put_object(
            Bucket=s3_bucket["bucket"], Key=f"lake/{bad.object_key}", Body=damaged(original)))
        report = await scrub_pass(tier, rate_bytes_per_s=100e6)
        assert [c.file_id for c in report.corrupt] == [bad.file_id]
        assert report.corrupt[0].quarantined_to.startswith("s3://")
        await assert_quarantined(tier, bad, rows[:2], original)


def test_scrub_config_is_validated() -> None:
    from quiverd.kernel.config import Config, LakeConfig, LakeScrubConfig, validate
    from quiverd.kernel.errors import ConfigError

    validate(Config(lake=LakeConfig(scrub=LakeScrubConfig(rate_mb_per_s=0))))  # off is fine
    with pytest.raises(ConfigError, match="lake.scrub.rate_mb_per_s"):
        validate(Config(lake=LakeConfig(scrub=LakeScrubConfig(rate_mb_per_s=-1))))
    with pytest.raises(ConfigError, match="lake.scrub.pass_interval_s"):
        validate(Config(lake=LakeConfig(scrub=LakeScrubConfig(pass_interval_s=-1))))


@pytest.mark.asyncio
async def test_compaction_refuses_a_damaged_input(tmp_path: Path) -> None:
    from quiverd.lake.compaction import compact

    # The local copy (compaction hard-links it instead of downloading) is damaged: only
    # the catalog's CRC-32C can tell (a download is also checked against the store's).
    async with open_test_tier(tmp_path) as tier:
        rows = [await add_file(tier, floats(i), segment=i) for i in range(3)]
        bad = rows[0]
        original = await tier.store.read(bad.object_key)
        await anyio.to_thread.run_sync(overwrite, Path(bad.local_path), damaged(original))
        [result] = await compact(tier, limiter=anyio.CapacityLimiter(1), log=LOG)
        assert result.outcome == "failed"
        assert f"LakeFileCorrupt: lake file {bad.file_id}" in result.error
        assert "the catalog says" in result.error
        live = await tier.catalog.list_files(states=REGISTERED)
        assert sorted(r.file_id for r in live) == sorted(r.file_id for r in rows)


@pytest.mark.asyncio
async def test_scrub_passes_keep_their_pace_across_restarts(tmp_path: Path) -> None:
    from quiverd.kernel.config import LakeScrubConfig

    day = 86_400
    async with open_test_tier(tmp_path, scrub=LakeScrubConfig(pass_interval_s=day)) as tier:
        janitor = Janitor(tier, log=LOG, metrics=Metrics())
        assert await janitor._scrub_due_in() == 60  # no pass ever: soon after the start
        await janitor._scrub_pass()  # records its start in <data_dir>/lake.scrub first
        assert tier.data.lake_scrub.exists()
        # A restarted daemon (a new Janitor) waits for the rest of the interval.
        due = await Janitor(tier, log=LOG, metrics=Metrics())._scrub_due_in()
        assert day - 60 < due <= day


def test_read_verified_damaged_footer_is_lake_file_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "f.parquet"
    pq.write_table(floats(1), path, write_page_checksum=True)
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    at = len(data) - 8 - footer_len + 8  # inside the footer's thrift bytes
    data[at:at + 32] = bytes(b ^ 0x5A for b in data[at:at + 32])
    path.write_bytes(bytes(data))
    with pytest.raises(LakeFileCorrupt, match="lake file F1 .*: .*none of its rows"):
        read_verified(path, file_id="F1", uri="s3://b/k")


@pytest.mark.asyncio
async def test_scrub_pass_cut_short_by_a_restart_resumes_after_its_last_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart during a pass must neither start over (a daemon restarted often would
    never reach the lake's end) nor leave the rest for another interval (the bound on a
    damaged object's exposure would double): the pass goes on after its last file."""
    import time

    from quiverd.kernel.config import LakeScrubConfig
    from quiverd.lake import scrub as scrub_module

    monkeypatch.setattr(scrub_module, "PROGRESS_EVERY_S", 0.0)
    day = 86_400
    async with open_test_tier(tmp_path, scrub=LakeScrubConfig(pass_interval_s=day)) as tier:
        rows = sorted(await files(tier), key=lambda r: r.file_id)
        noted: list[str] = []

        async def progress(file_id: str) -> None:
            noted.append(file_id)

        await scrub_pass(tier, rate_bytes_per_s=100e6, progress=progress)
        assert noted == [rows[0].file_id, rows[1].file_id]  # each one once it is done

        start = time.time_ns() - 10 * 1_000_000_000
        tier.data.lake_scrub.write_text(f"{start} {rows[0].file_id}\n")  # cut after one
        janitor = Janitor(tier, log=LOG, metrics=Metrics())
        assert await janitor._scrub_due_in() == 60  # soon, not a day later
        report = await janitor._scrub_pass()
        assert report.files_checked == 2  # the two after the cut, not the first again
        assert tier.data.lake_scrub.read_text() == f"{start} done\n"
        due = await Janitor(tier, log=LOG, metrics=Metrics())._scrub_due_in()
        assert day - 70 < due <= day - 10  # the next pass keeps the original start's pace
        tier.data.lake_scrub.write_text(f"{start}\n")  # the format before: a finished pass
        due = await Janitor(tier, log=LOG, metrics=Metrics())._scrub_due_in()
        assert day - 70 < due <= day - 10
