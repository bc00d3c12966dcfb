"""The lake's invariants, checked after every scheduler step that changed something (a
catalog write, a store change, an Iceberg commit or expiry, an ack): the step's
changes are flagged by the faulty wrappers, and only the parts a step changed are read
again (quiverd's catalog through a read-only SQLite connection, the tables through
pyiceberg, the objects on disk).

  I1 acked rows:   every acked bundle is covered by a registered file (the catalog's
                   coverage rows of registered files), and no piece of a bundle (its
                   slot, in one hour's directory) by two;
                   every registered file's object is in the store.
  I2 projection:   per table and source, with T = the source's files in the current
                   snapshot, R = its registered files:
                   - a commit of the source in this step: T == R as the projector's last
                     catalog read of that table gave it (SPEC §6: "exactly its registered
                     files as of a catalog read made just before the commit"); a
                     killed daemon's worker landing the sync it held (a "zombie") is
                     held to the window below only, as its read may be stale;
                   - no commit of the source: T did not change (nobody else touches it);
                   - always, docs/iceberg.md's window and nothing more: each file of T is
                     registered, or compacted with no file of its replacement chain in T
                     (the replaced files rather than their replacement, the same rows
                     once); no file twice. (Files R has and T lacks wait for the next
                     sync; the final check holds the lake to T == R.)
  I3 keep window:  every data file of every snapshot that was current at any time in the
                   last keep_snapshots_s (its successor's timestamp, as expiry reads it,
                   within the window: expiry keeps those) still exists in the store.
  Final (after the faults stop and the lake settles): every produced bundle is acked,
  T == R for every source and table, and a pyiceberg scan of each table holds every
  acked row exactly once.
"""

from __future__ import annotations

import os
import sqlite3
from collections import Counter
from typing import TYPE_CHECKING, Any

from quiverd.lake.iceberg import table_name
from quiverd.lake.iceberg.catalog import file_id_of, superseded_ms
from quiverd.lake.model import REGISTERED, FileState, decode_indexes

if TYPE_CHECKING:
    from tests.sim.detsim.world import World

REGISTERED_VALUES = tuple(s.value for s in REGISTERED)


class InvariantViolated(AssertionError):
    """An invariant of the module doc does not hold."""


class Row:
    __slots__ = ("file_id", "state", "source_id", "table", "compacted_into", "object_key")

    def __init__(self, record: sqlite3.Row) -> None:
        self.file_id = str(record["file_id"])
        self.state = str(record["state"])
        self.source_id = str(record["source_id"])
        self.table = table_name(str(record["client_name"]), int(record["slot"]))
        self.compacted_into = str(record["compacted_into"] or "")
        self.object_key = str(record["object_key"] or "")


class Checker:
    def __init__(self, world: World, clients: tuple[str, ...] = ("a", "b")) -> None:
        self.world = world
        self.clients = clients  # the producers' client names: one table (slot 0) each
        self.dirty: set[str] = set()
        self.db: sqlite3.Connection | None = None
        self.reader: Any = None
        self.rows: dict[str, Row] = {}
        # source id -> table -> registered file ids in the projector's last read of it
        self.last_read: dict[str, dict[str, set[str]]] = {}
        self.table_files: dict[tuple[str, str], set[str]] = {}  # (table, source) -> T
        self.current: dict[str, int | None] = {}
        self.snap_files: dict[int, set[str]] = {}  # snapshot id -> data file locations
        self.snap_table: dict[int, str] = {}
        self.stopped_ms: dict[int, int] = {}  # snapshot id -> when it stopped being current
        self.out_of_window: set[int] = set()
        self.checks = 0
        self.commits_seen = 0
        self.relaxed: set[str] = set()  # sources whose dead worker landed a sync this step
        self.zombie_commits = 0

    # ---- inputs ---------------------------------------------------------------------
    def changed(self, what: str) -> None:
        self.dirty.add(what.split(".", 1)[0])

    def projector_read(self, source_id: str) -> Any:
        def read(kwargs: dict[str, Any], rows: list[Any]) -> None:
            mine = self.last_read.setdefault(source_id, {})
            if kwargs.get("client") is not None:
                mine[table_name(kwargs["client"], kwargs.get("slot") or 0)] = set()
            else:
                for r in rows:
                    mine[table_name(r.client_name, r.slot)] = set()
            for r in rows:
                if r.state in REGISTERED:
                    mine[table_name(r.client_name, r.slot)].add(r.file_id)

        return read

    def after_step(self, label: str) -> None:
        if not self.dirty:
            return
        parts, self.dirty = self.dirty, set()
        self.check(parts, label)

    # ---- the checks ------------------------------------------------------------------
    def check(self, parts: set[str], label: str = "") -> None:
        self.checks += 1
        if not self._open():
            return
        if parts & {"catalog", "ack", "store", "iceberg"}:
            self._read_rows()
            self._acked_rows_once()
        if "iceberg" in parts:
            self._read_tables()
        if parts & {"catalog", "iceberg"}:
            self._window()
        if parts & {"store", "catalog"}:
            self._registered_objects()
        if parts & {"store", "iceberg"}:
            self._keep_window()
        self.relaxed.clear()

    def _open(self) -> bool:
        if self.db is None:
            if not self.world.catalog_db.exists():
                return False
            self.db = sqlite3.connect(f"file:{self.world.catalog_db}?mode=ro", uri=True,
                                      check_same_thread=False)
            self.db.row_factory = sqlite3.Row
        if self.reader is None:
            names = self.db.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                    "AND name='iceberg_tables'").fetchall()
            if names:
                from pyiceberg.catalog.sql import SqlCatalog

                self.reader = SqlCatalog("quiverd", uri=self.world.iceberg_uri,
                                         warehouse="file://" + str(self.world.root / "objects"),
                                         init_catalog_tables="false")
        return True

    def _read_rows(self) -> None:
        assert self.db is not None
        mine = {d.source_id for d in self.world.daemons}
        self.rows = {r["file_id"]: Row(r) for r in self.db.execute(
            "SELECT file_id, state, source_id, client_name, slot, compacted_into, object_key "
            "FROM files") if r["source_id"] in mine}

    def _acked_rows_once(self) -> None:
        """Each piece of a bundle (its slot, and the hour directory of the file: a slot's
        rows may span hours) in one registered file at most; an acked bundle in one at
        least (one per slot and hour: the final scan counts its rows)."""
        assert self.db is not None
        marks = ",".join("?" * len(REGISTERED_VALUES))
        held: Counter[tuple[str, int, int]] = Counter()
        pieces: dict[tuple[str, int, str, int, int], list[str]] = {}
        for r in self.db.execute(
                "SELECT c.file_id, c.source_id, c.slot, c.segment_seq, c.bundle_indexes, "
                "f.object_key FROM coverage c "
                f"JOIN files f ON f.file_id = c.file_id WHERE f.state IN ({marks})",
                REGISTERED_VALUES):
            part = str(r["object_key"] or "").rsplit("/", 1)[0]
            for idx in decode_indexes(r["bundle_indexes"]):
                held[(str(r["source_id"]), int(r["segment_seq"]), idx)] += 1
                piece = (str(r["source_id"]), int(r["slot"]), part, int(r["segment_seq"]), idx)
                pieces.setdefault(piece, []).append(str(r["file_id"]))
        twice = sorted(k for k, files in pieces.items() if len(files) > 1)
        if twice:
            raise InvariantViolated(f"I1: bundles covered by two registered files: "
                                    f"{[(k, pieces[k]) for k in twice[:5]]}")
        for d in self.world.daemons:
            for seg, idx in d.dispatcher.acked:
                if not held[(d.source_id, seg, idx)]:
                    raise InvariantViolated(
                        f"I1: acked bundle {d.source_id}/0/{seg}/{idx} is in "
                        f"{held[(d.source_id, seg, idx)]} registered files")

    def _registered_objects(self) -> None:
        objects = self.world.root / "objects"
        for row in self.rows.values():
            if row.state in REGISTERED_VALUES and not (objects / row.object_key).is_file():
                raise InvariantViolated(f"I1: registered file {row.file_id} ({row.state}) "
                                        f"has no object at {row.object_key}")

    def _read_tables(self) -> None:
        if self.reader is None:
            self._open()
            if self.reader is None:
                return
        for client in self.clients:
            table = f"quiver.{client}"
            tbl = _load(self.reader, table)
            if tbl is None:
                continue
            snapshots = list(tbl.metadata.snapshots)
            snap = tbl.metadata.current_snapshot()
            snap_id = None if snap is None else snap.snapshot_id
            paths = [] if snap is None else _paths(tbl, snap)
            ids = [file_id_of(p) for p in paths]
            if len(ids) != len(set(ids)):
                raise InvariantViolated(f"I2: {table} holds a data file twice: {sorted(ids)}")
            new = [s for s in snapshots if s.snapshot_id not in self.snap_table]
            for s in new:
                self.snap_table[s.snapshot_id] = table
                self.snap_files[s.snapshot_id] = set(_paths(tbl, s))
            self.stopped_ms.update(superseded_ms(snapshots))
            self.current[table] = snap_id
            committers = {s.summary.additional_properties.get("quiverd.source-id")
                          for s in new if s.summary is not None}
            self.commits_seen += len(new)
            for d in self.world.daemons:
                sid = d.source_id
                mine = {i for i in ids if (row := self.rows.get(i)) is not None
                        and row.source_id == sid}
                unknown = [i for i in ids if i not in self.rows]
                if unknown:
                    raise InvariantViolated(f"I2: {table} holds files quiverd's catalog "
                                            f"does not have: {unknown}")
                key = (table, sid)
                if sid in committers and sid in self.relaxed:
                    # A killed daemon's worker: its catalog read may be stale; only the
                    # window below holds for it, and the daemon's next commit must
                    # match the catalog again.
                    self.zombie_commits += 1
                elif sid in committers:
                    read = self.last_read.get(sid, {}).get(table, set())
                    if mine != read:
                        raise InvariantViolated(
                            f"I2: after a commit of source {sid} {table} holds "
                            f"{sorted(mine)}; the projector's catalog read before it "
                            f"registered {sorted(read)}")
                elif mine != self.table_files.get(key, set()):
                    raise InvariantViolated(f"I2: {table}: files of source {sid} changed "
                                            f"without a commit of its own")
                self.table_files[key] = mine

    def _window(self) -> None:
        for (table, sid), files in self.table_files.items():
            for fid in files:
                row = self.rows.get(fid)
                if row is None:
                    raise InvariantViolated(f"I2: {table} holds {fid} of source {sid}, a "
                                            "file quiverd's catalog no longer has")
                if row.state in REGISTERED_VALUES:
                    continue
                if row.state != FileState.COMPACTED.value:
                    raise InvariantViolated(f"I2: {table} holds {fid}, {row.state}")
                into, seen = row.compacted_into, {fid}
                while into and into not in seen:
                    if into in files:
                        raise InvariantViolated(f"I2: {table} holds {fid} next to {into}, "
                                                "which replaced it")
                    seen.add(into)
                    nxt = self.rows.get(into)
                    into = nxt.compacted_into if nxt is not None else ""

    def _keep_window(self) -> None:
        now_ms = self.world.loop.wall_ns() // 1_000_000
        keep_ms = int(self.world.daemons[0].cfg.lake.iceberg.keep_snapshots_s * 1000)
        for snap_id, files in self.snap_files.items():
            if snap_id in self.out_of_window:
                continue
            stopped = self.stopped_ms.get(snap_id)
            if stopped is not None and now_ms - stopped > keep_ms:
                self.out_of_window.add(snap_id)
                continue
            for location in files:
                if not os.path.exists(location.removeprefix("file://")):
                    age = "current" if stopped is None else f"stopped {now_ms - stopped} ms ago"
                    raise InvariantViolated(
                        f"I3: {location} of snapshot {snap_id} of {self.snap_table[snap_id]} "
                        f"({age}, keep {keep_ms} ms) was deleted from the store")

    # ---- the end -----------------------------------------------------------------------
    def settled(self) -> bool:
        """Every bundle acked and every source's files in each table == its registered
        files (read afresh)."""
        if any(d.dispatcher.bundles or d.produced < self.world.size.bundles
               for d in self.world.daemons):
            return False
        return self.projected()

    def projected(self) -> bool:
        """Every source's files in each table == its registered files (read afresh)."""
        self.check({"catalog", "ack", "iceberg", "store"})
        for table in (f"quiver.{c}" for c in self.clients):
            for d in self.world.daemons:
                registered = {r.file_id for r in self.rows.values() if r.table == table
                              and r.source_id == d.source_id and r.state in REGISTERED_VALUES}
                if self.table_files.get((table, d.source_id), set()) != registered:
                    return False
        return True

    def final_scan(self) -> dict[str, int]:
        """Each table read by a real pyiceberg scan: every acked row exactly once."""
        rows_per_table: dict[str, int] = {}
        for client in self.clients:
            want = sorted(i for d in self.world.daemons for b in d.dispatcher.acked.values()
                          if b.client == client for i in b.tables[0].column("id").to_pylist())
            if not want:
                continue
            tbl = self.reader.load_table(("quiver", client))
            got = sorted(tbl.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist())
            if got != want:
                extra = sorted((Counter(got) - Counter(want)).elements())[:10]
                lost = sorted((Counter(want) - Counter(got)).elements())[:10]
                raise InvariantViolated(f"final: scan of quiver.{client}: {len(got)} rows, "
                                        f"{len(want)} acked; extra {extra}, missing {lost}")
            rows_per_table[client] = len(got)
        return rows_per_table

    def close(self) -> None:
        if self.reader is not None:
            self.reader.engine.dispose()
        if self.db is not None:
            self.db.close()


def _load(reader: Any, table: str) -> Any | None:
    from pyiceberg.exceptions import NoSuchTableError

    try:
        return reader.load_table(("quiver", table.split(".", 1)[1]))
    except NoSuchTableError:
        return None


def _paths(tbl: Any, snapshot: Any) -> list[str]:
    """The data file paths of ``snapshot``, duplicates kept (as
    tests.lake.iceberg_model.snapshot_paths reads the current one)."""
    return [entry.data_file.file_path for manifest in snapshot.manifests(tbl.io)
            for entry in manifest.fetch_manifest_entry(tbl.io, discard_deleted=True)]
