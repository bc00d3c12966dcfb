"""Issue 20's lake file format as Spark reads it: Spark's own ``spark.read.parquet`` on
files the real uploader wrote, with no option; quiverd's reader (``format("quiver")``
and ``read_parquet``) on a lake holding files of the old format (ns ingestion time,
unsigned ids) next to new ones, presenting today's types."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.lake.model import (  # noqa: E402 - after the skip
    BUNDLE_COLUMN,
    INGESTED_AT,
    SEGMENT_COLUMN,
    SHARD_COLUMN,
)
from quiverd.spark.paths import NANOS_AS_LONG, read_parquet  # noqa: E402
from tests.actors.test_uploader import ROTATE_EACH, delivery, registered, running  # noqa: E402
from tests.daemon.lake_helpers import uri_path  # noqa: E402
from tests.lake.helpers import add_file, open_test_tier  # noqa: E402
from tests.lake.legacy_files import add_legacy_file  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TYPES = {INGESTED_AT: "timestamp", SHARD_COLUMN: "int", SEGMENT_COLUMN: "bigint",
         BUNDLE_COLUMN: "bigint"}
TS_NS = 1_700_000_000_000_000_000


def _uploaded(root: Path) -> list[str]:
    """Two bundles through the real uploader (one file each): local paths of the files."""

    async def go() -> list[str]:
        async with open_test_tier(root, **ROTATE_EACH) as tier, \
                running(tier) as (acks, _, tx):
            for i in range(2):
                at = pa.array([TS_NS + 1_000 * i, None], pa.timestamp("ns", "UTC"))
                await tx.send(delivery(5, i, {0: pa.table({"v": [10 * i, 10 * i + 1],
                                                           "at": at})}))
            await acks.until(lambda o: len(o) == 2)
            return sorted(uri_path(f.uri) for f in await registered(tier))

    return anyio.run(go)


def test_spark_read_parquet_reads_new_files_with_no_option(spark: Any, tmp_path: Path
                                                           ) -> None:
    from pyspark.sql import functions as F

    spark.conf.unset(NANOS_AS_LONG)
    paths = _uploaded(tmp_path)
    assert len(paths) == 2
    df = spark.read.parquet(*paths)  # Spark's own reader: no nanosAsLong, no option
    assert {c: t for c, t in df.dtypes if c in TYPES} == TYPES
    assert dict(df.dtypes)["at"] == "timestamp" and dict(df.dtypes)["v"] == "bigint"
    got = sorted(map(tuple, df.select("v", F.unix_micros("at"), F.unix_micros(INGESTED_AT),
                                      SHARD_COLUMN, SEGMENT_COLUMN, BUNDLE_COLUMN).collect()))
    want = sorted(tuple(r.values()) for p in paths for r in pq.read_table(p).select(
        ["v", "at", INGESTED_AT, SHARD_COLUMN, SEGMENT_COLUMN, BUNDLE_COLUMN]
    ).cast(pa.schema([("v", pa.int64()), ("at", pa.int64()), (INGESTED_AT, pa.int64()),
                      (SHARD_COLUMN, pa.int32()), (SEGMENT_COLUMN, pa.int64()),
                      (BUNDLE_COLUMN, pa.int64())])).to_pylist())
    assert got == want and len(got) == 4
    assert [r[1] for r in got] == [TS_NS // 1000, None, TS_NS // 1000 + 1, None]
    assert spark.conf.get(NANOS_AS_LONG) == "false"  # never set


def test_reader_reads_old_and_new_files_as_the_new_types(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    root = tmp_path / "lake"

    async def build() -> None:
        async with open_test_tier(root) as tier:
            await add_legacy_file(tier, pa.table({"v": [1, 2]}), segment=2**40,
                                  bundle=2**32 - 1, ts_ns=TS_NS + 1_999)
            await add_file(tier, pa.table({"v": [3]}), segment=2**40 + 1, ts_ns=TS_NS + 5_000)
            await add_file(tier, pa.table({"v": [7]}), client="fresh", segment=9, ts_ns=TS_NS)

    anyio.run(build)
    config = tmp_path / "config.toml"
    config.write_text(f'data_dir = "{root}"\n')
    want = [(1, 2**40, 2**32 - 1, (TS_NS + 1_999) // 1000),  # truncated to µs
            (2, 2**40, 2**32 - 1, (TS_NS + 1_999) // 1000),
            (3, 2**40 + 1, 0, (TS_NS + 5_000) // 1000)]
    cols = ["v", SEGMENT_COLUMN, BUNDLE_COLUMN, F.unix_micros(INGESTED_AT)]
    via = spark.read.format("quiver").option("config", str(config)).load("app")
    assert {c: t for c, t in via.dtypes if c in TYPES} == TYPES
    assert sorted(map(tuple, via.select(*cols).collect())) == want
    spark.conf.unset(NANOS_AS_LONG)
    fresh = read_parquet(spark, str(config), client="fresh")  # new files only
    assert spark.conf.get(NANOS_AS_LONG) == "false"  # never set
    assert fresh.select("v", SEGMENT_COLUMN).collect()[0] == (7, 9)
    native = read_parquet(spark, str(config), client="app")  # the old file: nanosAsLong
    assert {c: t for c, t in native.dtypes if c in TYPES} == TYPES
    assert sorted(map(tuple, native.select(*cols).collect())) == want
