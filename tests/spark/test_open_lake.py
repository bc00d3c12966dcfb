"""The lake as any engine sees it: Spark's own Parquet reader on a client prefix (no
quiverd code, no options) discovers ``date``/``hour`` partition columns, and the rows
equal ``spark.read.format("quiver")`` and the client's Iceberg table."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from tests.daemon.iceberg_helpers import scan, wait_projected  # noqa: E402
from tests.daemon.lake_helpers import FAST_LAKE, wait_for_lake  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HOURS = [datetime(2026, 11, 26, h, 30, tzinfo=UTC) for h in (5, 6, 7)]


def _rows(hour: int, n: int = 40) -> pa.Table:
    ts = pa.array([HOURS[hour]] * n, pa.timestamp("us", tz="UTC"))
    return pa.table({"ts": ts, "n": pa.array(range(hour * 1000, hour * 1000 + n), pa.int64()),
                     "msg": [f"h{hour} {i}" for i in range(n)]})


def test_plain_spark_parquet_reads_a_client_prefix_with_partitions(
        spark: Any, daemon_factory: Any) -> None:
    from collections import Counter

    d = daemon_factory({**FAST_LAKE, "lake.time_column": "ts", "lake.iceberg.enabled": True,
                        "lake.iceberg.reconcile_interval_s": 0.5}).start()
    with Client.connect(d.socket) as c:
        for h in range(3):
            c.send(_rows(h), client="web")
        c.send(pa.concat_tables([_rows(0, 5).slice(0, 5), _rows(2, 5)]), client="web")
    wait_for_lake(d, Counter({("web", 0): 130}))
    wait_projected(d)
    prefix = d.data_dir / "objects" / "client=web" / "slot=0"
    plain = spark.read.parquet(str(prefix))
    assert {"date", "hour"} <= set(plain.columns)
    got = {(r["date"].isoformat() if hasattr(r["date"], "isoformat") else str(r["date"]),
            int(r["hour"]), r["n"]) for r in plain.select("date", "hour", "n").collect()}
    want = {("2026-11-26", 5 + h, n) for h in range(3)
            for n in range(h * 1000, h * 1000 + 40)}
    assert got == want and plain.count() == 130
    via_quiver = (spark.read.format("quiver").option("config", str(d.config_path))
                  .option("client", "web").load())
    ns_quiver = sorted(r["n"] for r in via_quiver.select("n").collect())
    assert ns_quiver == sorted(r["n"] for r in plain.select("n").collect())
    assert sorted(scan(d, "quiver.web")["n"].to_pylist()) == ns_quiver
    # The bookkeeping columns have the types any engine reads.
    types = dict(plain.dtypes)
    assert types["_quiver_ingested_at"] == "timestamp"
    assert (types["_quiver_shard"], types["_quiver_segment"], types["_quiver_bundle"]) == (
        "int", "bigint", "bigint")
    assert d.stop() == 0
