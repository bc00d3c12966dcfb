"""The dead letters as Iceberg tables: one per client, in a namespace of their own.

    catalog    the projection's SQL catalog "quiverd" (quiverd's catalog database)
    namespace  quiver_dead_letters (the projection's is ``quiver``: a sibling, not a
               level under it, so ``names.parse_table_name`` never reads one of these as
               a client's table, and the projection's reconciler, which lists and syncs
               only ``quiver``, never touches them)
    tables     quiver_dead_letters.<client>, one per client (the slot is a column); the
               identifier is a tuple, so a client name with dots stays one name, and
               client names are unique, so no two clients share a table
    schema     the first file's (quiverd.lake.dead_letters.SCHEMA), every column
               optional; unpartitioned (dead letters are few)
    data       the dead-letter objects themselves, registered as written:
               dead_letters/client=<client>/date=<day>/<node>_<shard>_<seg>_<bundle>.parquet
    metadata   <warehouse>/_iceberg/quiver_dead_letters/client=<client>/metadata/...
               ("client=<client>", never the bare name: a client may be called "..")

Idempotent by location: ``add`` and ``remove`` read the current snapshot's files inside
each compare-and-swap attempt, so an add repeated after a crash (between the commit and
the bundle's REJECT the bundle is delivered again) finds its file and changes nothing,
and a file is never in a table twice. Each commit then expires the table's snapshots that
stopped being current over ``keep_snapshots_s`` ago, so history stays bounded.

``DeadLetterTables`` blocks (pyiceberg): the CLI calls it in a worker thread, the daemon
through ``RemoteDeadLetterTables``, in the projection's worker process (pyiceberg holds
the GIL for its commits and keeps a thread pool of its own: neither belongs in the
daemon's process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_process

from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.config import Config, IcebergConfig
from quiverd.kernel.errors import (
    CatalogUnavailable,
    IcebergCommitFailed,
    LakeError,
    StoreUnavailable,
)
from quiverd.lake.iceberg import catalog as cat
from quiverd.lake.iceberg.files import DataFileRef, nullable, read_footer, schema_problem
from quiverd.lake.iceberg.names import METADATA_PREFIX, NAMESPACE, catalog_uri, location
from quiverd.lake.iceberg.projection import translated
from quiverd.lake.iceberg.remote import Settings, die_with_parent, failure
from quiverd.lake.iceberg.snapshot import commit_once

DEAD_LETTER_NAMESPACE = "quiver_dead_letters"
assert DEAD_LETTER_NAMESPACE != NAMESPACE and not DEAD_LETTER_NAMESPACE.startswith(NAMESPACE + ".")
KIND = "quiverd.kind"
RETRY_BASE_S = 0.05
RETRY_MAX_S = 2.0


def identifier(client: str) -> tuple[str, str]:
    """``("quiver_dead_letters", client)``: a tuple, so dots in a client name stay in it."""
    return DEAD_LETTER_NAMESPACE, client


def table_name(client: str) -> str:
    return f"{DEAD_LETTER_NAMESPACE}.{client}"


def table_location(warehouse_uri: str, client: str) -> str:
    """``<warehouse>/_iceberg/quiver_dead_letters/client=<client>``."""
    return location(warehouse_uri, f"{METADATA_PREFIX}/{DEAD_LETTER_NAMESPACE}/client={client}")


def settings_of(cfg: Config, warehouse_uri: str, io_properties: dict[str, str], *,
                parent_pid: int = 0) -> Settings:
    """What opens the tables: the projection's catalog and warehouse (``tier.store``)."""
    return Settings(catalog_uri=catalog_uri(cfg.catalog, Path(cfg.data_dir)),
                    warehouse=warehouse_uri, io_properties=io_properties,
                    cfg=cfg.lake.iceberg, parent_pid=parent_pid)


class DeadLetterTables:
    """The tables of namespace ``quiver_dead_letters`` (blocking)."""

    def __init__(self, *, catalog_uri: str, warehouse: str, io_properties: dict[str, str],
                 cfg: IcebergConfig) -> None:
        self._cfg = cfg
        self._warehouse = warehouse.rstrip("/")
        with translated("the Iceberg catalog"):
            self._catalog = cat.open_sql_catalog(catalog_uri, self._warehouse, io_properties)
        self._lock = threading.Lock()  # one commit at a time (they are rare)
        self._fits: dict[Any, bool] = {}

    def add(self, client: str, location_uri: str) -> bool:
        """Register the dead-letter object at ``location_uri`` in the client's table
        (created from it when absent); False when the table holds it already."""
        from pyiceberg.exceptions import CommitFailedException

        ref = DataFileRef(file_id=_name_of(location_uri), location=location_uri,
                          client=client, slot=0, partition_column="")
        with self._lock, translated(table_name(client)):
            footer = read_footer(self._io(), ref)
            problem = schema_problem(footer.schema)
            if problem is not None:  # not for SCHEMA: a programming error, told loudly
                raise LakeError(f"dead letter {location_uri}: {problem}")
            for attempt in range(self._cfg.commit_retries + 1):
                tbl = cat.load_table(self._catalog, identifier(client))
                if tbl is None:
                    tbl = self._create(client, footer.schema)
                if location_uri in self._live(tbl):
                    return False
                try:
                    _, added, _, unfit = commit_once(tbl, [footer], [], {KIND: "dead-letter"},
                                                     self._fits)
                except CommitFailedException as exc:
                    self._lost_cas(client, attempt, exc)
                    continue
                if unfit or not added:
                    raise LakeError(f"dead letter {location_uri} does not fit "
                                    f"{table_name(client)}: {unfit}")
                self._expire(client)
                return True
        raise AssertionError("unreachable: the loop returns or raises")

    def remove(self, client: str, locations: Sequence[str]) -> list[str]:
        """Delete the data files at ``locations`` from the client's table, in one
        snapshot; the locations it held (absent ones are no change)."""
        from pyiceberg.exceptions import CommitFailedException

        with self._lock, translated(table_name(client)):
            for attempt in range(self._cfg.commit_retries + 1):
                tbl = cat.load_table(self._catalog, identifier(client))
                if tbl is None:
                    return []
                doomed = cat.current_data_files(tbl, set(locations))
                if not doomed:
                    return []
                try:
                    _, _, removed, _ = commit_once(tbl, [], doomed, {KIND: "dead-letter-replay"},
                                                   self._fits)
                except CommitFailedException as exc:
                    self._lost_cas(client, attempt, exc)
                    continue
                self._expire(client)
                return removed
        raise AssertionError("unreachable: the loop returns or raises")

    def locations(self, client: str) -> set[str]:
        """The locations of the data files in the client's table's current snapshot."""
        with self._lock, translated(table_name(client)):
            tbl = cat.load_table(self._catalog, identifier(client))
            return set() if tbl is None else self._live(tbl)

    def clients(self) -> list[str]:
        """The clients with a dead-letter table."""
        from pyiceberg.exceptions import NoSuchNamespaceError

        with translated("the Iceberg catalog"):
            try:
                return sorted(ident[-1] for ident in
                              self._catalog.list_tables(DEAD_LETTER_NAMESPACE))
            except NoSuchNamespaceError:
                return []

    def close(self) -> None:
        self._catalog.close()

    # -- helpers ------------------------------------------------------------------------------
    def _create(self, client: str, schema: Any) -> Any:
        from pyiceberg.catalog import Catalog
        from pyiceberg.exceptions import NamespaceAlreadyExistsError, TableAlreadyExistsError
        from pyiceberg.schema import assign_fresh_schema_ids
        from sqlalchemy.exc import IntegrityError

        try:
            self._catalog.create_namespace(DEAD_LETTER_NAMESPACE)
        except (NamespaceAlreadyExistsError, IntegrityError):
            pass  # made before, or by another daemon between its check and insert
        iceberg_schema = assign_fresh_schema_ids(
            Catalog._convert_schema_if_needed(nullable(schema), format_version=2))
        try:
            return self._catalog.create_table(
                identifier(client), schema=iceberg_schema,
                location=table_location(self._warehouse, client),
                properties=cat.TABLE_PROPERTIES)
        except TableAlreadyExistsError:
            return self._catalog.load_table(identifier(client))

    def _live(self, tbl: Any) -> set[str]:
        snap = tbl.metadata.current_snapshot()
        return set() if snap is None else set(cat.data_file_ids(tbl, [snap]))

    def _expire(self, client: str) -> None:
        """Best effort: a lost race leaves the snapshots to the next commit's expiry."""
        from pyiceberg.exceptions import CommitFailedException

        tbl = cat.load_table(self._catalog, identifier(client))
        if tbl is not None:
            try:
                cat.expire_snapshots(tbl, time.time() - self._cfg.keep_snapshots_s)
            except CommitFailedException:
                pass

    def _lost_cas(self, client: str, attempt: int, exc: Exception) -> None:
        if attempt == self._cfg.commit_retries:
            raise IcebergCommitFailed(f"Iceberg commit to {table_name(client)} lost the "
                                      f"compare-and-swap {attempt + 1} times: {exc}") from exc
        time.sleep(backoff_s(attempt + 1, base_s=RETRY_BASE_S, max_s=RETRY_MAX_S))

    def _io(self) -> Any:
        from pyiceberg.io import load_file_io

        if not hasattr(self, "_file_io"):
            self._file_io = load_file_io(self._catalog.properties, self._warehouse)
        return self._file_io


def _name_of(location_uri: str) -> str:
    return location_uri.rsplit("/", 1)[-1].removesuffix(".parquet")


# ---- the daemon's bridge: calls in the projection's worker process ----------------------------
_opened: tuple[Settings, DeadLetterTables] | None = None  # worker side, one per process


def call(settings: Settings, method: str, args: tuple[Any, ...]) -> tuple[str, Any]:
    """In the worker: ``DeadLetterTables.<method>(*args)`` as ("ok", result) or
    (kind, message), kind catalog | store | commit | error (exceptions are not pickled)."""
    global _opened
    die_with_parent(settings.parent_pid)
    try:
        if _opened is None or _opened[0] != settings:
            if _opened is not None:
                _opened[1].close()
                _opened = None
            _opened = (settings, DeadLetterTables(
                catalog_uri=settings.catalog_uri, warehouse=settings.warehouse,
                io_properties=settings.io_properties, cfg=settings.cfg))
        return "ok", getattr(_opened[1], method)(*args)
    except Exception as exc:  # noqa: BLE001 - every error is told to the daemon
        return failure(exc)


_ERRORS: dict[str, type[LakeError]] = {"catalog": CatalogUnavailable, "store": StoreUnavailable,
                                       "commit": IcebergCommitFailed}


class RemoteDeadLetterTables:
    """``DeadLetterTables.add``/``locations``, awaited; each one call into a worker
    process (anyio's pool: the projection's warm worker when it is idle)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limiter = anyio.CapacityLimiter(1)

    async def add(self, client: str, location_uri: str) -> bool:
        added: bool = await self._call("add", client, location_uri)
        return added

    async def locations(self, client: str) -> set[str]:
        found: set[str] = await self._call("locations", client)
        return found

    async def _call(self, method: str, *args: Any) -> Any:
        kind, value = await anyio.to_process.run_sync(call, self.settings, method, args,
                                                      cancellable=True, limiter=self.limiter)
        if kind == "ok":
            return value
        raise _ERRORS.get(kind, LakeError)(f"dead-letter table ({method}): {value}")
