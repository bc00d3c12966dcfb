"""The lake catalog (quiverd/lake/catalog/): the interface and its answers (``base``),
the SQL both backends share (``sql``, and ``jobs`` for Spark job decisions), and the two
backends, ``sqlite`` (embedded, <data_dir>/catalog.sqlite) and ``pg`` (PostgreSQL via
asyncpg). This module chooses one (``open_catalog``); the backends import ``base``, never
this module, and are imported here only on first use (asyncpg only when configured).
"""

from __future__ import annotations

from pathlib import Path

from quiverd.kernel.config import CatalogConfig
from quiverd.kernel.logs import Logger
from quiverd.lake.catalog.base import (
    JOBS_CHANNEL,
    NOTIFY_BUFFER,
    NOTIFY_CHANNEL,
    Catalog,
    DuplicateCoverage,
    NotificationHub,
    Notifications,
    ReplaceConflict,
    StateConflict,
)

__all__ = [
    "JOBS_CHANNEL",
    "NOTIFY_BUFFER",
    "NOTIFY_CHANNEL",
    "Catalog",
    "DuplicateCoverage",
    "NotificationHub",
    "Notifications",
    "ReplaceConflict",
    "StateConflict",
    "open_catalog",
]


def open_catalog(cfg: CatalogConfig, db_path: Path, *, log: Logger) -> Catalog:
    """PostgreSQL when ``cfg.dsn`` is set, else SQLite at ``db_path``; call ``start`` next."""
    if cfg.dsn:
        from quiverd.lake.catalog.pg import PostgresCatalog
        return PostgresCatalog(cfg, log=log)
    from quiverd.lake.catalog.sqlite import SqliteCatalog
    return SqliteCatalog(db_path, log=log)
