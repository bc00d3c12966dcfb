"""The embedded catalog: SQLite in <data_dir>/catalog.sqlite, for one daemon.

Tables and their layout: see ``quiverd.lake.catalog``. The file is in WAL journal mode with
``synchronous=FULL``: a call that returns has its transaction on disk.

One connection, used only from the worker thread of the catalog's CapacityLimiter(1):
every call is one hop ``anyio.to_thread.run_sync(..., limiter=...)`` (the event loop never
blocks on SQLite, and statements never interleave). Writes run under ``BEGIN IMMEDIATE``,
which takes the database's write lock at once, so the read-check-write of ``register``
and ``replace`` cannot race another connection (a CLI, a second catalog in tests).

Notifications are in-process only: each ``Notifications`` iterator is an anyio memory
stream fed on the event loop after the registering (or deciding) transaction committed.
Another process's job decisions are seen by polling ``job_decisions``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from quiverd.kernel.errors import CatalogUnavailable, LakeError
from quiverd.kernel.jobs import JobDecision
from quiverd.kernel.logs import Logger
from quiverd.lake.catalog import jobs, sql
from quiverd.lake.catalog.base import (
    JOBS_CHANNEL,
    Catalog,
    DuplicateCoverage,
    NotificationHub,
    Notifications,
    ReplaceConflict,
)
from quiverd.lake.model import Coverage, FileRow, FileState, ZoneMap, decode_indexes

T = TypeVar("T")

BUSY_TIMEOUT_S = 5.0  # wait this long for another connection's write lock before failing
# Primary result codes that mean "the database file cannot serve us now", not "bad SQL"
# (a syntax error or a missing table is SQLITE_ERROR and stays a programming error).
_UNAVAILABLE_CODES = frozenset({
    sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_INTERRUPT, sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_NOTADB,
})


class SqliteCatalog(Catalog):
    backend = "sqlite"

    def __init__(self, path: Path, *, log: Logger) -> None:
        self._path = path
        self._log = log
        self._limiter = anyio.CapacityLimiter(1)  # the one thread that touches _conn
        self._conn: sqlite3.Connection | None = None
        self._hub = NotificationHub(backend=self.backend, log=log)
        self._job_hub = NotificationHub(backend=self.backend, log=log, channel=JOBS_CHANNEL)

    async def start(self) -> None:
        before, after = await self._call(self._start)
        self._log.info("catalog_started", backend=self.backend, path=str(self._path),
                       schema_version=after, migrated_from=before)

    async def close(self) -> None:
        self._hub.close()
        self._job_hub.close()
        if self._conn is not None:
            # Shielded: a close at shutdown runs in a cancelled scope (the daemon's root
            # is cancelled), and an unshielded hop would leave the connection open.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._close, limiter=self._limiter)

    async def insert_file(self, row: FileRow) -> None:
        values = sql.row_values(row, state=row.state, now_ns=time.time_ns())
        await self._call(self._write, _insert_file, values)

    async def set_state(self, file_id: str, state: FileState, /, **fields: Any) -> None:
        pairs = sql.settable_fields(file_id, fields)
        query = sql.set_state_query(file_id, state, pairs, time.time_ns())
        await self._call(self._write, _set_state, file_id, query)

    async def set_state_if(self, file_id: str, state: FileState,
                           only_from: Iterable[FileState], /, **fields: Any) -> bool:
        pairs = sql.settable_fields(file_id, fields)
        query = sql.set_state_query(file_id, state, pairs, time.time_ns(), only_from)
        return await self._call(self._write, _update_count, query) == 1

    async def register(self, row: FileRow, coverage: list[Coverage]) -> bool:
        sql.check_coverage(coverage)
        values = sql.row_values(row, state=FileState.META_REGISTERED, now_ns=time.time_ns())
        done = await self._call(self._write, _register, row, coverage, values)
        if done:
            self._hub.publish([row.file_id])
        return done

    async def covered(self, source_id: str, shard: int, segment_seq: int) -> dict[int, set[int]]:
        return await self._call(self._read, _covered, source_id, shard, segment_seq)

    async def covered_parts(self, source_id: str, shard: int, segment_seq: int
                            ) -> dict[tuple[int, str], set[int]]:
        return await self._call(self._read, _covered_parts, source_id, shard, segment_seq)

    async def get(self, file_id: str) -> FileRow | None:
        rows = await self._call(self._read, _select, sql.SELECT_FILES + " WHERE file_id = ?",
                                [file_id])
        return rows[0] if rows else None

    async def list_files(self, *, client: str | None = None, since_ns: int | None = None,
                         until_ns: int | None = None, states: Iterable[FileState] | None = None,
                         node_id: str | None = None, source_id: str | None = None,
                         slot: int | None = None, limit: int | None = None,
                         newest_first: bool = False) -> list[FileRow]:
        query = sql.list_files_query(client=client, since_ns=since_ns, until_ns=until_ns,
                                     states=states, node_id=node_id, source_id=source_id,
                                     slot=slot, limit=limit, newest_first=newest_first)
        if query is None:
            return []
        return await self._call(self._read, _select, *query)

    async def record_index(self, file_id: str, zone_maps: list[ZoneMap],
                           indexes: list[str]) -> None:
        maps = sql.zone_map_values(file_id, zone_maps)
        if len({m[1] for m in maps}) != len(maps):
            raise ValueError(f"{file_id}: a column has two zone maps")
        encoded = sql.settable_fields(file_id, {"indexes": indexes})[0][1]
        await self._call(self._write, _record_index, file_id, maps, encoded, time.time_ns())

    async def zone_maps(self, file_ids: list[str]) -> dict[str, list[ZoneMap]]:
        return await self._call(self._read, _zone_maps, file_ids)

    async def replace(self, old_ids: list[str], new_row: FileRow) -> None:
        old_ids = list(dict.fromkeys(old_ids))
        values = sql.row_values(new_row, state=FileState.META_REGISTERED, now_ns=time.time_ns())
        if await self._call(self._write, _replace, old_ids, new_row.file_id, values):
            self._hub.publish([new_row.file_id])

    async def restore(self, file_id: str) -> bool:
        done = await self._call(self._write, _restore, file_id, time.time_ns())
        if done:
            self._hub.publish([file_id])
        return done

    async def delete_rows(self, file_ids: list[str]) -> None:
        await self._call(self._write, _delete_rows, file_ids)

    def notifications(self) -> Notifications:
        return self._hub.subscribe()

    async def decide_job(self, decision: JobDecision) -> tuple[JobDecision, bool]:
        checked = jobs.checked_decision(decision, now_ns=time.time_ns())
        stands, recorded = await self._call(self._write, _decide_job, checked)
        if recorded:
            self._job_hub.publish([checked.job_id])
        return stands, recorded

    async def job_decisions(self, job_ids: Iterable[str]) -> dict[str, JobDecision]:
        return await self._call(self._read, _job_decisions, list(job_ids))

    def job_notifications(self) -> Notifications:
        return self._job_hub.subscribe()

    async def prune_job_decisions(self, decided_before_ns: int) -> int:
        return await self._call(self._write, _update_count, (jobs.PRUNE_JOBS,
                                                             [decided_before_ns]))

    async def renew_job_leases(self, node_id: str, job_ids: list[str], now_ns: int) -> None:
        await self._call(self._write, _renew_leases, node_id, job_ids, now_ns)

    async def job_leases(self, job_ids: list[str], *, exclude_node: str) -> dict[str, int]:
        return await self._call(self._read, _job_leases, job_ids, exclude_node)

    # ---- the worker thread's side -----------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", sqlite3.SQLITE_ERROR) & 0xFF
            if code in _UNAVAILABLE_CODES:
                raise CatalogUnavailable(f"sqlite catalog {self._path}: "
                                         f"{getattr(exc, 'sqlite_errorname', '')} {exc}") from exc
            raise

    def _start(self) -> tuple[int, int]:
        if self._hub.closed:
            raise RuntimeError(f"sqlite catalog {self._path} is closed")
        if self._conn is None:
            conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
            try:
                conn.row_factory = sqlite3.Row
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode != "wal":
                    raise LakeError(f"sqlite catalog {self._path}: journal mode {mode}, not wal")
                conn.execute("PRAGMA synchronous = FULL")
                conn.execute("PRAGMA foreign_keys = ON")
                conn.execute(sql.SCHEMA_VERSION_DDL)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        before = after = self._read(_schema_version)
        for version, step in enumerate(sql.MIGRATIONS, 1):
            if self._write(_migrate, version, step):
                after = version
        self._write(_create_jobs)
        return before, after

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"sqlite catalog {self._path} is not started (or closed)")
        return self._conn

    def _read(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(self._connection(), *args)

    def _write(self, fn: Callable[..., T], *args: Any) -> T:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn, *args)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                # The first error says what went wrong; a failed rollback adds nothing
                # (SQLite rolls back itself when the connection closes).
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise
        return result


# ---- statements, run in the worker thread (inside _write's transaction for writes) -----

def _schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0])


def _migrate(conn: sqlite3.Connection, version: int, step: tuple[str, ...]) -> bool:
    current = _schema_version(conn)
    if current > len(sql.MIGRATIONS):
        raise LakeError(f"catalog schema version {current} is newer than this build's "
                        f"{len(sql.MIGRATIONS)}", hint="run the quiverd release that wrote it")
    if current >= version:
        return False
    for statement in sql.migration_sql(step, json_type="TEXT", id_type="TEXT"):
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                 (version, time.time_ns()))
    return True


def _create_jobs(conn: sqlite3.Connection) -> None:
    for statement in sql.migration_sql(jobs.JOBS_DDL, json_type="TEXT", id_type="TEXT"):
        conn.execute(statement)


def _select(conn: sqlite3.Connection, query: str, args: list[Any]) -> list[FileRow]:
    return [sql.row_from_record(r) for r in conn.execute(query, args)]


def _insert_file(conn: sqlite3.Connection, values: tuple[Any, ...]) -> None:
    conn.execute(sql.INSERT_FILE, values)


def _set_state(conn: sqlite3.Connection, file_id: str, query: tuple[str, list[Any]]) -> None:
    if conn.execute(*query).rowcount == 0:
        raise KeyError(file_id)


def _update_count(conn: sqlite3.Connection, query: tuple[str, list[Any]]) -> int:
    return conn.execute(*query).rowcount


def _register(conn: sqlite3.Connection, row: FileRow, coverage: list[Coverage],
              values: tuple[Any, ...]) -> bool:
    current = conn.execute(sql.FILE_STATE, (row.file_id,)).fetchone()
    state = current and current["state"]
    if not sql.needs_registration(row.file_id, state):
        stored = conn.execute(sql.FILE_COVERAGE, (row.file_id,)).fetchall()
        sql.check_repeat(row, state, coverage, stored)
        return False
    candidates = conn.execute(sql.OVERLAP_CANDIDATES, sql.overlap_args(row, coverage))
    clash = sql.overlapping_files(coverage, candidates, row.object_key)
    if clash:
        raise DuplicateCoverage(row.file_id, clash)
    conn.execute(sql.UPSERT_REGISTERED, values)
    conn.execute("DELETE FROM coverage WHERE file_id = ?", (row.file_id,))
    conn.executemany(sql.INSERT_COVERAGE, sql.coverage_values(row, coverage))
    return True


def _covered(conn: sqlite3.Connection, source_id: str, shard: int,
             segment_seq: int) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for r in conn.execute(sql.COVERED, (source_id, shard, segment_seq)):
        out.setdefault(r["slot"], set()).update(decode_indexes(r["bundle_indexes"]))
    return out


def _covered_parts(conn: sqlite3.Connection, source_id: str, shard: int,
                   segment_seq: int) -> dict[tuple[int, str], set[int]]:
    return sql.covered_parts(conn.execute(sql.COVERED, (source_id, shard, segment_seq)))


def _record_index(conn: sqlite3.Connection, file_id: str, maps: list[tuple[Any, ...]],
                  indexes: str, now_ns: int) -> None:
    current = conn.execute(sql.FILE_STATE, (file_id,)).fetchone()
    state = sql.index_state(file_id, current and current["state"])
    conn.execute("DELETE FROM zone_maps WHERE file_id = ?", (file_id,))
    conn.executemany(sql.INSERT_ZONE_MAP, maps)
    conn.execute("UPDATE files SET indexes = ?, state = ?, updated_at = ? WHERE file_id = ?",
                 (indexes, state.value, now_ns, file_id))


def _zone_maps(conn: sqlite3.Connection, file_ids: list[str]) -> dict[str, list[ZoneMap]]:
    out: dict[str, list[ZoneMap]] = {}
    for chunk in sql.chunks(file_ids):
        for r in conn.execute(sql.zone_maps_sql(len(chunk)), chunk):
            out.setdefault(r["file_id"], []).append(sql.zone_map_from_record(r))
    return out


def _replace(conn: sqlite3.Connection, old_ids: list[str], new_id: str,
             values: tuple[Any, ...]) -> bool:
    rows_sql, coverage_sql = sql.replace_inputs_sql(len(old_ids))
    if sql.replace_is_done(old_ids, new_id, conn.execute(rows_sql, old_ids).fetchall()):
        return False
    merged = sql.merged_coverage(new_id, conn.execute(coverage_sql, old_ids))
    if conn.execute(sql.UPSERT_REGISTERED, values).rowcount == 0:
        raise ReplaceConflict(f"{new_id} exists and is not unfinished: cannot be the output "
                              "of a compaction")
    conn.execute(f"DELETE FROM coverage WHERE file_id IN {sql.in_list(len(old_ids))}", old_ids)
    conn.executemany(sql.INSERT_COVERAGE, merged)
    conn.execute(sql.compact_sql(len(old_ids)), [new_id, time.time_ns(), *old_ids])
    return True


def _restore(conn: sqlite3.Connection, file_id: str, now_ns: int) -> bool:
    # BEGIN IMMEDIATE holds the write lock from these reads to the commit: no register
    # can take the file's bundles in between.
    found = _select(conn, sql.SELECT_FILES + " WHERE file_id = ?", [file_id])
    if not sql.restore_needed(file_id, found[0].state.value if found else None):
        return False
    row = found[0]
    coverage, args = sql.restore_args(row, conn.execute(sql.FILE_COVERAGE, (file_id,)))
    if args is not None:
        clash = sql.overlapping_files(coverage, conn.execute(sql.OVERLAP_CANDIDATES, args),
                                      row.object_key)
        if clash:
            raise DuplicateCoverage(file_id, clash)
    return conn.execute(sql.RESTORE_ROW, (now_ns, file_id)).rowcount == 1


def _delete_rows(conn: sqlite3.Connection, file_ids: list[str]) -> None:
    for chunk in sql.chunks(file_ids):
        for statement in sql.delete_rows_sql(len(chunk)):
            conn.execute(statement, chunk)


def _decide_job(conn: sqlite3.Connection, decision: JobDecision) -> tuple[JobDecision, bool]:
    # BEGIN IMMEDIATE holds the write lock from this read to the commit: first writer wins.
    stored = conn.execute(jobs.SELECT_JOB, (decision.job_id,)).fetchone()
    if stored is not None:
        return jobs.decision_from_record(stored), False
    conn.execute(jobs.INSERT_JOB, jobs.decision_values(decision))
    return decision, True


def _renew_leases(conn: sqlite3.Connection, node_id: str, job_ids: list[str],
                  now_ns: int) -> None:
    conn.executemany(jobs.UPSERT_LEASE, [(j, node_id, now_ns) for j in job_ids])
    conn.execute(jobs.PRUNE_LEASES, (now_ns - jobs.LEASE_KEEP_NS,))


def _job_leases(conn: sqlite3.Connection, job_ids: list[str],
                exclude_node: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for chunk in sql.chunks(job_ids):
        for r in conn.execute(jobs.select_leases_sql(len(chunk)), [exclude_node, *chunk]):
            out[r["job_id"]] = int(r["renewed_at_ns"])
    return out


def _job_decisions(conn: sqlite3.Connection, job_ids: list[str]) -> dict[str, JobDecision]:
    out: dict[str, JobDecision] = {}
    for chunk in sql.chunks(job_ids):
        for r in conn.execute(jobs.select_jobs_sql(len(chunk)), chunk):
            out[r["job_id"]] = jobs.decision_from_record(r)
    return out
