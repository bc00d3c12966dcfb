"""The shared catalog: PostgreSQL through asyncpg, for several daemons and readers.

Tables and their layout: see ``quiverd.lake.catalog`` (``indexes`` is jsonb here, file ids
compare bytewise with COLLATE "C" so ordering matches SQLite's).

Concurrency: transactions run at READ COMMITTED. Everything that decides coverage
(``register``, ``replace``) first takes a transaction-scoped advisory lock keyed on the
file's (source_id, shard) (``catalog.lock_key``), then reads. Two registrations of the
same bundles therefore run one after the other, and the second one's overlap query
(a new snapshot per statement at READ COMMITTED) sees the first one's committed coverage:
exactly one succeeds, with no serialization failures to retry. The lock covers only one
(source, shard), so unrelated shards never wait for each other; the rows a call changes
are also locked (SELECT … FOR UPDATE), so ``set_state`` cannot slip between check and write.

Job decisions (``decide_job``) take an advisory lock keyed on the job id
(``jobs.lock_key``), then read and insert: of two daemons deciding a job at once,
the second waits, then reads the first one's decision.

Notifications: ``register``/``replace`` run ``pg_notify('quiver_files', file_id)`` in their
transaction (delivered on commit, to every process LISTENing), ``decide_job`` runs
``pg_notify('quiver_jobs', job_id)`` likewise. One dedicated connection per catalog LISTENs
on both channels and fans the ids out to the ``Notifications`` iterators of each; when it
is lost, the iterators of both end with CatalogUnavailable.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import anyio
import asyncpg

from quiverd.kernel.config import CatalogConfig
from quiverd.kernel.errors import CatalogUnavailable, LakeError
from quiverd.kernel.jobs import JobDecision
from quiverd.kernel.logs import Logger
from quiverd.lake.catalog import jobs, sql
from quiverd.lake.catalog.base import (
    JOBS_CHANNEL,
    NOTIFY_CHANNEL,
    Catalog,
    DuplicateCoverage,
    NotificationHub,
    Notifications,
    ReplaceConflict,
    StateConflict,
)
from quiverd.lake.model import Coverage, FileRow, FileState, ZoneMap, decode_indexes

# A partitioned server (no RST) would otherwise hang a statement forever; a statement
# waiting this long on an advisory lock is as good as an outage too.
STATEMENT_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0
_MIGRATION_LOCK = int.from_bytes(
    hashlib.blake2b(b"quiver/migrations", digest_size=8).digest(), "big", signed=True)
# The server or the way to it failed, not our SQL: connection errors (class 08), shutdown
# and cancellation (57), resources (53), system and I/O errors (58), internal errors (XX),
# deadlocks and serialization failures (40), plus the client's socket errors and timeouts.
_OUTAGES: tuple[type[Exception], ...] = (
    OSError, TimeoutError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.PostgresSystemError, asyncpg.exceptions.InternalServerError,
    asyncpg.exceptions.TransactionRollbackError,
)
_JSON_TYPE, _ID_TYPE = "JSONB", 'TEXT COLLATE "C"'


class PostgresCatalog(Catalog):
    backend = "postgresql"

    def __init__(self, cfg: CatalogConfig, *, log: Logger) -> None:
        self._cfg = cfg
        self._log = log
        self._pool: Any = None  # asyncpg.Pool, created by start()
        self._listener: Any = None  # the LISTEN connection, opened for the first feed
        self._listen_lock = anyio.Lock()
        self._hub = NotificationHub(backend=self.backend, log=log)
        self._job_hub = NotificationHub(backend=self.backend, log=log, channel=JOBS_CHANNEL)
        self._hubs = {NOTIFY_CHANNEL: self._hub, JOBS_CHANNEL: self._job_hub}

    async def start(self) -> None:
        if self._hub.closed:
            raise RuntimeError("postgresql catalog is closed")
        if self._pool is None:
            # min_size=0: no connection is made here, so a server that is down shows up as
            # CatalogUnavailable from the first statement, and start() can simply be retried.
            self._pool = asyncpg.create_pool(
                self._cfg.dsn, min_size=0, max_size=self._cfg.pool_size,
                timeout=self._cfg.connect_timeout_ms / 1000, command_timeout=STATEMENT_TIMEOUT_S)
            with self._unavailable():
                await self._pool
        before, after = await self._migrate()
        self._log.info("catalog_started", backend=self.backend, schema_version=after,
                       migrated_from=before, pool_size=self._cfg.pool_size)

    async def close(self) -> None:
        self._hub.close()
        self._job_hub.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.remove_termination_listener(self._on_listener_lost)
            listener.terminate()  # ends the LISTEN with the session, no round trip needed
        pool, self._pool = self._pool, None
        if pool is not None:
            # Shielded (a close at shutdown runs in a cancelled scope), bounded instead.
            with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as scope:
                await pool.close()
            if scope.cancelled_caught:
                pool.terminate()

    async def insert_file(self, row: FileRow) -> None:
        values = sql.row_values(row, state=row.state, now_ns=time.time_ns())
        with self._unavailable():
            await self._ready().execute(sql.numbered(sql.INSERT_FILE), *values)

    async def set_state(self, file_id: str, state: FileState, /, **fields: Any) -> None:
        pairs = sql.settable_fields(file_id, fields)
        query, args = sql.set_state_query(file_id, state, pairs, time.time_ns())
        with self._unavailable():
            status = await self._ready().execute(sql.numbered(query), *args)
        if status == "UPDATE 0":
            raise KeyError(file_id)

    async def set_state_if(self, file_id: str, state: FileState,
                           only_from: Iterable[FileState], /, **fields: Any) -> bool:
        pairs = sql.settable_fields(file_id, fields)
        query, args = sql.set_state_query(file_id, state, pairs, time.time_ns(), only_from)
        with self._unavailable():
            status = await self._ready().execute(sql.numbered(query), *args)
        return bool(status == "UPDATE 1")

    async def register(self, row: FileRow, coverage: list[Coverage]) -> bool:
        sql.check_coverage(coverage)
        values = sql.row_values(row, state=FileState.META_REGISTERED, now_ns=time.time_ns())
        async with self._transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock($1)",
                               sql.lock_key(row.source_id, row.shard))
            state = await conn.fetchval(sql.numbered(sql.FILE_STATE) + " FOR UPDATE",
                                        row.file_id)
            if not sql.needs_registration(row.file_id, state):
                stored = await conn.fetch(sql.numbered(sql.FILE_COVERAGE), row.file_id)
                sql.check_repeat(row, state, coverage, stored)
                return False
            candidates = await conn.fetch(sql.numbered(sql.OVERLAP_CANDIDATES),
                                          *sql.overlap_args(row, coverage))
            clash = sql.overlapping_files(coverage, candidates, row.object_key)
            if clash:
                raise DuplicateCoverage(row.file_id, clash)
            if await conn.execute(sql.numbered(sql.UPSERT_REGISTERED), *values) == "INSERT 0 0":
                raise StateConflict(f"{row.file_id} left the unfinished states meanwhile")
            await conn.execute("DELETE FROM coverage WHERE file_id = $1", row.file_id)
            await conn.executemany(sql.numbered(sql.INSERT_COVERAGE),
                                   sql.coverage_values(row, coverage))
            await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, row.file_id)
        return True

    async def covered(self, source_id: str, shard: int, segment_seq: int) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for r in await self._fetch(sql.COVERED, source_id, shard, segment_seq):
            out.setdefault(r["slot"], set()).update(decode_indexes(r["bundle_indexes"]))
        return out

    async def covered_parts(self, source_id: str, shard: int, segment_seq: int
                            ) -> dict[tuple[int, str], set[int]]:
        return sql.covered_parts(await self._fetch(sql.COVERED, source_id, shard, segment_seq))

    async def get(self, file_id: str) -> FileRow | None:
        rows = await self._fetch(sql.SELECT_FILES + " WHERE file_id = ?", file_id)
        return sql.row_from_record(rows[0]) if rows else None

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
        return [sql.row_from_record(r) for r in await self._fetch(query[0], *query[1])]

    async def record_index(self, file_id: str, zone_maps: list[ZoneMap],
                           indexes: list[str]) -> None:
        maps = sql.zone_map_values(file_id, zone_maps)
        if len({m[1] for m in maps}) != len(maps):
            raise ValueError(f"{file_id}: a column has two zone maps")
        encoded = sql.settable_fields(file_id, {"indexes": indexes})[0][1]
        async with self._transaction() as conn:
            current = await conn.fetchval(sql.numbered(sql.FILE_STATE) + " FOR UPDATE", file_id)
            state = sql.index_state(file_id, current)
            await conn.execute("DELETE FROM zone_maps WHERE file_id = $1", file_id)
            await conn.executemany(sql.numbered(sql.INSERT_ZONE_MAP), maps)
            await conn.execute("UPDATE files SET indexes = $1, state = $2, updated_at = $3 "
                               "WHERE file_id = $4", encoded, state.value, time.time_ns(), file_id)

    async def zone_maps(self, file_ids: list[str]) -> dict[str, list[ZoneMap]]:
        out: dict[str, list[ZoneMap]] = {}
        for chunk in sql.chunks(file_ids):
            for r in await self._fetch(sql.zone_maps_sql(len(chunk)), *chunk):
                out.setdefault(r["file_id"], []).append(sql.zone_map_from_record(r))
        return out

    async def replace(self, old_ids: list[str], new_row: FileRow) -> None:
        old_ids = list(dict.fromkeys(old_ids))
        new_id, n = new_row.file_id, len(old_ids)
        values = sql.row_values(new_row, state=FileState.META_REGISTERED, now_ns=time.time_ns())
        rows_sql, coverage_sql = sql.replace_inputs_sql(n)
        async with self._transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock($1)",
                               sql.lock_key(new_row.source_id, new_row.shard))
            rows = await conn.fetch(sql.numbered(rows_sql) + " FOR UPDATE", *old_ids)
            if sql.replace_is_done(old_ids, new_id, rows):
                return
            merged = sql.merged_coverage(new_id, await conn.fetch(sql.numbered(coverage_sql),
                                                                  *old_ids))
            if await conn.execute(sql.numbered(sql.UPSERT_REGISTERED), *values) == "INSERT 0 0":
                raise ReplaceConflict(f"{new_id} exists and is not unfinished: cannot be the "
                                      "output of a compaction")
            await conn.execute(sql.numbered(f"DELETE FROM coverage WHERE file_id IN "
                                            f"{sql.in_list(n)}"), *old_ids)
            await conn.executemany(sql.numbered(sql.INSERT_COVERAGE), merged)
            await conn.execute(sql.numbered(sql.compact_sql(n)), new_id, time.time_ns(), *old_ids)
            await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, new_id)

    async def restore(self, file_id: str) -> bool:
        select = sql.numbered(sql.SELECT_FILES + " WHERE file_id = ?")
        async with self._transaction() as conn:
            rec = await conn.fetchrow(select, file_id)
            if rec is not None:
                # register's lock, taken first as register does (no deadlock): no file of
                # this (source, shard) registers until this commits, so none can take
                # the restored file's bundles in between. A file's source and shard
                # never change; its state is read again under the lock.
                await conn.execute("SELECT pg_advisory_xact_lock($1)",
                                   sql.lock_key(rec["source_id"], rec["shard"]))
                rec = await conn.fetchrow(select + " FOR UPDATE", file_id)
            if not sql.restore_needed(file_id, rec and rec["state"]):
                return False
            row = sql.row_from_record(rec)
            coverage, args = sql.restore_args(
                row, await conn.fetch(sql.numbered(sql.FILE_COVERAGE), file_id))
            if args is not None:
                candidates = await conn.fetch(sql.numbered(sql.OVERLAP_CANDIDATES), *args)
                clash = sql.overlapping_files(coverage, candidates, row.object_key)
                if clash:
                    raise DuplicateCoverage(file_id, clash)
            if await conn.execute(sql.numbered(sql.RESTORE_ROW), time.time_ns(),
                                  file_id) != "UPDATE 1":
                return False
            await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, file_id)
        return True

    async def delete_rows(self, file_ids: list[str]) -> None:
        async with self._transaction() as conn:
            for chunk in sql.chunks(file_ids):
                for statement in sql.delete_rows_sql(len(chunk)):
                    await conn.execute(sql.numbered(statement), *chunk)

    def notifications(self) -> Notifications:
        return self._hub.subscribe(ensure=self._ensure_listener)

    async def decide_job(self, decision: JobDecision) -> tuple[JobDecision, bool]:
        checked = jobs.checked_decision(decision, now_ns=time.time_ns())
        async with self._transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock($1)", jobs.lock_key(checked.job_id))
            stored = await conn.fetchrow(sql.numbered(jobs.SELECT_JOB), checked.job_id)
            if stored is not None:
                return jobs.decision_from_record(stored), False
            await conn.execute(sql.numbered(jobs.INSERT_JOB), *jobs.decision_values(checked))
            await conn.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, checked.job_id)
        return checked, True

    async def job_decisions(self, job_ids: Iterable[str]) -> dict[str, JobDecision]:
        out: dict[str, JobDecision] = {}
        for chunk in sql.chunks(list(job_ids)):
            for r in await self._fetch(jobs.select_jobs_sql(len(chunk)), *chunk):
                out[r["job_id"]] = jobs.decision_from_record(r)
        return out

    def job_notifications(self) -> Notifications:
        return self._job_hub.subscribe(ensure=self._ensure_listener)

    async def prune_job_decisions(self, decided_before_ns: int) -> int:
        with self._unavailable():
            status = await self._ready().execute(sql.numbered(jobs.PRUNE_JOBS),
                                                 decided_before_ns)
        return int(status.split()[-1])  # "DELETE <count>"

    async def renew_job_leases(self, node_id: str, job_ids: list[str], now_ns: int) -> None:
        async with self._transaction() as conn:
            if job_ids:
                await conn.executemany(sql.numbered(jobs.UPSERT_LEASE),
                                       [(j, node_id, now_ns) for j in job_ids])
            await conn.execute(sql.numbered(jobs.PRUNE_LEASES), now_ns - jobs.LEASE_KEEP_NS)

    async def job_leases(self, job_ids: list[str], *, exclude_node: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for chunk in sql.chunks(job_ids):
            for r in await self._fetch(jobs.select_leases_sql(len(chunk)), exclude_node, *chunk):
                out[r["job_id"]] = int(r["renewed_at_ns"])
        return out

    # ---- helpers ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _unavailable(self) -> Iterator[None]:
        """Server-side failures become CatalogUnavailable; our own errors pass unchanged."""
        try:
            yield
        except _OUTAGES as exc:
            raise CatalogUnavailable(f"postgresql catalog: {type(exc).__name__}: {exc}") from exc

    def _ready(self) -> Any:
        if self._pool is None:
            raise RuntimeError("postgresql catalog is not started (or closed)")
        return self._pool

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Any]:
        with self._unavailable():
            async with self._ready().acquire() as conn, conn.transaction():
                yield conn

    async def _fetch(self, query: str, *args: Any) -> list[Any]:
        with self._unavailable():
            rows: list[Any] = await self._ready().fetch(sql.numbered(query), *args)
            return rows

    async def _migrate(self) -> tuple[int, int]:
        version_sql = "SELECT coalesce(max(version), 0) FROM schema_version"
        async with self._transaction() as conn:
            # CREATE TABLE IF NOT EXISTS is not safe against a concurrent twin: lock first.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute(sql.SCHEMA_VERSION_DDL)
            before = after = int(await conn.fetchval(version_sql))
        for version, step in enumerate(sql.MIGRATIONS, 1):
            async with self._transaction() as conn:
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
                current = int(await conn.fetchval(version_sql))
                if current > len(sql.MIGRATIONS):
                    raise LakeError(f"catalog schema version {current} is newer than this "
                                    f"build's {len(sql.MIGRATIONS)}",
                                    hint="run the quiverd release that wrote it")
                if current >= version:
                    continue
                for statement in sql.migration_sql(step, json_type=_JSON_TYPE, id_type=_ID_TYPE):
                    await conn.execute(statement)
                await conn.execute("INSERT INTO schema_version (version, applied_at) "
                                   "VALUES ($1, $2)", version, time.time_ns())
                after = version
        async with self._transaction() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            for statement in sql.migration_sql(jobs.JOBS_DDL, json_type=_JSON_TYPE,
                                               id_type=_ID_TYPE):
                await conn.execute(statement)
        return before, after

    async def _ensure_listener(self) -> None:
        async with self._listen_lock:
            self._ready()
            if self._listener is None or self._listener.is_closed():
                await self._listen()

    async def _listen(self) -> None:
        with self._unavailable():
            conn = await asyncpg.connect(self._cfg.dsn,
                                         timeout=self._cfg.connect_timeout_ms / 1000)
            try:
                for channel in self._hubs:
                    await conn.add_listener(channel, self._on_notify)
            except BaseException:
                conn.terminate()
                raise
        if self._pool is None:  # closed while connecting
            conn.terminate()
            return
        conn.add_termination_listener(self._on_listener_lost)
        self._listener = conn

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        self._hubs[channel].publish([payload])

    def _on_listener_lost(self, conn: Any) -> None:
        if conn is self._listener:
            self._listener = None
        self._log.warning("catalog_listener_lost", backend=self.backend)
        for hub, catch_up in ((self._hub, "list_files"), (self._job_hub, "job_decisions")):
            hub.fail(CatalogUnavailable("postgresql catalog: the LISTEN connection was lost; "
                                        f"subscribe again and catch up with {catch_up}"))
