"""Reading a daemon's Iceberg tables as a user would: pyiceberg's SQL catalog on the
daemon's database, DuckDB with the iceberg extension wheel (offline)."""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table import Table

from tests.conftest import DaemonProcess


def sql_uri(d: DaemonProcess, dsn: str | None = None) -> str:
    """The SQLAlchemy URI of the daemon's catalog database (what docs/iceberg.md says)."""
    if dsn:
        return dsn.replace("postgresql://", "postgresql+psycopg2://", 1)
    return f"sqlite:///{d.data_dir / 'catalog.sqlite'}"


def catalog(d: DaemonProcess, *, dsn: str | None = None,
            s3: dict[str, str] | None = None) -> SqlCatalog:
    props: dict[str, str] = {"uri": sql_uri(d, dsn)}
    if s3:
        props.update({"s3.endpoint": s3["endpoint"], "s3.access-key-id": s3["access_key_id"],
                      "s3.secret-access-key": s3["secret_access_key"],
                      "s3.region": s3.get("region", "us-east-1")})
    return SqlCatalog("quiverd", **props)


def scan(d: DaemonProcess, table: str, **kw: Any) -> pa.Table:
    return catalog(d, **kw).load_table(table).scan().to_arrow()


def load(d: DaemonProcess, table: str, **kw: Any) -> Table:
    return catalog(d, **kw).load_table(table)


def wait_projected(d: DaemonProcess, timeout: float = 60) -> dict[str, Any]:
    """Until the projection has nothing pending and reconciled at least once since the
    lake drained; returns the status's ``iceberg`` section."""
    deadline = time.monotonic() + timeout
    first: int | None = None
    ice: dict[str, Any] = {}
    while time.monotonic() < deadline:
        ice = d.status()["lake"]["iceberg"]
        if ice["lag_files"] == 0 and ice["last_reconcile_ns"]:
            if first is None:
                first = ice["last_reconcile_ns"]
            elif ice["last_reconcile_ns"] != first:
                return ice
        time.sleep(0.2)
    raise AssertionError(f"projection still lags: {ice}\n{d.log()[-3000:]}")


def duckdb_count(metadata_location: str) -> int:
    """Rows DuckDB 1.5.5 reads from the table's metadata.json, offline: the extension is
    LOADed from the duckdb-extension-iceberg wheel's file (no download)."""
    import duckdb
    import duckdb_extension_iceberg

    root = Path(duckdb_extension_iceberg.__file__).parent
    ext = next(iter(glob.glob(os.path.join(root, "**", "*.duckdb_extension*"), recursive=True)))
    con = duckdb.connect()
    con.execute(f"LOAD '{ext}'")
    path = metadata_location.removeprefix("file://")
    row = con.execute(f"SELECT count(*) FROM iceberg_scan('{path}')").fetchone()
    assert row is not None
    return int(row[0])
