"""Reading a daemon's Iceberg tables as a user would: pyiceberg's SQL catalog on the
daemon's database, DuckDB with the iceberg extension wheel (offline)."""

from __future__ import annotations

import glob
import importlib
import os
import time
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
        if ice.get("lag_files") == 0 and ice["last_reconcile_ns"]:
            if first is None:
                first = ice["last_reconcile_ns"]
            elif ice["last_reconcile_ns"] != first:
                return ice
        time.sleep(0.2)
    raise AssertionError(f"projection still lags: {ice}\n{d.log()[-3000:]}")


def duckdb_count(metadata_location: str) -> int:
    """Rows DuckDB 1.5.5 reads from the table's metadata.json, offline: the avro and
    iceberg extensions are LOADed from their PyPI wheels' files (no download)."""
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    for name in ("avro", "iceberg"):
        con.execute(f"LOAD '{duckdb_extension(name)}'")
    path = metadata_location.removeprefix("file://")
    row = con.execute(f"SELECT count(*) FROM iceberg_scan('{path}')").fetchone()
    assert row is not None
    return int(row[0])


def duckdb_extension(name: str) -> str:
    """The extension file inside the ``duckdb-extension-<name>`` wheel."""
    module = importlib.import_module(f"duckdb_extension_{name}")
    (path,) = glob.glob(os.path.join(os.path.dirname(module.__file__ or ""), "extensions", "*",
                                     f"{name}.duckdb_extension"))
    return path
