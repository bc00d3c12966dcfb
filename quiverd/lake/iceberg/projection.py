"""The Iceberg projection: quiverd's registered lake files as Iceberg table snapshots.

    sync(table, want, gone, source, base)   what the daemon calls: one snapshot at most
      │ attempt n:  load the table; fenced (stale) when its quiverd.commits.<source> is
      │             not ``base``; diff against the current snapshot: add ``want`` files it
      │             lacks (footers read once per call), delete present ``gone`` ones
      │             ── skipped: files Iceberg cannot hold (files.py), with reasons
      │             snapshot.commit_once: schema evolved, merge append | overwrite,
      │             commit count and skipped-file properties set, one transaction
      └ CommitFailedException (another writer won) -> refresh, backoff, again
        ... at most cfg.commit_retries times, then IcebergCommitFailed: nothing landed
    commit(table, add, remove)              the same without diff or fence (tools, tests)

Guarantees: a call lands as exactly one snapshot or not at all. Files are registered as
they are (never rewritten). ``expire`` drops snapshots that stopped being current
before a bound, never the current one, and deletes only Iceberg metadata no kept
snapshot needs (manifest lists, manifests), never a data file: quiverd's janitor deletes
an object once ``referenced_locations`` no longer holds it.

Blocking: the daemon calls each method in a worker thread, one call per batch; calls on
one table are serialised by a lock per table.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import pyarrow as pa

from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.config import IcebergConfig
from quiverd.kernel.errors import CatalogUnavailable, IcebergCommitFailed, StoreUnavailable
from quiverd.lake.iceberg import catalog as cat
from quiverd.lake.iceberg.files import (
    DataFileRef,
    Footer,
    creation_column,
    nullable,
    read_footer,
    schema_problem,
)
from quiverd.lake.iceberg.names import identifier
from quiverd.lake.iceberg.snapshot import (
    COMMITS_PREFIX,
    KIND,
    commit_once,
    commits_of,
    skip_properties,
)

RETRY_BASE_S = 0.05  # CAS losers retry fast: the winner's commit is already done
RETRY_MAX_S = 2.0
MANIFEST_ENTRIES_CACHED = 100_000  # (location, id) of data files kept: ~30 MB at most


class CommitResult(msgspec.Struct, frozen=True, kw_only=True):
    table: str
    snapshot_id: int | None  # None: nothing to commit (all skipped, nothing to remove)
    added: list[str]  # file ids in the snapshot
    removed: list[str]  # locations deleted from the table
    skipped: list[tuple[str, str]]  # (file_id, reason): files Iceberg cannot hold
    retries: int
    took_s: float
    # sync only: (file_id, reason) of files not added this time (no object, unreadable
    # footer): tried again by the next sync; the table's commit count of the source
    # after the call (the next ``base``); whether the call was fenced off (see sync).
    missing: list[tuple[str, str]] = msgspec.field(default_factory=list)
    commits: int = 0
    stale: bool = False


class Projection:
    """One SQL catalog ("quiverd") and the tables of namespace ``quiver`` in it."""

    def __init__(self, *, catalog_uri: str, warehouse: str, io_properties: dict[str, str],
                 cfg: IcebergConfig) -> None:
        self._cfg = cfg
        self._warehouse = warehouse.rstrip("/")
        self._catalog = cat.open_sql_catalog(catalog_uri, self._warehouse, io_properties)
        self._tables: dict[str, Any] = {}  # loaded pyiceberg Tables, one per table name
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._manifests = cat.ManifestCache(MANIFEST_ENTRIES_CACHED)
        # (table uuid, schema id, file schema) -> the file fits the table as it is.
        self._fits: dict[tuple[str, int, pa.Schema], bool] = {}

    def commit(self, table: str, add: Sequence[DataFileRef], remove: Sequence[str] = (), *,
               summary: Mapping[str, str] | None = None) -> CommitResult:
        """Add ``add`` and delete the files at the locations ``remove`` in one snapshot.

        The unfenced primitive: it does not look at quiverd's catalog, so a caller can
        re-add a replaced file with it. The daemon commits only through ``sync``; this
        stays for tests of the table mechanics (schema evolution, skips, the CAS) and
        for tools that know the exact change."""
        from pyiceberg.exceptions import CommitFailedException

        started = time.monotonic()
        footers, skipped = self._footers(add)
        with self._lock(table), translated(table):
            for attempt in range(self._cfg.commit_retries + 1):
                tbl = self._table(table, footers, refresh=attempt > 0)
                try:
                    deleted = (cat.current_data_files(tbl, set(remove))
                               if tbl is not None and remove else [])
                    snapshot_id, added, removed, unfit = commit_once(
                        tbl, footers, deleted, dict(summary or {}), self._fits)
                except CommitFailedException as exc:
                    self._lost_cas(table, attempt, exc)
                    continue
                return CommitResult(table=table, snapshot_id=snapshot_id, added=added,
                                    removed=removed, skipped=skipped + unfit, retries=attempt,
                                    took_s=time.monotonic() - started)
        raise AssertionError("unreachable: the loop returns or raises")

    def sync(self, table: str, want: Sequence[DataFileRef], gone: Collection[str], *,
             source: str, base: int, summary: Mapping[str, str] | None = None,
             known_skipped: Mapping[str, int] | None = None) -> CommitResult:
        """Make the files of ``source`` in the current snapshot exactly ``want`` (quiverd's
        registered files of that source and table, just read from its catalog): add those
        the snapshot lacks, delete those whose id is in ``gone`` (the source's files the
        catalog holds as not live: compacted, quarantined, abandoned), in one snapshot.
        Other sources' files are left as they are.

        The diff is taken inside each compare-and-swap attempt, against the table as it
        is then, so a commit never re-adds a file another commit of this table removed
        nor adds one twice. ``base`` is the source's commit count the caller last saw
        (``source_commits``, or the previous result's ``commits``), read before its
        catalog read: when the table holds another count, a commit of this source landed
        that the caller's catalog read may predate (a killed daemon's worker, a second
        daemon on the same data directory), and the call changes nothing and returns
        ``stale``: the caller reads the count and the catalog again.

        ``known_skipped`` (file id -> rows): the source's registered files of the table
        that earlier calls found Iceberg cannot hold (not in ``want``); with the ones this
        call finds they are named in the table's properties (``quiverd.skipped-*``), so a
        reader of the table can see what it lacks."""
        from pyiceberg.exceptions import CommitFailedException

        started = time.monotonic()
        key = COMMITS_PREFIX + source
        footers: dict[str, Footer] = {}
        skipped: dict[str, str] = {}
        skipped_rows: dict[str, int] = dict(known_skipped or {})
        missing: dict[str, str] = {}
        gone = set(gone)
        with self._lock(table), translated(table):
            for attempt in range(self._cfg.commit_retries + 1):
                tbl = self._tables.get(table) if attempt == 0 else None
                tbl = tbl if tbl is not None else self._load(table)
                held = commits_of(tbl, key)
                if held != base:
                    return self._result(table, started, attempt, commits=held, stale=True)
                present = cat.current_entries(tbl, self._manifests) if tbl is not None else {}
                ids = {fid for fid, _ in present.values()}
                lacking = [r for r in want if r.file_id not in ids and r.location not in present]
                fresh = [r for r in lacking if r.file_id not in footers
                         and r.file_id not in skipped and r.file_id not in missing]
                self._read_footers(fresh, footers, skipped, missing, skipped_rows)
                adding = [footers[r.file_id] for r in lacking if r.file_id in footers]
                skips = skip_properties(source, skipped_rows)
                props_changed = tbl is not None and any(
                    tbl.metadata.properties.get(k, empty) != v
                    for k, (v, empty) in skips.items())
                doomed = {loc: where for loc, (fid, where) in present.items() if fid in gone}
                deleted = (cat.data_files_in(tbl, set(doomed.values()), set(doomed))
                           if tbl is not None and doomed else [])
                if tbl is None:
                    tbl = self._table(table, adding, refresh=True)
                props = {**(summary or {})}
                if deleted:
                    props[KIND] = "replace"
                try:
                    snapshot_id, added, removed, unfit = commit_once(
                        tbl, adding, deleted, props, self._fits, force=props_changed,
                        properties={key: str(base + 1), **{k: v for k, (v, _) in skips.items()}})
                except CommitFailedException as exc:
                    self._lost_cas(table, attempt, exc)
                    continue
                skipped.update(unfit)
                landed = snapshot_id is not None or props_changed
                return self._result(table, started, attempt, snapshot_id=snapshot_id,
                                    added=added, removed=removed, skipped=skipped,
                                    missing=missing, commits=base + 1 if landed else base)
        raise AssertionError("unreachable: the loop returns or raises")

    def _lost_cas(self, table: str, attempt: int, exc: Exception) -> None:
        """Another writer's commit landed first: reload the table next time and back off,
        or give up after ``commit_retries``."""
        self._tables.pop(table, None)
        if attempt == self._cfg.commit_retries:
            raise IcebergCommitFailed(f"Iceberg commit to {table} lost the compare-and-swap "
                                      f"{attempt + 1} times: {exc}") from exc
        time.sleep(backoff_s(attempt + 1, base_s=RETRY_BASE_S, max_s=RETRY_MAX_S))

    def source_commits(self, table: str, source: str) -> int:
        """How many commits of ``source`` the table holds (0 without a table): the
        ``base`` of the source's next ``sync``."""
        with self._lock(table), translated(table):
            return commits_of(self._load(table), COMMITS_PREFIX + source)

    def live_locations(self, table: str) -> dict[str, str]:
        """location -> quiverd file id of every data file of the current snapshot."""
        with self._lock(table), translated(table):
            tbl = self._load(table)
            if tbl is None or (snap := tbl.metadata.current_snapshot()) is None:
                return {}
            return cat.data_file_ids(tbl, [snap])

    def referenced_locations(self, table: str) -> set[str]:
        """Locations of the data files any unexpired snapshot references."""
        with self._lock(table), translated(table):
            tbl = self._load(table)
            return set() if tbl is None else set(cat.data_file_ids(tbl, tbl.metadata.snapshots))

    def expire(self, table: str, *, older_than_s: float) -> int:
        """Expire snapshots older than ``older_than_s`` (never the current one); returns
        how many. Deletes their manifest lists and the manifests no kept snapshot uses."""
        from pyiceberg.exceptions import CommitFailedException

        with self._lock(table), translated(table):
            for attempt in range(self._cfg.commit_retries + 1):
                tbl = self._load(table)
                if tbl is None:
                    return 0
                try:
                    return cat.expire_snapshots(tbl, time.time() - older_than_s)
                except CommitFailedException as exc:
                    if attempt == self._cfg.commit_retries:
                        raise IcebergCommitFailed(f"expiring snapshots of {table} lost the "
                                                  f"compare-and-swap {attempt + 1} times: "
                                                  f"{exc}") from exc
                    time.sleep(backoff_s(attempt + 1, base_s=RETRY_BASE_S, max_s=RETRY_MAX_S))
                finally:
                    self._tables.pop(table, None)
        raise AssertionError("unreachable: the loop returns or raises")

    def tables(self) -> list[str]:
        """Every table of namespace ``quiver``, as ``quiver.<name>``."""
        with translated("the Iceberg catalog"):
            return cat.list_tables(self._catalog)

    def close(self) -> None:
        self._tables.clear()
        self._catalog.close()

    # -- helpers ------------------------------------------------------------------------------
    def _lock(self, table: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(table, threading.Lock())

    def _footers(self, add: Sequence[DataFileRef]) -> tuple[list[Footer], list[tuple[str, str]]]:
        """Each file's footer, read once per call; the files Iceberg cannot hold, skipped."""
        footers: dict[str, Footer] = {}
        skipped: dict[str, str] = {}
        seen: set[str] = set()
        unique: list[DataFileRef] = []
        for ref in add:
            if ref.location in seen:
                skipped[ref.file_id] = f"{ref.location} is listed twice in one commit"
                continue
            seen.add(ref.location)
            unique.append(ref)
        self._read_footers(unique, footers, skipped, skipped, {})
        return [footers[r.file_id] for r in unique if r.file_id in footers], list(skipped.items())

    def _read_footers(self, refs: Sequence[DataFileRef], footers: dict[str, Footer],
                      skipped: dict[str, str], missing: dict[str, str],
                      skipped_rows: dict[str, int]) -> None:
        """Footers of ``refs`` into ``footers``; a file Iceberg cannot hold into ``skipped``,
        one whose object is absent or unreadable into ``missing`` (it may come back: a
        quarantined object restored; the scrubber quarantines a damaged one)."""
        for ref in refs:
            try:
                footer = read_footer(self._io(), ref)
            except FileNotFoundError:
                missing[ref.file_id] = f"no object at {ref.location}"
                continue
            except pa.ArrowInvalid as exc:
                missing[ref.file_id] = f"not a readable Parquet file: {exc}"
                continue
            except OSError as exc:
                raise StoreUnavailable(f"reading the footer of {ref.location}: {exc}") from exc
            problem = schema_problem(footer.schema)
            if problem is not None:
                skipped[ref.file_id] = problem
                skipped_rows[ref.file_id] = footer.metadata.num_rows
            else:
                footers[ref.file_id] = footer

    def _result(self, table: str, started: float, retries: int, *, snapshot_id: int | None = None,
                added: list[str] | None = None, removed: list[str] | None = None,
                skipped: dict[str, str] | None = None, missing: dict[str, str] | None = None,
                commits: int, stale: bool = False) -> CommitResult:
        return CommitResult(table=table, snapshot_id=snapshot_id, added=added or [],
                            removed=removed or [], skipped=list((skipped or {}).items()),
                            missing=list((missing or {}).items()), retries=retries,
                            took_s=time.monotonic() - started, commits=commits, stale=stale)

    def _io(self) -> Any:
        from pyiceberg.io import load_file_io

        if not hasattr(self, "_file_io"):
            self._file_io = load_file_io(self._catalog.properties, self._warehouse)
        return self._file_io

    def _load(self, table: str) -> Any | None:
        tbl = cat.load_table(self._catalog, identifier(table))
        if tbl is not None:
            self._tables[table] = tbl
        return tbl

    def _table(self, table: str, footers: list[Footer], *, refresh: bool) -> Any | None:
        """The table (cached unless ``refresh``); created from the first file when absent."""
        if not refresh and (tbl := self._tables.get(table)) is not None:
            return tbl
        tbl = self._load(table)
        if tbl is None and footers:
            first = footers[0]
            column = creation_column(first.schema, first.ref.partition_column)
            tbl = cat.create_table(self._catalog, identifier(table), nullable(first.schema),
                                   column, self._warehouse)
            self._tables[table] = tbl
        return tbl


@contextmanager
def translated(what: str) -> Iterator[None]:
    """The catalog's and the store's failures as quiverd's retryable errors. A commit
    interrupted so may or may not have landed: the reconciler compares live_locations
    before adding again, so the caller only retries later."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        raise CatalogUnavailable(f"Iceberg catalog, {what}: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    except OSError as exc:
        raise StoreUnavailable(f"Iceberg metadata of {what}: {exc}") from exc
