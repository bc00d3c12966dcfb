"""The lake crash states' catalog database, SQLite or PostgreSQL: read, snapshot, put back.

    SqliteDb / PgDb       rows(query): quiverd's and Iceberg's tables read by the checks
                          ([] while a table does not exist); iceberg_uri: pyiceberg's URI
    SqliteSnapshots       catalog.sqlite copied with SQLite's backup API when its
                          data_version moved; put back by copying the file
    PgSnapshots           every table of the database dumped with COPY ... TO STDOUT in one
                          REPEATABLE READ transaction (one consistent instant), kept when the
                          dump differs from the last; put back into the run's own database
                          (the daemon is stopped by then): TRUNCATE and COPY FROM. A dump
                          without quiverd's schema (before its first migration committed)
                          is put back as no tables at all; the schema comes back by
                          quiverd's and pyiceberg's own start-up (migrations, create_all)

Both tell ``changed_since(id)``: whether the database moved on from snapshot ``id`` (a
capture reads the catalog, walks the store, and asks: the capture is one instant only if
it did not).
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Protocol

from quiverd.kernel.config import CatalogConfig
from quiverd.lake.iceberg import catalog_uri

NO_CATALOG = -1  # a snapshot id: the database has no catalog yet


class CatalogDb(Protocol):
    iceberg_uri: str

    def rows(self, query: str) -> list[dict[str, Any]]: ...

    def has_table(self, name: str) -> bool: ...


class SqliteDb:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.iceberg_uri = f"sqlite:///{path}"

    def rows(self, query: str) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in conn.execute(query)]
        except sqlite3.OperationalError:
            return []  # not migrated yet
        finally:
            conn.close()

    def has_table(self, name: str) -> bool:
        return bool(self.rows(f"SELECT name FROM sqlite_master WHERE type = 'table' "
                              f"AND name = '{name}'"))


class PgDb:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.iceberg_uri = catalog_uri(CatalogConfig(dsn=dsn), Path("/"))

    def rows(self, query: str) -> list[dict[str, Any]]:
        import psycopg2
        import psycopg2.errors
        import psycopg2.extras

        conn = psycopg2.connect(self.dsn)
        try:
            with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
                cur.execute(query)
                return [dict(r) for r in cur.fetchall()]
        except psycopg2.errors.UndefinedTable:
            return []
        finally:
            conn.close()

    def has_table(self, name: str) -> bool:
        return bool(self.rows("SELECT table_name FROM information_schema.tables WHERE "
                              f"table_schema = 'public' AND table_name = '{name}'"))


# ---- snapshots ------------------------------------------------------------------------
class SqliteSnapshots:
    def __init__(self, db: Path, scratch: Path) -> None:
        self.db, self.scratch = db, scratch
        self._conn: sqlite3.Connection | None = None
        self._version: int | None = None
        self.snaps: list[Path] = []
        self.restored: int | None = None  # (the data directory is made afresh each time)

    def capture(self) -> int:
        if self._conn is None:
            if not self.db.exists():
                return NO_CATALOG
            self._conn = sqlite3.connect(self.db, check_same_thread=False,
                                         isolation_level=None)
        version = self._data_version()
        if version != self._version or not self.snaps:
            self._version = version
            path = self.scratch / f"catalog-{len(self.snaps)}.sqlite"
            dst = sqlite3.connect(path)
            try:
                self._conn.backup(dst)
            finally:
                dst.close()
            self.snaps.append(path)
        return len(self.snaps) - 1

    def changed_since(self, snap: int) -> bool:
        return self._conn is not None and self._data_version() != self._version

    def _data_version(self) -> int:
        assert self._conn is not None
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def restore(self, snap: int, data_dir_db: Path) -> None:
        if snap != NO_CATALOG:
            shutil.copyfile(self.snaps[snap], data_dir_db)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


Dump = dict[str, bytes]  # table -> its rows as COPY's text format


class PgSnapshots:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: Any = None
        self.snaps: list[Dump] = []
        self._digests: list[bytes] = []
        self.restored: int | None = None  # the snapshot the run's database holds now

    def _connect(self) -> Any:
        import psycopg2

        if self._conn is None:
            self._conn = psycopg2.connect(self.dsn)
        return self._conn

    def _dump(self) -> Dump:
        import io

        conn = self._connect()
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        out: Dump = {}
        with conn, conn.cursor() as cur:
            cur.execute("SELECT table_name FROM information_schema.tables "
                        "WHERE table_schema = 'public' ORDER BY table_name")
            for (table,) in cur.fetchall():
                buf = io.BytesIO()
                cur.copy_expert(f'COPY "{table}" TO STDOUT', buf)
                out[table] = buf.getvalue()
        return out

    def capture(self) -> int:
        dump = self._dump()
        if not dump.get("schema_version"):
            return NO_CATALOG  # no migration committed yet: no catalog
        digest = _digest(dump)
        if not self._digests or digest != self._digests[-1]:
            self.snaps.append(dump)
            self._digests.append(digest)
        return len(self.snaps) - 1

    def changed_since(self, snap: int) -> bool:
        dump = self._dump()
        if snap == NO_CATALOG:
            return bool(dump.get("schema_version"))
        return _digest(dump) != self._digests[snap]

    def restore(self, snap: int, data_dir_db: Path) -> None:
        """Put snapshot ``snap`` back into the run's database (nothing may use it; a
        caller that let a daemon change it sets ``restored`` to None)."""
        if snap == self.restored:
            return
        self.restored = snap
        self.close()
        conn = self._connect()
        conn.set_session(isolation_level="READ COMMITTED", readonly=False)
        with conn, conn.cursor() as cur:
            cur.execute("SELECT table_name FROM information_schema.tables "
                        "WHERE table_schema = 'public'")
            tables = [t for (t,) in cur.fetchall()]
            if snap == NO_CATALOG:
                for table in tables:
                    cur.execute(f'DROP TABLE IF EXISTS "{table}" CASCADE')
                return
        if "schema_version" not in tables:
            self._make_tables()
        import io

        dump = self.snaps[snap]
        with conn, conn.cursor() as cur:
            cur.execute("SELECT table_name FROM information_schema.tables "
                        "WHERE table_schema = 'public'")
            tables = [t for (t,) in cur.fetchall()]
            cur.execute("TRUNCATE " + ", ".join(f'"{t}"' for t in tables) + " CASCADE")
            for table in _parents_first(cur, tables):
                if dump.get(table):
                    cur.copy_expert(f'COPY "{table}" FROM STDIN', io.BytesIO(dump[table]))

    def _make_tables(self) -> None:
        """quiverd's schema (its migrations) and pyiceberg's catalog tables."""
        import anyio
        from pyiceberg.catalog.sql import SqlCatalog

        from quiverd.kernel import logs
        from quiverd.lake.catalog.pg import PostgresCatalog

        async def migrate() -> None:
            catalog = PostgresCatalog(CatalogConfig(dsn=self.dsn), log=logs.get("lakedb"))
            try:
                await catalog.start()
            finally:
                await catalog.close()

        anyio.run(migrate)
        SqlCatalog("quiverd", uri=PgDb(self.dsn).iceberg_uri,
                   warehouse="file:///nonexistent").engine.dispose()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _digest(dump: Dump) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for table in sorted(dump):
        h.update(table.encode() + b"\0" + hashlib.blake2b(dump[table]).digest())
    return h.digest()


def _parents_first(cur: Any, tables: list[str]) -> list[str]:
    """``tables`` ordered so that a table referenced by a foreign key comes first."""
    cur.execute("SELECT tc.table_name, ccu.table_name FROM information_schema."
                "table_constraints tc JOIN information_schema.constraint_column_usage ccu "
                "ON tc.constraint_name = ccu.constraint_name WHERE tc.constraint_type = "
                "'FOREIGN KEY' AND tc.table_schema = 'public'")
    parents: dict[str, set[str]] = {}
    for child, parent in cur.fetchall():
        if child != parent:
            parents.setdefault(child, set()).add(parent)
    ordered: list[str] = []
    while len(ordered) < len(tables):
        for t in sorted(tables):
            if t not in ordered and parents.get(t, set()) <= set(ordered):
                ordered.append(t)
                break
        else:
            raise AssertionError(f"foreign keys in a cycle among {tables}")
    return ordered
