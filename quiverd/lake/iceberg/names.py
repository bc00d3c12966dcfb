"""Where the Iceberg projection lives: table names, the SQL catalog's URI, the warehouse.

    catalog    SQL catalog "quiverd", in quiverd's own catalog database:
               sqlite:////<data_dir>/catalog.sqlite, or the [catalog] dsn's PostgreSQL
    namespace  quiver
    tables     quiver.<client> (slot 0), quiver.<client>__slot<k> (slot k > 0)
    warehouse  the lake's store: file:///<objects root> or s3://<bucket>/<root>
    metadata   <warehouse>/_iceberg/quiver/<table short name>/metadata/...
               (never under client=..., the prefixes quiverd's janitor sweeps)

Pure: no I/O. Locations are plain URIs, never percent-encoded, as Iceberg stores them.
"""

from __future__ import annotations

import re
from pathlib import Path

from quiverd.kernel.config import CatalogConfig, StoreConfig
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.layout import DataDir

CATALOG_NAME = "quiverd"
NAMESPACE = "quiver"
METADATA_PREFIX = "_iceberg"  # under the warehouse; the janitor sweeps only client=...
SLOT_SEPARATOR = "__slot"
_TABLE = re.compile(rf"{NAMESPACE}\.(?P<client>.+?)(?:{SLOT_SEPARATOR}(?P<slot>[1-9]\d*))?")
# OpenDAL s3 option -> pyiceberg PyArrowFileIO property.
_S3_IO = {
    "endpoint": "s3.endpoint",
    "region": "s3.region",
    "access_key_id": "s3.access-key-id",
    "secret_access_key": "s3.secret-access-key",
    "session_token": "s3.session-token",
}


def table_name(client: str, slot: int) -> str:
    """``quiver.web`` for slot 0, ``quiver.web__slot3`` for slot 3."""
    if slot < 0:
        raise ValueError(f"slot must be >= 0, not {slot}")
    return f"{NAMESPACE}.{client}" if slot == 0 else f"{NAMESPACE}.{client}{SLOT_SEPARATOR}{slot}"


def parse_table_name(name: str) -> tuple[str, int] | None:
    """``(client, slot)`` of ``quiver.<client>[__slot<k>]``, None for other names. Client
    names may hold dots (``quiver.a.b`` is client ``a.b``): the namespace is one level."""
    if not name.startswith(NAMESPACE + "."):
        return None
    m = _TABLE.fullmatch(name)
    if m is None or not m["client"]:
        return None
    return m["client"], int(m["slot"] or 0)


def short_name(table: str) -> str:
    """``web__slot3`` of ``quiver.web__slot3``."""
    return table.split(".", 1)[1] if table.startswith(NAMESPACE + ".") else table


def identifier(table: str) -> tuple[str, str]:
    """``("quiver", "a.b")`` of ``quiver.a.b``: a tuple, because a client name may hold dots
    that pyiceberg would otherwise read as more namespace levels."""
    return NAMESPACE, short_name(table)


def catalog_uri(cfg: CatalogConfig, data_dir: Path) -> str:
    """The SQLAlchemy URI of quiverd's catalog database (the Iceberg catalog shares it).

    SQLite: ``sqlite:////abs/<data_dir>/catalog.sqlite`` (``DataDir.catalog_db``, as
    ``quiverd.lake.catalog`` opens it). PostgreSQL: the libpq URI of ``catalog.dsn`` with
    the driver named (``postgresql+psycopg2://``); user, password, host, port, database
    and query parameters (``?host=/run/pg&sslmode=...``) pass through unchanged, and
    psycopg2 hands them to libpq, so PGPASSWORD, PGHOST, ~/.pgpass and the rest work as
    they do for libpq itself.
    """
    if not cfg.dsn:
        return "sqlite:///" + str(DataDir(data_dir.absolute()).catalog_db)
    scheme, sep, rest = cfg.dsn.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        raise ConfigError("catalog.dsn", "must be a PostgreSQL URI for the Iceberg catalog")
    return f"postgresql+psycopg2://{rest}"


def warehouse(store: StoreConfig, data_dir: Path) -> tuple[str, dict[str, str]]:
    """The warehouse URI of the lake's store and pyiceberg's FileIO properties for it.

    ``fs``: ``file:///abs/root`` (the store's root, <data_dir>/objects by default).
    ``s3``: ``s3://<bucket>/<root>`` with the endpoint, region and keys of
    [lake.store.options]. Other schemes have no FileIO here: ConfigError.
    """
    if store.scheme == "fs":
        root = Path(store.root or DataDir(data_dir).objects).absolute()
        return "file://" + str(root), {}
    if store.scheme == "s3":
        options = store.options
        bucket = options.get("bucket", "")
        if not bucket:
            raise ConfigError("lake.store.options", "bucket is missing: the s3 service needs it")
        io = {prop: options[key] for key, prop in _S3_IO.items() if options.get(key)}
        if options.get("enable_virtual_host_style", "").lower() == "true":
            io["s3.force-virtual-addressing"] = "true"
        prefix = store.root.strip("/")
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}", io
    raise ConfigError("lake.iceberg.enabled", f"the Iceberg projection reads and writes "
                      f"through fs or s3 stores, not {store.scheme!r}",
                      hint="set lake.iceberg.enabled = false for this store")


def location(warehouse_uri: str, key: str) -> str:
    """Where an engine reads the object ``key``: ``<warehouse>/<key>``, not percent-encoded."""
    return f"{warehouse_uri.rstrip('/')}/{key.lstrip('/')}"


def table_location(warehouse_uri: str, table: str) -> str:
    """``<warehouse>/_iceberg/quiver/<short name>``: the table's metadata directory's parent."""
    return location(warehouse_uri, f"{METADATA_PREFIX}/{NAMESPACE}/{short_name(table)}")


def local_path(location_uri: str) -> Path | None:
    """The local path of a ``file://`` location, None for other schemes."""
    # Not urlsplit: locations are not percent-encoded, so '?' or '#' are part of the path.
    return Path(location_uri[len("file://"):]) if location_uri.startswith("file://") else None
