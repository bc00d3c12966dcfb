"""Damaged and missing lake objects through ``spark.read.format("quiver")``: a real
`quiverd serve` writes the files (SQLite + fs), the test damages or removes one object
on disk, and Spark must fail with one clear error naming it, never return wrong values."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.lake.model import FileRow  # noqa: E402
from tests.daemon.lake_helpers import FAST_LAKE, uri_path, wait_for_lake  # noqa: E402

pytestmark = pytest.mark.timeout(180)
ROWS = 20_000  # 160 KB of random float64 per bundle: pages far larger than 32 bytes


def floats(seed: int) -> pa.Table:
    return pa.table({"seed": pa.array([seed] * ROWS, pa.int64()),
                     "x": np.random.default_rng(seed).random(ROWS)})


def send_files(d: Any, files: int) -> list[FileRow]:
    """``files`` lake files of client "floats", one bundle each (the lake rotates
    between sends), ordered by time."""
    sent: Counter[tuple[str, int]] = Counter()
    for seed in range(files):
        with Client.connect(d.socket) as c:
            c.send({0: floats(seed)}, client="floats")
        sent[("floats", 0)] += ROWS
        rows = wait_for_lake(d, sent)
    return sorted(rows, key=lambda r: (r.start_ts, r.file_id))


def flip_in_data_page(path: str, column: str = "x", nbytes: int = 32) -> None:
    """Flip ``nbytes`` bytes 4 KiB into the column chunk's first page body."""
    meta = pq.read_metadata(path)
    leaf = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == column)
    chunk = meta.row_group(0).column(leaf)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    assert chunk.total_compressed_size > 8192
    os.chmod(path, 0o640)
    with open(path, "r+b") as f:
        f.seek(start + 4096)
        data = bytearray(f.read(nbytes))
        f.seek(start + 4096)
        f.write(bytes(b ^ 0x5A for b in data))


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
            "missing from the object store: restore the object") in text
    assert "opendal" not in text.lower() and "NotFound" not in text
    Path(uri_path(first.uri)).unlink()  # now the schema's own footer is gone too
    with pytest.raises(Exception, match=f"lake file {first.file_id} .* is registered in the "
                       "catalog but missing"):
        _ = load(spark, d).schema
    assert d.stop() == 0
