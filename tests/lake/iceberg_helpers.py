"""Lake-style Parquet files for the Iceberg projection tests, written to the fs or S3 store.

Files carry the new bookkeeping types (``_quiver_ingested_at`` timestamp[us, UTC],
``_quiver_shard`` int32, ``_quiver_segment``/``_quiver_bundle`` int64) under keys like
``client=web/slot=0/date=2026-11-26/hour=05/<node>_<ulid>.parquet``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from ulid import ULID

from quiverd.kernel.config import IcebergConfig, StoreConfig
from quiverd.lake.iceberg import DataFileRef, Projection, location, warehouse

TIME = "_quiver_ingested_at"
HOUR0 = datetime(2026, 11, 26, 5, 0, tzinfo=UTC)


def lake_table(rows: int, *, start: int = 0, at: datetime = HOUR0,
               extra: dict[str, pa.Array] | None = None,
               shard_type: pa.DataType = pa.int32()) -> pa.Table:
    """``rows`` rows with ids start..start+rows-1, all within the hour of ``at``."""
    base = at.replace(minute=0, second=0, microsecond=0)
    times = [base + timedelta(seconds=(i % 3000)) for i in range(rows)]
    columns: dict[str, pa.Array] = {
        "id": pa.array(range(start, start + rows), pa.int64()),
        "msg": pa.array([f"m{start + i}" for i in range(rows)]),
        TIME: pa.array(times, pa.timestamp("us", tz="UTC")),
        "_quiver_shard": pa.array([0] * rows, shard_type),
        "_quiver_segment": pa.array([1] * rows, pa.int64()),
        "_quiver_bundle": pa.array(range(rows), pa.int64()),
    }
    columns.update(extra or {})
    return pa.table(columns)


class Lake:
    """Writes Parquet objects into one store (fs directory or S3 bucket) and makes refs."""

    def __init__(self, warehouse: str, io_properties: dict[str, str],
                 put: Callable[[str, bytes], None]) -> None:
        self.warehouse = warehouse
        self.io_properties = io_properties
        self._put = put

    def write(self, table: pa.Table, *, client: str = "web", slot: int = 0) -> DataFileRef:
        file_id = str(ULID())
        at = table.column(TIME)[0].as_py() if TIME in table.column_names else HOUR0
        key = (f"client={client}/slot={slot}/date={at:%Y-%m-%d}/hour={at:%H}/"
               f"node-a_{file_id}.parquet")
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        self._put(key, sink.getvalue())
        return DataFileRef(file_id=file_id, location=location(self.warehouse, key),
                           client=client, slot=slot, partition_column=TIME)

    def projection(self, catalog_uri: str, **cfg: Any) -> Projection:
        return Projection(catalog_uri=catalog_uri, warehouse=self.warehouse,
                          io_properties=self.io_properties, cfg=IcebergConfig(**cfg))


def fs_lake(data_dir: Path) -> Lake:
    """The default fs store, <data_dir>/objects."""
    where, io_properties = warehouse(StoreConfig(), data_dir)

    def put(key: str, data: bytes) -> None:
        path = data_dir / "objects" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return Lake(where, io_properties, put)


def s3_lake(bucket: dict[str, str], client: Any, data_dir: Path) -> Lake:
    """moto's bucket with lake.store.root = "/lake"."""
    cfg = StoreConfig(scheme="s3", root="/lake", options=bucket)
    where, io_properties = warehouse(cfg, data_dir)

    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket["bucket"], Key=f"lake/{key}", Body=data)

    return Lake(where, io_properties, put)


def scan_ids(projection: Projection, table: str) -> list[int]:
    """Every ``id`` a pyiceberg scan of the table returns, sorted (duplicates kept)."""
    tbl = projection._catalog.load_table(("quiver", table.split(".", 1)[1]))
    return sorted(tbl.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist())
