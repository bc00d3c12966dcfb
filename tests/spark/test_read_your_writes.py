"""Read your writes (SPEC §7): after ``save()`` returns, ``spark.read.format("quiver")`` in
the same session sees every row, with the DEFAULT lake config (``lake.file_duration_ms``
5 min, ``segment.max_open_duration_ms`` 1 s): the commit waits for the catalog, no timer.
Real daemons, real Spark (local mode), SQLite + fs, and PostgreSQL for two daemons."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

pytestmark = pytest.mark.timeout(180)
DEFAULT_LAKE = {"shards": 2, "lake.enabled": True, "lake.janitor.interval_s": 0,
                "lake.compaction.interval_s": 0}


def test_visible_timeout_option_default_range_and_refusals() -> None:
    from quiverd.spark.writer import WriteOptions

    assert WriteOptions.parse({}).visible_timeout_s == 60.0
    assert WriteOptions.parse({"VISIBLE_TIMEOUT_S": "2.5"}).visible_timeout_s == 2.5
    assert WriteOptions.parse({"visible_timeout_s": "0"}).visible_timeout_s == 0.0
    for bad in ("-1", "soon", "3601"):
        with pytest.raises(ValueError, match="visible_timeout_s"):
            WriteOptions.parse({"visible_timeout_s": bad})


def hashed(spark: Any, start: int, rows: int, partitions: int) -> Any:
    from pyspark.sql import functions as F

    return spark.range(start, start + rows, 1, partitions).select(
        "id", F.pmod(F.xxhash64("id"), F.lit(1_000_003)).alias("h"))


def summary(df: Any) -> tuple[int, int, int]:
    from pyspark.sql import functions as F

    row = df.agg(F.count("*"), F.sum("h"), F.sum("id")).first()  # one pass, no shuffle
    return int(row[0]), int(row[1] or 0), int(row[2] or 0)


def read(spark: Any, d: Any, client: str) -> Any:
    return (spark.read.format("quiver").option("config", str(d.config_path))
            .option("client", client).load())


def test_read_your_writes_default_lake_config_every_row_at_once(daemon_factory: Any,
                                                                spark: Any) -> None:
    d = daemon_factory(DEFAULT_LAKE).start()
    first = hashed(spark, 0, 30_000, 4)
    started = time.monotonic()
    first.write.format("quiver").mode("append").option("path", str(d.socket)) \
        .option("client", "ryw").save()
    saved_s = time.monotonic() - started
    assert summary(read(spark, d, "ryw")) == summary(first)  # right after save()
    second = hashed(spark, 30_000, 20_000, 3)
    second.write.format("quiver").mode("append").option("path", str(d.socket)) \
        .option("client", "ryw").save()
    assert summary(read(spark, d, "ryw")) == summary(first.unionAll(second))
    assert saved_s < 60, saved_s  # not the 5 min file timer
    visible = d.events("job_visible")
    assert len(visible) == 2 and all(e["bundles"] >= 1 for e in visible), visible
    assert d.stop() == 0


def test_read_your_writes_streaming_micro_batches(daemon_factory: Any, spark: Any,
                                                  tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = daemon_factory(DEFAULT_LAKE).start()
    source = tmp_path / "in"
    source.mkdir()
    pq.write_table(pa.table({"id": pa.array(range(500), pa.int64())}), source / "a.parquet")
    stream = spark.readStream.schema("id long").parquet(str(source))
    query = (stream.writeStream.format("quiver").option("path", str(d.socket))
             .option("client", "streamed").option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    query.awaitTermination(120)
    assert read(spark, d, "streamed").count() == 500  # the micro-batch's commit waited
    assert d.events("job_visible")
    assert d.stop() == 0


def test_read_your_writes_two_daemons_paths(daemon_factory: Any, spark: Any,
                                            pg_catalog_dsn: str, tmp_path: Path) -> None:
    # Two "hosts" sharing one catalog and one store: each holds half of the partitions,
    # and the driver's commit waits for both.
    store = tmp_path / "store"
    store.mkdir()
    shared = {**DEFAULT_LAKE, "catalog.dsn": pg_catalog_dsn, "lake.store.root": str(store)}
    a = daemon_factory({**shared, "lake.node_id": "host-a"}, name="a").start()
    b = daemon_factory({**shared, "lake.node_id": "host-b"}, name="b").start()
    df = hashed(spark, 0, 40_000, 4)
    df.write.format("quiver").mode("append").option("paths", f"{a.socket},{b.socket}") \
        .option("client", "spread").save()
    assert summary(read(spark, a, "spread")) == summary(df)
    assert a.events("job_visible") and b.events("job_visible")
    assert [e["bundles"] >= 1 for e in a.events("job_visible") + b.events("job_visible")] \
        == [True, True]
    for d in (a, b):
        assert d.stop() == 0
