"""The reader over a client whose schema drifted, empty selections, the ``columns``
option, and a strict daemon refusing a Spark write: real daemons, real Spark."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.lake.bundles import EXTRA_NAMES  # noqa: E402
from quiverd.lake.model import INGESTED_AT  # noqa: E402
from quiverd.spark.reader import TRACE_FILE  # noqa: E402
from tests.daemon.lake_helpers import FAST_LAKE, wait_for_lake  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _reader(spark: Any, d: Any, client: str, **options: Any) -> Any:
    reader = spark.read.format("quiver").option("config", str(d.config_path))
    reader = reader.option("client", client)
    for name, value in options.items():
        reader = reader.option(name, str(value))
    return reader


def _send_files(d: Any, tables: dict[str, list[pa.Table]]) -> dict[str, list[Any]]:
    """One lake file per table: the n-th table of every client is sent once the files
    of the (n-1)-th are registered. The registered files per client, oldest first."""
    sent: Counter[tuple[str, int]] = d.sent  # every client's rows so far
    rows: list[Any] = []
    with Client.connect(d.socket) as c:
        for n in range(max(len(ts) for ts in tables.values())):
            for client, ts in tables.items():
                if n < len(ts):
                    c.send(ts[n], client=client)
                    sent[(client, 0)] += ts[n].num_rows
            rows = wait_for_lake(d, sent)
    return {client: sorted((r for r in rows if r.client_name == client),
                           key=lambda r: r.start_ts) for client in tables}


def test_reader_drift_casts_lossless_and_names_both_files_otherwise(
        daemon_factory: Any, spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    d.sent = Counter()
    big = 2**53 + 1  # no double holds it
    files = _send_files(d, {
        # Compatible across files: int32 → int64, int → float64 (exact values), string
        # and large_string.
        "wide": [pa.table({"k": pa.array([1, 2], pa.int32()), "x": pa.array([3, 4], pa.int64()),
                           "s": pa.array(["a", "b"], pa.string())}),
                 pa.table({"k": pa.array([2**40], pa.int64()), "x": pa.array([0.5]),
                           "s": pa.array(["c"], pa.large_string())})],
        "inexact": [pa.table({"x": pa.array([big], pa.int64())}), pa.table({"x": [1.5]})],
        # string then int: no one type.
        "flip": [pa.table({"user": pa.array(["ann", "bob"]), "n": pa.array([1, 2], pa.int32())}),
                 pa.table({"user": pa.array([7], pa.int32()), "n": pa.array([3], pa.int32())})],
    })
    df = _reader(spark, d, "wide").load()
    assert (dict(df.dtypes)["k"], dict(df.dtypes)["x"], dict(df.dtypes)["s"]) == \
        ("bigint", "double", "string")
    assert sorted(map(tuple, df.select("k", "x", "s").collect())) == \
        [(1, 3.0, "a"), (2, 4.0, "b"), (2**40, 0.5, "c")]
    # An int past 2**53 read as double would change: the read fails naming the file (as
    # does a .schema(...) some values do not fit: the same cast).
    first = files["inexact"][0].file_id
    with pytest.raises(Exception, match=f"lake file {first}.*column 'x' is int64"):
        _reader(spark, d, "inexact").load().collect()
    # The error names both files and the .schema(...) fix.
    files = files["flip"]
    with pytest.raises(Exception) as refused:
        _ = _reader(spark, d, "flip").load().schema
    text = str(refused.value)
    assert files[0].file_id in text and files[1].file_id in text, text
    assert "column 'user' is int32" in text and ".schema(" in text and "`user` string" in text
    ddl = text.split('.schema("')[1].split('")')[0]
    fixed = _reader(spark, d, "flip").schema(ddl).load()
    assert sorted(map(tuple, fixed.select("user", "n").collect())) == \
        [("7", 3), ("ann", 1), ("bob", 2)]
    assert d.stop() == 0


def test_reader_empty_selection_is_empty_dataframe_with_the_clients_schema(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}).start()
    d.sent = Counter()
    files = _send_files(d, {"web": [pa.table({"status": pa.array([200, 404], pa.int32()),
                                              "path": ["/", "/x"]})]})["web"]
    full = _reader(spark, d, "web").load()
    assert full.count() == 2
    # until before any file: no rows, the schema of the client's latest file.
    early = _reader(spark, d, "web", until=files[0].start_ts - 10**9).load()
    assert early.schema == full.schema and early.count() == 0
    assert early.where("status = 200").select("path").collect() == []
    # An unused slot of a known client: only quiverd's own columns, no rows.
    df = _reader(spark, d, "web", slot=7).load()
    assert set(df.columns) == set(EXTRA_NAMES) and df.count() == 0
    # A client with no file at all is not a quiet hour but a typo (or a client not in the
    # lake yet): refused, with and without .schema(...), naming the known one.
    with pytest.raises(Exception, match=r"no file of client 'wbe'; did you mean \"web\"\?.*"
                                        r"clients in the lake: 'web'"):
        _ = _reader(spark, d, "wbe").load().schema
    with pytest.raises(Exception, match="no file of client 'wbe'"):
        _reader(spark, d, "wbe").schema("status int").load().count()
    # A filter that prunes every file: no partition to read, no error.
    assert full.where(f"{INGESTED_AT} < '2000-01-01'").count() == 0
    # columns: only those are read; the time column only for since/until, then dropped.
    trace = tmp_path / "trace"
    some = _reader(spark, d, "web", columns="path", since=files[0].start_ts,
                   _trace_dir=trace).load()
    assert some.columns == ["path"] and sorted(r[0] for r in some.collect()) == ["/", "/x"]
    assert (trace / TRACE_FILE).exists()
    with pytest.raises(Exception, match=r"'stat' is not a column of client 'web'.*status, path"):
        _ = _reader(spark, d, "web", columns="stat,path").load().schema
    assert d.stop() == 0


def test_strict_daemon_fails_a_conflicting_spark_write_once_and_reads_empty_as_established(
        daemon_factory: Any, spark: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "lake.schema_mode": "strict",
                        "lake.file_duration_ms": 600_000}).start()  # no file registered
    with Client.connect(d.socket) as c:
        c.send(pa.table({"user": ["ann"]}), client="web")
    df = spark.createDataFrame([(i,) for i in range(100)], "user INT").repartition(2)
    started = time.monotonic()
    with pytest.raises(Exception) as refused:
        (df.write.format("quiver").mode("append").option("path", str(d.socket))
         .option("client", "web").option("job_id", "flip-1").save())
    text = str(refused.value)
    assert "not written" in text and "column 'user' is int32" in text and "string" in text
    assert time.monotonic() - started < 60
    # Refused once per schema: the daemon logged one refusal, not one per retry.
    assert len(d.events("schema_conflict_refused")) == 1
    # No lake file yet: the empty DataFrame has the established schema (and quiverd's).
    empty = _reader(spark, d, "web").load()
    assert set(empty.columns) == {"user", *EXTRA_NAMES} and empty.count() == 0
    assert dict(empty.dtypes)["user"] == "string"
    assert d.stop() == 0
