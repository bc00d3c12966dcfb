"""Damaged and missing lake objects through ``spark.read.format("quiver")``: a real
`quiverd serve` writes the files (SQLite + fs), the test damages or removes one object
on disk, and Spark must fail with one clear error naming it, never return wrong values."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pyarrow.parquet as pq
import pytest

from quiverd.kernel.config import load as load_config
from quiverd.kernel.logs import get as get_logger
from quiverd.lake.scrub import quarantine_file
from quiverd.lake.tier import open_tier

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from tests.daemon.lake_damage import (  # noqa: E402
    ROWS,
    flip_in_data_page,
    floats,
    send_files,
)
from tests.daemon.lake_helpers import FAST_LAKE, uri_path  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def load(spark: Any, d: Any, **options: str) -> Any:
    reader = spark.read.format("quiver").option("config", str(d.config_path))
    for name, value in {"client": "floats", **options}.items():
        reader = reader.option(name, value)
    return reader.load()


def test_reader_damaged_page_fails_with_checksum_error_not_wrong_values(
        daemon_factory: Any, spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    first, second = send_files(d, 2)
    path = uri_path(second.uri)
    flip_in_data_page(path)
    # Without page checksums the damage reads back as wrong values, with no error.
    plain = pq.read_table(path)
    assert plain["x"].to_numpy().tolist() != floats(1)["x"].to_numpy().tolist()
    with pytest.raises(Exception) as caught:
        load(spark, d).select("seed", "x").collect()
    text = str(caught.value)
    assert f"lake file {second.file_id} ({second.uri}) failed its page checksum" in text
    assert "lake scrub quarantines" in text or "quiverd fsck" in text
    assert first.file_id not in text
    assert d.stop() == 0


def test_reader_missing_object_fails_with_one_clear_message(daemon_factory: Any,
                                                            spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    first, second = send_files(d, 2)
    Path(uri_path(second.uri)).unlink()  # the second: the schema comes from the first
    with pytest.raises(Exception) as caught:
        load(spark, d).count()
    text = str(caught.value)
    assert (f"lake file {second.file_id} ({second.uri}) is registered in the catalog but "
            "missing from the object store: put the object back with `quiverd files "
            "restore") in text
    assert "opendal" not in text.lower() and "NotFound" not in text
    Path(uri_path(first.uri)).unlink()  # now the schema's own footer is gone too
    with pytest.raises(Exception, match=f"lake file {first.file_id} .* is registered in the "
                       "catalog but missing"):
        _ = load(spark, d).schema
    assert d.stop() == 0


def test_reader_quarantined_file_fails_the_read_unless_skipped(daemon_factory: Any,
                                                               spark: Any) -> None:
    # The daemon's own lake scrub finds the damage, quarantines the file and says so.
    d = daemon_factory({**FAST_LAKE, "shards": 1, "lake.scrub.pass_interval_s": 1,
                        "lake.scrub.rate_mb_per_s": 100}).start()
    first, second, third = send_files(d, 3)
    flip_in_data_page(uri_path(second.uri))
    deadline = time.monotonic() + 60
    while not (events := d.events("lake_object_corrupt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    [event] = events
    assert event["file_id"] == second.file_id and event["level"] == "error"
    assert event["reason"].startswith("CRC-32C ") and event["rows"] == second.row_count
    assert "rows are no longer in the lake" in event["hint"]
    # Its segments were deleted once the lake (the only subscriber) acked them.
    assert event["segments_still_held"] == [] and "re-ingest them" in event["hint"]
    status = d.status()
    assert status["lake"]["errors"]["corrupt_object"] == 1
    assert not Path(uri_path(second.uri)).exists()
    assert (d.data_dir / "objects" / "quarantine" / second.object_key).exists()

    with pytest.raises(Exception) as caught:
        _ = load(spark, d).schema
    text = str(caught.value)
    assert f"lake file {second.file_id} ({ROWS} rows) failed an integrity check and is " \
        "quarantined" in text and 'option("skip_quarantined", "true")' in text
    rest = load(spark, d, skip_quarantined="true").select("seed").collect()
    assert sorted({r[0] for r in rest}) == [0, 2] and len(rest) == 2 * ROWS
    assert first.file_id != third.file_id
    assert d.stop() == 0


def test_reader_skip_quarantined_keeps_the_columns_of_a_client_with_no_other_file(
        daemon_factory: Any, spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    [only] = send_files(d, 1)
    assert d.stop() == 0
    flip_in_data_page(uri_path(only.uri))

    async def quarantine() -> None:  # what the lake scrub does on finding the damage
        async with open_tier(load_config(d.config_path), get_logger("test")) as tier:
            assert await quarantine_file(tier, only, "CRC-32C mismatch (test)")

    anyio.run(quarantine)
    df = load(spark, d, skip_quarantined="true")
    assert {"seed", "x"} <= set(df.columns)  # the client's columns, from its footer
    assert df.select("seed", "x").collect() == []  # no rows, not an unknown column
    assert df.where("seed > 0").count() == 0
    with pytest.raises(Exception, match="is quarantined"):
        _ = load(spark, d).schema  # not skipped: the read still refuses it


def test_read_parquet_fast_path_verifies_page_checksums(daemon_factory: Any,
                                                        spark: Any) -> None:
    from quiverd.spark.paths import read_parquet

    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    [row] = send_files(d, 1)
    assert read_parquet(spark, str(d.config_path), client="floats").count() == ROWS
    flip_in_data_page(uri_path(row.uri))
    with pytest.raises(Exception, match="CRC checksum verification failed"):
        read_parquet(spark, str(d.config_path), client="floats").select("x").collect()
    assert d.stop() == 0
