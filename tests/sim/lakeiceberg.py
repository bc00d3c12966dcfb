"""The Iceberg half of the lake's crash states (tests/sim/lakestates.py): the projection
and compaction turned on, the projector's worker watched, one crash state's tables checked.

    settings  ICEBERG_SETTINGS: compaction every second (2 files are enough), replaced
              objects deletable at once, a reconcile pass (and expiry) every second,
              snapshots kept 0.5 s: within a workload the lake compacts, the projection
              commits the replace, expires the snapshots before it, and the janitor
              deletes the replaced objects
    watched   the commits run in a worker process (quiverd.lake.iceberg.remote), which
              neither the seam nor the catalog's wrappers see: a services mark after each
              RemoteProjection.sync/commit/expire returns, and while one is in flight a
              poller marks every POLL_S (a commit's states: metadata written, the
              catalog's pointer not yet swapped; expiry committed, manifests not yet
              deleted)
    checks    per distinct (catalog, store) pair of a crash state, read back with
              pyiceberg's SQL catalog on the restored catalog.sqlite (iceberg_tables is in
              the same database) and the restored store:
              - every table loads (its metadata, manifest list and manifests exist) and
                every data file of its current snapshot is in the store, none twice, each
                a file quiverd's catalog has;
              - per table and source, docs/iceberg.md's window (detsim's I2, its own code):
                each file of the snapshot is registered, or compacted with no file of its
                replacement chain in the snapshot;
              - no bundle (segment, index, as the files' own columns say) is in two files
                of the snapshot, nor in two registered files;
              - no file counts as registered while the compaction output that replaced
                it does too.
    restart   every acked row in the table's pyiceberg scan exactly once, after the
              table's files equalled the registered files (T == R).
"""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow.parquet as pq

from quiverd.lake.iceberg import table_name
from quiverd.lake.iceberg.catalog import file_id_of
from quiverd.lake.iceberg.remote import RemoteProjection
from quiverd.lake.model import REGISTERED, FileState
from tests.sim.detsim.checks import Checker, InvariantViolated, Row, _paths
from tests.sim.lakedb import CatalogDb

ICEBERG_SETTINGS: dict[str, Any] = {
    "lake.iceberg.enabled": True, "lake.iceberg.keep_snapshots_s": 0.5,
    "lake.iceberg.reconcile_interval_s": 1.0, "lake.iceberg.linger_ms": 20,
    "lake.compaction.interval_s": 1, "lake.compaction.min_files": 2,
    "lake.compaction.delete_grace_s": 0,
}
POLL_S = 0.01  # the poller's period while a projector call is in flight
WRITES = ("sync", "commit", "expire")  # RemoteProjection's calls that change a table
BUNDLE_COLUMNS = ["_quiver_segment", "_quiver_bundle"]
REGISTERED_VALUES = frozenset(s.value for s in REGISTERED)


def iceberg_of(seed: int) -> bool:
    """Half the seeds (1 and 2 mod 4: both test chunks get some) run with Iceberg and
    compaction on."""
    return seed % 4 in (1, 2)


def on_postgresql(seed: int) -> bool:
    """A quarter of those (5 and 6 mod 8) with the catalog in PostgreSQL."""
    return seed % 8 in (5, 6)


# ---- the worker's changes as crash points -----------------------------------------------
@contextmanager
def projection_watched(note: Callable[[], None]) -> Iterator[None]:
    """A services mark (``note``) after each RemoteProjection write returns, and every
    POLL_S while one is in flight."""
    inflight = [0]
    lock = threading.Lock()
    busy, done = threading.Event(), threading.Event()

    def poll() -> None:
        while not done.is_set():
            busy.wait(0.2)
            if busy.is_set():
                note()
                done.wait(POLL_S)

    patched: list[tuple[str, Any]] = []

    def wrap(name: str) -> None:
        original = getattr(RemoteProjection, name)

        @functools.wraps(original)
        async def watched(*args: Any, **kwargs: Any) -> Any:
            with lock:
                inflight[0] += 1
                busy.set()
            try:
                return await original(*args, **kwargs)
            finally:
                with lock:
                    inflight[0] -= 1
                    if not inflight[0]:
                        busy.clear()
                note()

        patched.append((name, original))
        setattr(RemoteProjection, name, watched)

    for name in WRITES:
        wrap(name)
    poller = threading.Thread(target=poll, name="lake-iceberg-poller", daemon=True)
    poller.start()
    try:
        yield
    finally:
        done.set()
        poller.join()
        for name, original in patched:
            setattr(RemoteProjection, name, original)


# ---- reading a state's tables -----------------------------------------------------------
@contextmanager
def iceberg_reader(db: CatalogDb, store_root: Path) -> Iterator[Any | None]:
    """pyiceberg's SQL catalog on ``db`` (None before the projection made its tables)."""
    from pyiceberg.catalog.sql import SqlCatalog

    if not (db.has_table("iceberg_tables") and db.has_table("iceberg_namespace_properties")):
        # pyiceberg makes its two tables one after the other (SQLite: a transaction each),
        # and makes any missing one when it opens: until both exist there is no table.
        yield None
        return
    catalog = SqlCatalog("quiverd", uri=db.iceberg_uri, warehouse=f"file://{store_root}",
                         init_catalog_tables="false")
    try:
        yield catalog
    finally:
        catalog.engine.dispose()


def current_files(catalog: Any) -> dict[str, list[str]]:
    """table -> the data file paths of its current snapshot (duplicates kept)."""
    from pyiceberg.exceptions import NoSuchNamespaceError

    out: dict[str, list[str]] = {}
    try:
        idents = catalog.list_tables("quiver")
    except NoSuchNamespaceError:
        return out  # the catalog's tables made, no table yet
    for ident in idents:
        tbl = catalog.load_table(ident)
        snap = tbl.metadata.current_snapshot()
        out[".".join(ident)] = [] if snap is None else _paths(tbl, snap)
    return out


def file_rows(db: CatalogDb) -> dict[str, Row]:
    """quiverd's catalog rows (every state), as detsim's checker reads them."""
    return {str(r["file_id"]): Row(cast(Any, r)) for r in db.rows(
        "SELECT file_id, state, source_id, client_name, slot, compacted_into, object_key "
        "FROM files")}


class BundleCache:
    """(segment, bundle) pairs of a lake object, read once per path (objects are
    immutable: a key is written once, by conditional create)."""

    def __init__(self) -> None:
        self.pairs: dict[str, frozenset[tuple[int, int]]] = {}

    def of(self, path: str) -> frozenset[tuple[int, int]] | None:
        if path not in self.pairs:
            try:
                t = pq.read_table(path, columns=BUNDLE_COLUMNS)
            except FileNotFoundError:
                return None
            cols = (t.column(c).to_pylist() for c in BUNDLE_COLUMNS)
            self.pairs[path] = frozenset(zip(*cols, strict=True))
        return self.pairs[path]


# ---- the checks of one crash state ------------------------------------------------------
@dataclass
class TableFacts:
    """What the checks of one (catalog, store) pair found."""

    problems: list[str]
    files: int = -1  # data files in the tables' current snapshots (-1: no table yet)
    behind: bool = False  # some table's files are not its registered files (T != R)


def iceberg_problems(db: CatalogDb, store_root: Path, cache: BundleCache) -> TableFacts:
    """The module doc's checks of the state restored at ``db`` and ``store_root``."""
    rows = file_rows(db)
    problems = _registered_once(rows, store_root, cache)
    registered: dict[str, set[str]] = {}
    for fid, r in rows.items():
        if r.state in REGISTERED_VALUES:
            registered.setdefault(r.table, set()).add(fid)
    if not db.has_table("iceberg_namespace_properties") and db.rows(
            "SELECT table_name FROM iceberg_tables"):
        problems.append("Iceberg: tables in a catalog without its namespace table")
    with iceberg_reader(db, store_root) as catalog:
        if catalog is None:
            return TableFacts(problems, behind=bool(registered))
        try:
            tables = current_files(catalog)
        except Exception as exc:  # noqa: BLE001 - an unreadable table is the finding
            return TableFacts([*problems, f"Iceberg: a table does not load: "
                                          f"{type(exc).__name__}: {exc}"], 0)
    for table, paths in sorted(tables.items()):
        problems += _table_problems(table, paths, rows, cache)
    behind = any({file_id_of(p) for p in tables.get(t, [])} != ids
                 for t, ids in registered.items())
    return TableFacts(problems, sum(len(p) for p in tables.values()) if tables else -1,
                      behind)


def _table_problems(table: str, paths: list[str], rows: dict[str, Row],
                    cache: BundleCache) -> list[str]:
    problems: list[str] = []
    ids = [file_id_of(p) for p in paths]
    for path in paths:
        if not os.path.exists(path.removeprefix("file://")):
            problems.append(f"Iceberg: {table}'s current snapshot holds {path}, absent from "
                            "the store")
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    if twice:
        problems.append(f"Iceberg: {table} holds data files twice: {twice}")
    unknown = sorted(i for i in ids if i not in rows)
    if unknown:
        problems.append(f"Iceberg: {table} holds files quiverd's catalog lacks: {unknown}")
    # detsim's I2 window, its own code: per (table, source), T's files registered, or
    # compacted with no file of their replacement chain in T.
    checker = Checker(cast(Any, None))
    checker.rows = rows
    for fid in ids:
        if fid in rows:
            checker.table_files.setdefault((table, rows[fid].source_id), set()).add(fid)
    try:
        checker._window()
    except InvariantViolated as exc:
        problems.append(f"Iceberg: {exc}")
    holder: dict[tuple[int, int], str] = {}
    for path, fid in zip(paths, ids, strict=True):
        for pair in cache.of(path.removeprefix("file://")) or ():
            if pair in holder and holder[pair] != fid:
                problems.append(f"Iceberg: bundle {pair} is in {table}'s files "
                                f"{holder[pair]} and {fid}")
                return problems
            holder[pair] = fid
    return problems


def _registered_once(rows: dict[str, Row], store_root: Path, cache: BundleCache) -> list[str]:
    """No bundle in two registered files (their own columns: coverage rows move with a
    compaction), and no file registered next to the output that replaced it."""
    problems: list[str] = []
    registered = {fid: r for fid, r in rows.items() if r.state in REGISTERED_VALUES}
    for fid, r in sorted(registered.items()):
        out = rows.get(r.compacted_into) if r.compacted_into else None
        if out is not None and out.state in REGISTERED_VALUES:
            problems.append(f"file {fid} is registered and so is {out.file_id}, the "
                            "compaction output that replaced it")
    compacted_into = {r.compacted_into for r in rows.values()
                      if r.state == FileState.COMPACTED.value and r.compacted_into}
    holder: dict[tuple[int, int], str] = {}
    for fid, r in sorted(registered.items()):
        for pair in cache.of(str(store_root / r.object_key)) or ():
            if pair in holder:
                kind = "a compaction output" if fid in compacted_into else "registered"
                problems.append(f"bundle {pair} is in registered files {holder[pair]} and "
                                f"{fid} ({kind})")
                return problems
            holder[pair] = fid
    return problems


# ---- the restart's end ------------------------------------------------------------------
def table_settled(db: CatalogDb, store_root: Path, client: str) -> bool:
    """The table of ``client`` holds exactly its registered files (T == R)."""
    rows = file_rows(db)
    want = {fid for fid, r in rows.items() if r.state in REGISTERED_VALUES
            and r.table == table_name(client, 0)}
    with iceberg_reader(db, store_root) as catalog:
        if catalog is None:
            return not want
        with suppress(Exception):  # not there yet, or mid-commit: not settled
            got = current_files(catalog).get(table_name(client, 0), [])
            return {file_id_of(p) for p in got} == want and len(got) == len(want)
    return False


def scan_counts(db: CatalogDb, store_root: Path, client: str) -> Counter[tuple[int, int]]:
    """(tag, i) -> how often a pyiceberg scan of the table of ``client`` holds it."""
    with iceberg_reader(db, store_root) as catalog:
        if catalog is None:
            return Counter()
        from pyiceberg.exceptions import NoSuchTableError

        try:
            tbl = catalog.load_table(("quiver", client))
        except NoSuchTableError:
            return Counter()
        t = tbl.scan(selected_fields=("tag", "i")).to_arrow()
    return Counter(zip(t.column("tag").to_pylist(), t.column("i").to_pylist(), strict=True))
