"""``spark.read.format("quiver")`` on real parts: a `quiverd serve` puts rows into the lake
(SQLite + fs, or PostgreSQL + S3), Spark reads them back through the reader."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.lake.drift import unify  # noqa: E402
from quiverd.lake.model import INGESTED_AT, FileRow, FileState, ZoneMap  # noqa: E402
from quiverd.spark.reader import (  # noqa: E402
    TRACE_FILE,
    Bound,
    Selection,
    may_match,
    spark_schema,
    to_bound,
    to_spark,
)
from quiverd.spark.types import filter_types  # noqa: E402
from tests.daemon.lake_helpers import (  # noqa: E402
    FAST_LAKE,
    lake_contents,
    logs_table,
    read_object,
    registered_rows,
    send_logs,
    wait_for_lake,
)
from tests.daemon.test_lake_pg_s3 import _s3_settings  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _load(spark: Any, d: Any, client: str, **options: Any) -> Any:
    reader = spark.read.format("quiver").option("config", str(d.config_path))
    reader = reader.option("client", client)
    for name, value in options.items():
        reader = reader.option(name, value)
    return reader.load()


def _opened(spark: Any, d: Any, trace: Path, where: str = "", **options: Any
            ) -> tuple[int, set[str]]:
    """Rows a query returns, and the object keys its reads opened."""
    df = _load(spark, d, "client-0", _trace_dir=str(trace), **options)
    count = (df.where(where) if where else df).count()
    lines = (trace / TRACE_FILE).read_text().split() if (trace / TRACE_FILE).exists() else []
    assert len(lines) == len(set(lines)), f"an object opened twice: {lines}"
    return count, set(lines)


def _checksum(t: pa.Table) -> tuple[int, int, int]:
    rows = t.select(["batch", "i"]).to_pylist()
    return len(rows), sum(r["batch"] * 1000 + r["i"] for r in rows), len(
        {(r["batch"], r["i"]) for r in rows})


def test_reader_embedded_reads_back_what_was_sent(daemon_factory: Any, spark: Any) -> None:
    from pyspark.sql import functions as F

    d = daemon_factory({**FAST_LAKE}).start()
    sent = send_logs(d, clients=2, batches=6)
    rows = wait_for_lake(d, sent)
    df = _load(spark, d, "client-0")
    types = dict(df.dtypes)
    assert types["client_no"] == "int" and types["batch"] == "bigint"
    assert types["msg"] == "string" and types[INGESTED_AT] == "timestamp"
    want = pa.concat_tables([logs_table(0, b) for b in range(6)])
    got = df.agg(F.count("*"), F.sum(F.col("batch") * 1000 + F.col("i")),
                 F.count_distinct("batch", "i")).first()
    assert tuple(got) == _checksum(want) and got[0] == sent[("client-0", 0)]
    assert sorted(map(tuple, df.select("client_no", "batch", "i", "msg").collect())) == \
        sorted(tuple(r.values()) for r in want.to_pylist())
    # Timestamps: the stored microseconds, in UTC.
    mine = [r for r in rows if (r.client_name, r.slot) == ("client-0", 0)]
    stored = [v for r in mine for v in read_object(r)[INGESTED_AT].cast(pa.int64()).to_pylist()]
    micros = sorted(r[0] for r in df.select(F.unix_micros(INGESTED_AT)).collect())
    assert micros == sorted(stored)
    first = datetime.fromtimestamp(micros[0] / 1e6, UTC)
    text = df.select(F.date_format(F.min(INGESTED_AT), "yyyy-MM-dd HH:mm:ss")).first()[0]
    assert text == first.strftime("%Y-%m-%d %H:%M:%S")  # rendered in UTC
    assert abs(first.timestamp() - time.time()) < 300
    # Another (client, slot): its own schema, its own rows.
    side = _load(spark, d, "client-1", slot=1)
    assert side.count() == sent[("client-1", 1)]
    assert {"batch", "note", INGESTED_AT} <= set(side.columns) and "msg" not in side.columns
    # A client the lake has never seen: refused, naming the closest one (a typo must not
    # read as an empty hour); a name no writer could use: refused before the catalog.
    with pytest.raises(Exception, match=r"the lake has no file of client 'client-9'; did you "
                                        r"mean \"client-[01]\"\?"):
        _load(spark, d, "client-9").count()
    with pytest.raises(Exception, match=r'load\("some/path"\): client name \'some/path\' must '
                                        r"match .*load\(\) takes a client name, not a path"):
        spark.read.format("quiver").option("config", str(d.config_path)).load("some/path")
    with pytest.raises(Exception, match=r'option "client": client name \'a b\' must match'):
        _load(spark, d, "a b").count()
    assert d.stop() == 0


def test_reader_schema_drift_reads_as_one_schema_with_nulls(daemon_factory: Any,
                                                             spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    words = pa.array(["a", "b", "c", "a"])
    tables = [
        pa.table({"k": pa.array([1, 2, 3, 4], pa.int32()), "w": words}),
        pa.table({"k": pa.array([5, 6, 7, 8], pa.int64()),
                  "w": words.dictionary_encode().cast(pa.dictionary(pa.uint8(), pa.utf8())),
                  "extra": pa.array([0.5, None, 1.5, 2.5])}),
        pa.table({"w": words.dictionary_encode().cast(pa.dictionary(pa.uint16(), pa.utf8()))}),
    ]
    sent: Counter[tuple[str, int]] = Counter()
    with Client.connect(d.socket) as c:
        for t in tables:  # one file each: the next is sent once the last is registered
            c.send(t, client="drift")
            sent[("drift", 0)] += t.num_rows
            rows = wait_for_lake(d, sent)
    assert len({r.schema_hash for r in rows}) == 3, rows
    df = _load(spark, d, "drift")
    types = dict(df.dtypes)
    assert (types["k"], types["w"], types["extra"]) == ("bigint", "string", "double")
    got = sorted(map(tuple, df.select("k", "w", "extra").collect()), key=str)
    want = ([(k, w, None) for k, w in zip(range(1, 5), "abca", strict=True)]
            + [(5, "a", 0.5), (6, "b", None), (7, "c", 1.5), (8, "a", 2.5)]
            + [(None, w, None) for w in "abca"])
    assert got == sorted(want, key=str)
    assert d.stop() == 0


def _wait_indexed(d: Any, timeout: float = 20) -> list[FileRow]:
    deadline = time.monotonic() + timeout
    while True:
        rows = registered_rows(d)
        if all(r.state != FileState.META_REGISTERED for r in rows):
            return rows
        assert time.monotonic() < deadline, [r.state for r in rows]
        time.sleep(0.1)


def test_reader_time_and_zone_map_filters_open_only_matching_files(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1,
                        "lake.index.zone_map_columns": ["batch"]}).start()
    sent: Counter[tuple[str, int]] = Counter()
    for wave in range(3):  # batches 2w, 2w+1: one file per wave, in time order
        sent.update(send_logs(d, clients=1, batches=2, start=2 * wave, two_slots_every=0))
        wait_for_lake(d, sent)
    rows, tables = lake_contents(d)
    rows = sorted(_wait_indexed(d), key=lambda r: r.start_ts)
    batches = {r.object_key: set(tables[r.file_id]["batch"].to_pylist()) for r in rows}
    everything = {r.object_key for r in rows}
    assert len(everything) >= 3

    count, opened = _opened(spark, d, tmp_path / "all")
    assert (count, opened) == (300, everything)
    # Zone maps (min/max of `batch` per file): only files that may hold the values.
    count, opened = _opened(spark, d, tmp_path / "eq", "batch = 3")
    assert count == 50 and opened == {k for k, b in batches.items() if 3 in b} != everything
    count, opened = _opened(spark, d, tmp_path / "in", "batch IN (0, 5)")
    assert count == 100 and opened == {k for k, b in batches.items() if b & {0, 5}}
    assert opened != everything
    # The time column, by the catalog's start_ts/end_ts: the last wave only, then the first.
    last, first = rows[-1], rows[0]
    cut = _timestamp(last.start_ts)
    count, opened = _opened(spark, d, tmp_path / "ge", f"{INGESTED_AT} >= '{cut}'")
    assert opened == {r.object_key for r in rows if r.end_ts >= last.start_ts // 1000 * 1000}
    assert count == sum(r.row_count for r in rows if r.start_ts >= last.start_ts // 1000 * 1000)
    assert opened != everything
    cut = _timestamp(first.end_ts + 1000)
    count, opened = _opened(spark, d, tmp_path / "lt", f"{INGESTED_AT} < '{cut}'")
    assert opened == {r.object_key for r in rows if r.start_ts <= first.end_ts}
    assert count == sum(r.row_count for r in rows if r.end_ts <= first.end_ts)
    # since/until options select files by the catalog and rows by the time column.
    middle = rows[len(rows) // 2]
    count, opened = _opened(spark, d, tmp_path / "range", since=str(middle.start_ts),
                            until=str(middle.end_ts + 1))
    assert opened == {middle.object_key} and count == middle.row_count
    assert d.stop() == 0


def _timestamp(ns: int) -> str:
    """A Spark timestamp literal (UTC session) for ``ns``, truncated to microseconds."""
    return datetime.fromtimestamp(ns // 1000 / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def test_reader_postgres_s3_reads_back_what_was_sent(
        daemon_factory: Any, spark: Any, pg_catalog_dsn: str, s3_bucket: dict[str, str],
        s3_server: Any, tmp_path: Path) -> None:
    d = daemon_factory({**FAST_LAKE, "catalog.dsn": pg_catalog_dsn,
                        **_s3_settings(s3_bucket)}).start()
    sent = send_logs(d, clients=2, batches=4)
    wait_for_lake(d, sent)
    rows, tables = lake_contents(d, s3_server.client())
    want = pa.concat_tables([tables[r.file_id].select(["batch", "i"]) for r in rows
                             if (r.client_name, r.slot) == ("client-0", 0)])
    df = _load(spark, d, "client-0", _trace_dir=str(tmp_path))
    got = sorted(map(tuple, df.select("batch", "i").collect()))
    assert _checksum(pa.table({"batch": [b for b, _ in got], "i": [i for _, i in got]})) \
        == _checksum(want)
    assert len(got) == sent[("client-0", 0)]
    opened = set((tmp_path / TRACE_FILE).read_text().split())
    assert opened == {r.object_key for r in rows if (r.client_name, r.slot) == ("client-0", 0)}
    assert d.stop() == 0


# ---- the reader's pure parts (no daemon, no Spark session) --------------------------------

def test_reader_package_import_leaves_pyspark_unimported() -> None:
    code = "import sys, quiverd.spark; assert 'pyspark' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_reader_options_client_required_range_checked() -> None:
    with pytest.raises(ValueError, match='"client" is required'):
        Selection.parse({"slot": "1"})
    sel = Selection.parse({"client": "web", "since": "2025-01-01T00:00:00Z", "until": "5"
                           + "0" * 18})
    assert sel.since_ns == 1_735_689_600 * 10**9 and sel.until_ns == 5 * 10**18
    assert Selection.parse({"client": "w", "since": "2025-01-01T00:00:00"}).since_ns == \
        sel.since_ns  # naive means UTC
    with pytest.raises(ValueError, match="must be after"):
        Selection.parse({"client": "w", "since": "10", "until": "10"})


def test_reader_to_spark_decodes_truncates_widens_fills_nulls() -> None:
    batch = pa.record_batch({
        "w": pa.array(["x", "y", "x"]).dictionary_encode().cast(
            pa.dictionary(pa.uint8(), pa.utf8())),
        "t": pa.array([1_500, 2_000_999, -1_500], pa.timestamp("ns", "UTC")),
        "u": pa.array([2**64 - 1, 0, None], pa.uint64()),
        "s": pa.array(["a", None, "c"], pa.large_string()),
    })
    lake = unify(pa.schema([pa.field("gone", pa.int32())]), batch.schema)
    assert lake is not None
    schema = spark_schema(lake)
    assert [f.dataType.simpleString() for f in schema] == [
        "int", "string", "timestamp", "decimal(20,0)", "string"]
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(schema, timezone="UTC")
    out = to_spark(batch, target)
    assert out.schema == target  # what Spark checks the first batch against
    assert out["gone"].null_count == 3 and out["w"].to_pylist() == ["x", "y", "x"]
    assert out["t"].cast(pa.int64()).to_pylist() == [1, 2_000, -1]  # toward zero
    assert [None if v is None else int(v) for v in out["u"].to_pylist()] == [2**64 - 1, 0, None]


def _filter(name: str, column: str, value: Any) -> Any:
    return type(name, (), {"attribute": (column,), "value": value})()


def test_reader_prune_keeps_exactly_the_files_a_row_of_may_pass() -> None:
    from datetime import timedelta

    from pyspark.sql import types as st

    # The reader's Spark schema, as pushFilters hands it to to_bound (tests/sparkless/
    # test_pruning.py has the rest, by Arrow type).
    schema = filter_types(st.StructType([st.StructField(INGESTED_AT, st.TimestampType()),
                                         st.StructField("n", st.LongType()),
                                         st.StructField("d", st.DecimalType(10, 2))]))
    v = datetime(2025, 1, 1, tzinfo=UTC)
    v_ns = 1_735_689_600 * 10**9
    # Stored rows at v + 500 ns read as v in Spark: they pass "= v" and "<= v", not "> v".
    row = FileRow(file_id="f", client_name="c", start_ts=v_ns + 500, end_ts=v_ns + 500)

    def keeps(op: str, value: Any, column: str = INGESTED_AT,
              maps: tuple[ZoneMap, ...] = ()) -> bool:
        bound = to_bound(_filter(op, column, value), schema)
        assert bound is not None
        return may_match(row, list(maps), [bound], INGESTED_AT)

    assert keeps("EqualTo", v) and keeps("LessThanOrEqual", v) and keeps("GreaterThanOrEqual", v)
    assert not keeps("GreaterThan", v) and not keeps("LessThan", v)
    assert not keeps("EqualTo", v + timedelta(microseconds=1))
    zone = ZoneMap(column="n", min_value=10, max_value=20, null_count=0)
    assert keeps("In", (1, 15), "n", (zone,)) and not keeps("In", (1, 25), "n", (zone,))
    assert keeps("GreaterThan", 19, "n", (zone,)) and not keeps("GreaterThan", 20, "n", (zone,))
    assert keeps("EqualTo", 99, "n")  # no zone map: kept
    all_null = ZoneMap(column="n", min_value=None, max_value=None, null_count=3)
    assert not keeps("EqualTo", 1, "n", (all_null,))
    assert to_bound(_filter("EqualTo", "d", 1), schema) is None  # decimals: not pruned
    assert to_bound(_filter("StringContains", "n", 1), schema) is None
    assert may_match(row, [zone], [Bound(column="n", op="EqualTo", values=(("x", "x"),))],
                     INGESTED_AT)  # a zone map of another kind (the column changed type)


def test_reader_reads_row_groups_larger_than_one_opendal_chunk(tmp_path: Path) -> None:
    # OpenDAL's File.read(n) returns at most 2 MiB; pyarrow took that for the end of the
    # file, so every lake file with a row group over 2 MiB failed ("File too short").
    import numpy as np
    import pyarrow.parquet as pq

    from quiverd.spark.reader import FilePartition, open_object

    table = pa.table({"x": np.random.default_rng(1).random(1_500_000),
                      "s": pa.array([f"row {i}" for i in range(1_500_000)])})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=2_000_000,
                   compression="none")
    assert (tmp_path / "big.parquet").stat().st_size > 8 * 2**20
    part = FilePartition(key="big.parquet", scheme="fs", store_options={"root": str(tmp_path)},
                         timeout_ms=30_000, max_attempts=1)
    source = open_object(part)
    try:
        assert pq.read_table(source).equals(table)
    finally:
        source.close()
