"""Which Iceberg readers notice a damaged lake object, tested for real: a file written as
the uploader writes it (zstd, a CRC-32 checksum on every page) is projected, then 32
bytes inside one data page are flipped in the store. pyiceberg 0.12 and DuckDB 1.5.5
(iceberg extension) read it with no error and return wrong values; pyarrow refuses it
only with ``page_checksum_verification=True``. docs/iceberg.md says so: the scrub's
quarantine, which takes the file out of the table, is what bounds the exposure. If a
reader starts verifying, the assertion naming it fails: update the docs then."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ulid import ULID

from quiverd.kernel.config import CatalogConfig
from quiverd.lake.iceberg import DataFileRef, catalog_uri, location
from quiverd.lake.parquet import ActiveFile, ParquetSettings
from tests.lake.iceberg_helpers import TIME, fs_lake, lake_table
from tests.lake.test_iceberg import _duckdb_extension
from tests.lake.test_scrub import damaged

ROWS = 20_000


def lake_bytes(tmp_path: Path) -> tuple[pa.Table, bytes]:
    """A lake file's rows and bytes, written by the uploader's writer (ActiveFile)."""
    x = pa.array(np.random.default_rng(7).random(ROWS))
    table = lake_table(ROWS, extra={"x": x})
    path = tmp_path / "file.parquet"
    f = ActiveFile.create(path, table.schema, ParquetSettings(), metadata={},
                          time_column=TIME)
    f.append(table)
    f.close()
    return table, path.read_bytes()


def test_iceberg_readers_do_not_check_page_checksums(tmp_path: Path) -> None:
    import duckdb

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lake = fs_lake(data_dir)
    table, data = lake_bytes(tmp_path)
    at = table.column(TIME)[0].as_py()
    file_id = str(ULID())
    key = f"client=web/slot=0/date={at:%Y-%m-%d}/hour={at:%H}/n1_{file_id}.parquet"
    path = data_dir / "objects" / key
    lake._put(key, data)
    p = lake.projection(catalog_uri(CatalogConfig(), data_dir))
    try:
        p.commit("quiver.web", [DataFileRef(file_id=file_id, location=location(
            lake.warehouse, key), client="web", slot=0, partition_column=TIME)])
        path.write_bytes(damaged(data))  # bit rot, a bad copy: after the projection
        tbl = p._catalog.load_table(("quiver", "web"))
        got = tbl.scan(selected_fields=("id", "x")).to_arrow().sort_by("id")
        metadata = tbl.metadata_location
    finally:
        p.close()
    # pyiceberg: no error, every row, some values wrong.
    assert got.num_rows == ROWS
    wrong = int(pa.compute.sum(pa.compute.not_equal(got["x"], table["x"])).as_py())
    assert wrong > 0

    # DuckDB's iceberg_scan: the same.
    con = duckdb.connect(config={"autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    for name in ("avro", "iceberg"):
        con.execute(f"LOAD '{_duckdb_extension(name)}'")
    values = [v for (v,) in con.execute(
        f"SELECT x FROM iceberg_scan('{metadata}') ORDER BY id").fetchall()]
    assert len(values) == ROWS and values != table["x"].to_pylist()

    # pyarrow: silent by default, refuses the page when asked to verify.
    assert pq.read_table(path).num_rows == ROWS
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.ParquetFile(path, page_checksum_verification=True).read()
    with sqlite3.connect(data_dir / "catalog.sqlite") as db:  # the file is in the table
        assert db.execute("SELECT count(*) FROM iceberg_tables").fetchone() == (1,)
