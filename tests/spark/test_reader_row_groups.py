"""Row groups skipped by their footer statistics: a lake file of 64 row groups (one
bundle each), read with filters on the time column and on another column."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.lake.model import INGESTED_AT  # noqa: E402
from quiverd.spark.reader import TRACE_ROW_GROUPS  # noqa: E402
from tests.daemon.lake_helpers import FAST_LAKE, uri_path, wait_for_lake  # noqa: E402

pytestmark = pytest.mark.timeout(180)
GROUPS = 64
ROWS = 9_000  # 72 KB of int64 per bundle: above lake.row_group_bytes, one row group each


def _timestamp(ns: int) -> str:
    return datetime.fromtimestamp(ns // 1000 / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def _read_groups(trace: Path) -> list[str]:
    path = trace / TRACE_ROW_GROUPS
    return path.read_text().splitlines() if path.exists() else []


def test_reader_skips_row_groups_by_footer_statistics(daemon_factory: Any, spark: Any,
                                                      tmp_path: Path) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1, "lake.row_group_bytes": 64 * 1024,
                        "lake.file_duration_ms": 8_000}).start()
    with Client.connect(d.socket) as c:
        for b in range(GROUPS):  # one at a time: each its own ingestion time
            c.send(pa.table({"b": pa.array([b] * ROWS, pa.int64()),
                             "v": pa.array(range(b * ROWS, (b + 1) * ROWS), pa.int64())}),
                   client="many")
    (row,) = wait_for_lake(d, Counter({("many", 0): GROUPS * ROWS}))
    meta = pq.ParquetFile(uri_path(row.uri)).metadata
    assert meta.num_row_groups == GROUPS
    # The 20th bundle's time range, from its row group's statistics.
    stats = meta.row_group(20).column(meta.schema.names.index(INGESTED_AT)).statistics
    lo, hi = stats.min_raw * 1000, stats.max_raw * 1000  # stored µs, as ns

    def count(where: str, trace: Path, **options: Any) -> int:
        reader = (spark.read.format("quiver").option("config", str(d.config_path))
                  .option("client", "many").option("_trace_dir", str(trace)))
        for k, v in options.items():
            reader = reader.option(k, str(v))
        return reader.load().where(where).count()

    t = tmp_path / "time"
    assert count(f"{INGESTED_AT} >= '{_timestamp(lo)}' AND {INGESTED_AT} <= "
                 f"'{_timestamp(hi + 1000)}'", t) == ROWS
    assert 1 <= len(_read_groups(t)) <= 2, _read_groups(t)
    # since/until prune row groups too; so do comparisons of another column.
    t = tmp_path / "range"
    assert count("true", t, since=lo, until=hi + 1) == ROWS
    assert 1 <= len(_read_groups(t)) <= 2, _read_groups(t)
    t = tmp_path / "value"
    assert count("b IN (40, 63)", t) == 2 * ROWS
    assert sorted(int(line.split()[1]) for line in _read_groups(t)) == [40, 63]
    t = tmp_path / "all"
    assert count("v % 2 = 0", t) == GROUPS * ROWS // 2
    assert len(_read_groups(t)) == GROUPS
    assert d.stop() == 0
