"""Crash states of the lake's local steps: staging files, catalog registration, janitor;
on half the seeds also compaction and the Iceberg projection (tests/sim/lakeiceberg.py),
on a few of those with the catalog in PostgreSQL (tests/sim/lakedb.py).

    seed ─▶ a real in-process daemon with its lake (uploader, indexer, janitor; half the
            seeds: compaction every second and the projection, its worker process
            included) on a LakeModelFS: rounds of tagged bundles, each
            round waited for until the lake registered it (Parquet written in staging/,
            closed and renamed Stable, uploaded, registered, the bundles acked by the
            "uploader" subscriber, the segment deleted, the local copy evicted), with the
            janitor sweeping every second; those seeds then wait for a compaction's whole
            cycle (replace, the replace's Iceberg commit, expiry, the replaced objects
            deleted)
    LakeModelFS ─▶ the ModelFS ops log (WAL, segments, ack.log and the staging files all
            go through the seam) plus a snapshot of the two services the seam does not
            see, taken after each of their changes and before each local barrier (and,
            while the projection's worker commits, every few ms):
              catalog   catalog.sqlite as of its last commit (SQLite's own durability:
                        WAL journal, synchronous=FULL, so a commit that returned is kept);
                        Iceberg's SQL catalog is in it (iceberg_tables)
              store     the objects visible under the store's root (OpenDAL's fs backend
                        writes a temp file, fsyncs and renames it; quiverd fsyncs the
                        parent directories; visible counts as kept, as on S3); Iceberg's
                        metadata, manifest lists and manifests are in it (_iceberg/)
              a capture reads the catalog, walks the store, and starts again if the
              catalog changed meanwhile (the worker is another process)
    crash points ─▶ before each local barrier and after each service change: every cut
            the ModelFS allows, with the services as of that instant

Each distinct crash state (local image + catalog + store) is put back at the run's own
paths (catalog rows name absolute paths) and checked, statically, after quiverd's own
recover_shard:
- recovery succeeds and reports no loss of acknowledged data;
- every registered file's object exists, with the size the row says;
- no (bundle, slot) is covered by two registered files;
- every bundle the durable ack.log says the uploader acked is covered by a registered
  file (the lake acked only what it holds: GC may delete the segment);
- every bundle whose ACK left the daemon is held in the core (segment or WAL) or covered
  by a registered file;
- with Iceberg, lakeiceberg's checks of the tables (current snapshots' files in the
  store, docs/iceberg.md's window, no bundle twice in a snapshot or among the registered
  files, no compaction's input registered next to its output).
A seeded sample is also restarted for real (a daemon on the restored state, lake on)
and run until the lake holds every acknowledged row: each exactly once, nothing twice;
with Iceberg, until the table holds exactly the registered files, and then its scan
holds every acknowledged row exactly once.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.acks.registry import UnknownSubscriber
from quiverd.acks.state import AckState
from quiverd.kernel import config as config_mod
from quiverd.kernel import fs, logs
from quiverd.kernel.faults import Hooks
from quiverd.kernel.layout import DataDir
from quiverd.lake.catalog.pg import PostgresCatalog
from quiverd.lake.catalog.sqlite import SqliteCatalog
from quiverd.lake.model import REGISTERED, decode_indexes
from quiverd.lake.store.names import FS_TMP_DIR
from quiverd.lake.store.objects import ObjectStore
from quiverd.runtime.recovery import recover_shard
from quiverd.segments.reader import SegmentReader
from tests.inprocess import InProcessDaemon
from tests.sim.crashstates import _digest, durable_acks, reported_loss
from tests.sim.lakedb import CatalogDb, PgDb, PgSnapshots, SqliteDb, SqliteSnapshots
from tests.sim.lakeiceberg import (
    ICEBERG_SETTINGS,
    BundleCache,
    TableFacts,
    iceberg_of,
    iceberg_problems,
    projection_watched,
    scan_counts,
    table_settled,
)
from tests.sim.modelfs import BARRIERS, Cut, Image, ModelFS, Op, State
from tests.sim.workload import SETTINGS, short_root, tagged

UPLOADER = "uploader"  # quiverd_actors.uploader.SUBSCRIBER
CLIENT = "p"
REGISTERED_SQL = "(" + ", ".join(f"'{s.value}'" for s in sorted(REGISTERED)) + ")"
CAPTURE_ATTEMPTS = 50
CYCLE_WAIT_S = 20.0  # for a compaction's cycle (_cycled), after the last round
NUDGE_S = 3.0  # with no cycle yet, another bundle this often


def lake_settings(store_root: Path, *, iceberg: bool = False, dsn: str = "") -> dict[str, Any]:
    """The core workload's settings with the lake on: files rotate within tens of ms;
    with ``iceberg``, the projection and compaction on (tests/sim/lakeiceberg.py); with
    ``dsn``, the catalog in that PostgreSQL database."""
    return {**SETTINGS, "lake.enabled": True, "lake.iceberg.enabled": False,
            "lake.store.root": str(store_root), "lake.file_duration_ms": 40,
            "lake.compaction.interval_s": 0, "lake.janitor.interval_s": 1,
            "lake.janitor.grace_s": 0, "lake.scrub.rate_mb_per_s": 0.0,
            **(ICEBERG_SETTINGS if iceberg else {}), **({"catalog.dsn": dsn} if dsn else {})}


# ---- the services' snapshots ----------------------------------------------------------
@dataclass
class Services:
    """The catalog and the store as of one instant (ids into the recorder's snapshots)."""

    catalog: int  # -1: no catalog yet
    store: int


class ServiceRecorder:
    """Snapshots of the catalog database (tests/sim/lakedb.py) and the store's objects,
    taken on demand, kept once per distinct state: ``capture`` returns the ids of the
    state now."""

    def __init__(self, catalog: SqliteSnapshots | PgSnapshots, store_root: Path,
                 scratch: Path) -> None:
        self.catalog, self.store_root, self.scratch = catalog, store_root, scratch
        (scratch / "objects").mkdir(parents=True, exist_ok=True)
        self.stores: list[dict[str, Path]] = []  # key -> a hard link to the object
        self._store_sig: frozenset[tuple[str, int, int]] | None = None
        self._links: dict[tuple[str, int, int], Path] = {}
        self._lock = threading.Lock()

    def capture(self) -> Services:
        """The catalog, then the store; again if the catalog changed meanwhile (the
        projection's worker commits from another process: a store walked after an expiry
        deleted the manifests the catalog as read still points at is no crash state)."""
        with self._lock:
            for _ in range(CAPTURE_ATTEMPTS):
                now = Services(self.catalog.capture(), self._capture_store())
                if not self.catalog.changed_since(now.catalog):
                    return now
            raise AssertionError(f"the catalog kept changing: no consistent snapshot in "
                                 f"{CAPTURE_ATTEMPTS} attempts")

    def _capture_store(self) -> int:
        found: dict[str, tuple[int, int]] = {}
        for dirpath, dirnames, filenames in os.walk(self.store_root):
            if dirpath == str(self.store_root):
                dirnames[:] = [d for d in dirnames if d != FS_TMP_DIR]
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                found[os.path.relpath(path, self.store_root)] = (st.st_ino, st.st_size)
        sig = frozenset((k, ino, size) for k, (ino, size) in found.items())
        if sig == self._store_sig and self.stores:
            return len(self.stores) - 1
        snap: dict[str, Path] = {}
        for key, ino, size in sig:
            link = self._links.get((key, ino, size))
            if link is None:
                link = self.scratch / "objects" / f"{len(self._links)}"
                try:
                    os.link(self.store_root / key, link)
                except FileNotFoundError:
                    continue  # deleted since the walk: absent now
                self._links[(key, ino, size)] = link
            snap[key] = link
        self._store_sig = sig
        self.stores.append(snap)
        return len(self.stores) - 1

    def close(self) -> None:
        self.catalog.close()


class LakeModelFS(ModelFS):
    """A ModelFS that also marks the services' state before each local barrier."""

    def __init__(self, root: Path, services: ServiceRecorder) -> None:
        super().__init__(root, record=True)
        self.services = services
        self._last: Services | None = None

    def note_services(self) -> None:
        with self._lock:
            if self.dead:
                return
            now = self.services.capture()
            if now != self._last:
                self._last = now
                self.ops.append(("mark", "services", {"catalog": now.catalog,
                                                      "store": now.store}))

    def fdatasync(self, fd: int) -> None:
        self.note_services()
        super().fdatasync(fd)

    def fsync_dir(self, path: fs.StrPath) -> None:
        self.note_services()
        super().fsync_dir(path)


@contextmanager
def services_watched(model: LakeModelFS) -> Iterator[None]:
    """After each call of the catalog or the store that may change it: a services mark
    (a crash point in its own right: an upload then a registration has no local barrier
    between them)."""
    patched: list[tuple[type, str, Any]] = []

    def wrap(cls: type, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        async def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                return await original(*args, **kwargs)
            finally:
                model.note_services()

        patched.append((cls, name, original))
        setattr(cls, name, watched)

    for name in ("insert_file", "set_state", "set_state_if", "register", "record_index",
                 "replace", "restore", "forget", "delete_rows", "decide_job"):
        for catalog in (SqliteCatalog, PostgresCatalog):
            if inspect.iscoroutinefunction(getattr(catalog, name, None)):
                wrap(catalog, name)
    for name in ("put_file", "copy", "delete"):
        wrap(ObjectStore, name)
    try:
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)


# ---- the workload ---------------------------------------------------------------------
@dataclass
class LakeRun:
    root: Path
    ops: list[Op]
    services: ServiceRecorder
    iceberg: bool = False  # the projection and compaction on
    dsn: str = ""  # the catalog's PostgreSQL database ("": catalog.sqlite)
    cycled: bool = False  # ... and a compaction's whole cycle happened (_cycled)
    rows_of_tag: dict[int, int] = field(default_factory=dict)  # what was sent
    seq_of_tag: dict[int, int] = field(default_factory=dict)  # the producer's ACKs
    tag_of_id: dict[tuple[int, int], int] = field(default_factory=dict)  # (seg, idx)

    @property
    def db(self) -> CatalogDb:
        """The catalog database at the run's own paths (where crash states go back)."""
        return PgDb(self.dsn) if self.dsn else SqliteDb(DataDir(self.root / "data").catalog_db)


def lake_rows(db: CatalogDb) -> int:
    """Rows the registered files hold (0 before the catalog exists)."""
    got = db.rows(f"SELECT COALESCE(SUM(row_count), 0) AS n FROM files "
                  f"WHERE state IN {REGISTERED_SQL}")
    return int(got[0]["n"]) if got else 0


def wait_until(what: Callable[[], bool], timeout: float, message: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(message())
        time.sleep(0.02)


def run_lake_workload(seed: int, *, rounds: int = 3, dsn: str = "") -> LakeRun:
    """The seeded lake workload; its ops log, service snapshots and what was told. With
    ``dsn``, the catalog is that (empty) PostgreSQL database."""
    from quiverd.client import Client

    rng = random.Random(seed)
    root = short_root()
    store_root = root / "objects"
    iceberg = iceberg_of(seed)
    d = InProcessDaemon(root, lake_settings(store_root, iceberg=iceberg, dsn=dsn))
    d.data_dir.mkdir()
    snaps = PgSnapshots(dsn) if dsn else SqliteSnapshots(DataDir(d.data_dir).catalog_db,
                                                          root / "snaps")
    services = ServiceRecorder(snaps, store_root, root / "snaps")
    model = LakeModelFS(d.data_dir, services)
    run = LakeRun(root=root, ops=model.ops, services=services, iceberg=iceberg, dsn=dsn)
    assert d.data_dir == root / "data"
    db = run.db
    previous = fs.install(model)
    try:
        with services_watched(model), projection_watched(model.note_services):
            d.start()

            def send(n: int, rows: int) -> None:
                """n bundles of ``rows`` rows, acked, then waited for until registered."""
                tags = list(range(len(run.rows_of_tag), len(run.rows_of_tag) + n))
                with Client.connect(d.socket) as c:
                    acks = c.send_many([tagged(t, rows) for t in tags], client=CLIENT)
                for t, ack in zip(tags, acks, strict=True):
                    run.seq_of_tag[t], run.rows_of_tag[t] = ack.sequence, rows
                want = sum(run.rows_of_tag.values())
                wait_until(lambda: lake_rows(db) >= want, 30,
                           lambda: f"seed {seed}: the lake did not take the rows:\n"
                                   f"{d.log()[-3000:]}")

            sweep_after = rng.randrange(rounds)  # the round after which the janitor runs
            for r in range(rounds):
                send(rng.randint(1, 4), rng.choice((10, 200, 1500)))
                time.sleep(rng.choice((0.0, 0.05, 0.3)))  # eviction, gc
                if r == sweep_after:  # a janitor pass (every lake.janitor.interval_s)
                    swept = d.log().count("lake_janitor_swept")
                    wait_until(lambda n=swept: d.log().count("lake_janitor_swept") > n,  # type: ignore[misc]
                               5, lambda: f"seed {seed}: no janitor pass:\n{d.log()[-3000:]}")
            if iceberg:  # not reached: reported after the checks (a bug may stop it)
                # A compaction before the projection's first commit replaces files Iceberg
                # never held: one more small bundle every NUDGE_S makes another.
                deadline = time.monotonic() + CYCLE_WAIT_S
                nudge = time.monotonic() + NUDGE_S
                while not _cycled(d, store_root) and time.monotonic() < deadline:
                    if time.monotonic() > nudge:
                        send(1, 10)
                        nudge = time.monotonic() + NUDGE_S
                    time.sleep(0.05)
                run.cycled = _cycled(d, store_root)
            model.note_services()
            assert d.stop() == 0, d.log()[-3000:]
        problems = model.check_mirror(ignore=("LOCK", "catalog.sqlite"))
        assert not problems, f"changes that bypassed the seam: {problems}"
    finally:
        fs.install(previous)
        d.end()
    run.tag_of_id = _ids_of_tags(store_root)
    return run


def _cycled(d: InProcessDaemon, store_root: Path) -> bool:
    """The lake compacted, Iceberg committed the replace and expired snapshots (fewer
    manifest lists in the store than commits), and the janitor deleted replaced objects."""
    commits = d.events("iceberg_committed")
    if not d.events("lake_compacted") or not any(e["kind"] == "replace" for e in commits):
        return False
    if not any(e.get("compacted_removed") for e in d.events("lake_janitor_swept")):
        return False
    return sum(1 for _ in (store_root / "_iceberg").rglob("snap-*.avro")) < len(commits)


def _ids_of_tags(store_root: Path) -> dict[tuple[int, int], int]:
    """(segment, bundle) -> tag, from the lake's files at the end (the files' bundle
    columns say where each row came from)."""
    out: dict[tuple[int, int], int] = {}
    for path in sorted(store_root.rglob("*.parquet")):
        if FS_TMP_DIR in path.parts:
            continue
        names = ["tag", "_quiver_segment", "_quiver_bundle"]
        t = pq.read_table(path, columns=names)
        for tag, seg, idx in zip(*(t.column(c).to_pylist() for c in names), strict=True):
            out[(seg, idx)] = tag
    return out


# ---- the crash states -----------------------------------------------------------------
@dataclass
class LakeReport:
    points: int = 0
    images: int = 0
    checked: int = 0  # distinct states checked statically
    iceberg_pairs: int = 0  # distinct (catalog, store) pairs with Iceberg data files checked
    behind: int = 0  # distinct states whose tables lag the catalog (the restarts' pool)
    restarted: int = 0  # of them, restarted and run to the end
    violations: list[str] = field(default_factory=list)


@dataclass
class _Told:
    acked: set[int] = field(default_factory=set)  # sequences whose ACK left

    def note(self, op: Op) -> None:
        if op[1] == "acked":
            self.acked.update(op[2]["sequences"])


def check_lake_crash_states(run: LakeRun, *, seed: int, restarts: int = 2,
                            random_cuts: int = 1, stop_at_first: bool = True) -> LakeReport:
    """Check every distinct crash state of ``run``; ``restarts`` of them (seeded) are
    also restarted and run until the lake holds every acknowledged row."""
    rng = random.Random(seed)
    state, told, report = State(), _Told(), LakeReport()
    services = Services(-1, -1)
    seen: set[bytes] = set()
    tables = _TableChecks(run)
    candidates: list[tuple[int, Cut, Image, Services, frozenset[int]]] = []
    for i, op in enumerate([*run.ops, ("end",)]):
        point = op[0] in BARRIERS or op[0] == "end" or (op[0] == "mark"
                                                        and op[1] == "services")
        if op[0] == "mark" and op[1] == "services":
            services = Services(op[2]["catalog"], op[2]["store"])
        if point:
            report.points += 1
            durable = None
            for cut in state.crash_cuts(rng, random_cuts):
                image = state.image(cut)
                report.images += 1
                key = _digest(image) + f"{services.catalog}/{services.store}".encode()
                if key in seen:
                    continue
                seen.add(key)
                report.checked += 1
                if durable is None:
                    durable = state.image(Cut(0, "none"))
                problems = _check_static(run, image, durable, services, told, tables)
                for p in problems:
                    report.violations.append(f"op {i} ({op[0]}), cut {cut}: {p}")
                if problems and stop_at_first:
                    return report
                candidates.append((i, cut, image, services, frozenset(told.acked)))
        if op[0] == "end":
            break
        state.apply(op)
        if op[0] == "mark":
            told.note(op)
    report.iceberg_pairs = tables.with_files
    # The restarts: the last state (everything done) and a seeded sample of the others.
    # With Iceberg the drawn ones come from the states whose tables lag the catalog
    # (a compaction or a registration not yet synced), when there are such: the restart's
    # reconcile must bring them to T == R.
    pool = [c for c in candidates[:-1] if tables.behind(c[3])]
    report.behind = len(pool)
    pool = pool or candidates[:-1]
    picks = [candidates[-1], *rng.sample(pool, min(restarts - 1, len(pool)))]
    for i, cut, image, svc, acked in picks if restarts else []:
        problems = _check_restart(run, image, svc, acked)
        report.restarted += 1
        for p in problems:
            report.violations.append(f"restart from op {i}, cut {cut}: {p}")
        if problems and stop_at_first:
            return report
    return report


def _restore(run: LakeRun, image: Image, services: Services) -> Path:
    """Put a crash state back at the run's own paths; returns the data directory."""
    data_dir, store_root = run.root / "data", run.root / "objects"
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(store_root, ignore_errors=True)
    image.materialize(data_dir)
    run.services.catalog.restore(services.catalog, DataDir(data_dir).catalog_db)
    store_root.mkdir()
    for key, link in (run.services.stores[services.store] if services.store >= 0
                      else {}).items():
        (store_root / key).parent.mkdir(parents=True, exist_ok=True)
        os.link(link, store_root / key)
    return data_dir


def _catalog_facts(db: CatalogDb) -> tuple[dict[str, tuple[str, int]],
                                           list[tuple[str, int, int]]]:
    """Registered files (file_id -> (object_key, compressed_size)) and their coverage
    ((file_id, segment, bundle) for slot 0); nothing before the catalog exists."""
    files = {r["file_id"]: (r["object_key"], r["compressed_size"]) for r in db.rows(
        f"SELECT file_id, object_key, compressed_size FROM files "
        f"WHERE state IN {REGISTERED_SQL}")}
    cover = [(r["file_id"], r["segment_seq"], idx) for r in db.rows(
        "SELECT file_id, segment_seq, bundle_indexes FROM coverage WHERE slot = 0")
        if r["file_id"] in files for idx in decode_indexes(r["bundle_indexes"])]
    return files, cover


def _config(data_dir: Path, store_root: Path, *, iceberg: bool, dsn: str) -> config_mod.Config:
    lines = [f'data_dir = "{data_dir}"']
    sections: dict[str, list[str]] = {}
    for key, value in lake_settings(store_root, iceberg=iceberg, dsn=dsn).items():
        if "." not in key:
            lines.append(f"{key} = {value!r}")
            continue
        section, name = key.rsplit(".", 1)
        v = str(value).lower() if isinstance(value, bool) else (
            f'"{value}"' if isinstance(value, str) else repr(value))
        sections.setdefault(section, []).append(f"{name} = {v}")
    for section, values in sections.items():
        lines += [f"[{section}]", *values]
    return config_mod.loads("\n".join(lines) + "\n")


class _TableChecks:
    """The Iceberg checks (tests/sim/lakeiceberg.py) of each distinct (catalog, store)
    pair: they read only the services, so once per pair."""

    def __init__(self, run: LakeRun) -> None:
        self.run = run
        self.done: dict[tuple[int, int], TableFacts] = {}
        self.cache = BundleCache()
        self.with_files = 0  # pairs whose tables' current snapshots hold data files

    def problems(self, services: Services, db: CatalogDb) -> list[str]:
        key = (services.catalog, services.store)
        if key not in self.done:
            self.done[key] = facts = iceberg_problems(db, self.run.root / "objects",
                                                      self.cache)
            self.with_files += facts.files > 0
        return self.done[key].problems

    def behind(self, services: Services) -> bool:
        """The pair's tables lag their registered files (a sync is due)."""
        facts = self.done.get((services.catalog, services.store))
        return facts is not None and facts.behind


def _check_static(run: LakeRun, image: Image, durable: Image, services: Services,
                  told: _Told, tables: _TableChecks) -> list[str]:
    problems: list[str] = []
    data_dir = _restore(run, image, services)
    store_root = run.root / "objects"
    files, cover = _catalog_facts(run.db)
    if run.iceberg:
        problems += tables.problems(services, run.db)
    for fid, (key, size) in files.items():
        path = store_root / key
        if not path.exists():
            problems.append(f"registered file {fid}: its object {key} is missing")
        elif path.stat().st_size != size:
            problems.append(f"registered file {fid}: object {key} holds "
                            f"{path.stat().st_size} bytes, the row says {size}")
    covered: dict[tuple[int, int], str] = {}
    for fid, seg, idx in cover:
        if (seg, idx) in covered:
            problems.append(f"bundle {(seg, idx)} is covered by files {covered[seg, idx]} "
                            f"and {fid}")
        covered[(seg, idx)] = fid
    acks = durable_acks(durable, run.root / "acks")
    if acks is not None:
        for seg, idx in sorted(run.tag_of_id):
            if _done(acks, seg, idx) and (seg, idx) not in covered:
                problems.append(f"bundle {(seg, idx)} (tag {run.tag_of_id[seg, idx]}) is "
                                "acked by the uploader in the durable ack.log but no "
                                "registered file covers it")
    try:
        rec = recover_shard(0, DataDir(data_dir).shard(0),
                            _config(data_dir, store_root, iceberg=run.iceberg, dsn=run.dsn),
                            Hooks(), logs.get("lakestates"))
    except Exception as exc:  # noqa: BLE001 - a failed recovery is the finding
        return [*problems, f"recovery failed: {type(exc).__name__}: {exc}"]
    try:
        loss = reported_loss(rec, told.acked)
        if loss:
            problems.append(loss)
        held: set[int] = set()
        for seg in rec.segments:
            with SegmentReader.open(seg.path) as reader:
                held.update(b.sequence for b in reader.bundles())
        held.update(b.sequence for b in rec.open_bundles)
        id_of_tag = {tag: sid for sid, tag in run.tag_of_id.items()}
        tag_of_seq = {seq: tag for tag, seq in run.seq_of_tag.items()}
        for seq in sorted(told.acked):
            tag = tag_of_seq.get(seq)
            if seq in held or (tag in id_of_tag and id_of_tag[tag] in covered):
                continue
            problems.append(f"acked sequence {seq} (tag {tag}) is neither in the core nor "
                            "in a registered file")
        if told.acked and rec.next_sequence <= max(told.acked):
            problems.append(f"next sequence {rec.next_sequence} reuses an acked one "
                            f"(max {max(told.acked)})")
        # A segment number the catalog's coverage names, used again, would make new
        # bundles look covered: the uploader would skip them.
        used = {seg for _fid, seg, _idx in cover}
        if used and rec.next_segment_seq <= max(used):
            problems.append(f"next segment number {rec.next_segment_seq} is covered in the "
                            f"catalog (max {max(used)}): new bundles would look uploaded")
    finally:
        rec.wal.close()
        rec.ack_file.close()
    return problems


def _done(acks: AckState, seg: int, idx: int) -> bool:
    try:
        return acks.is_done(UPLOADER, seg, idx)
    except UnknownSubscriber:
        return False


def _check_restart(run: LakeRun, image: Image, services: Services,
                   acked: frozenset[int]) -> list[str]:
    """Restart a daemon on the crash state; the lake must end holding every acked row
    exactly once (and nothing twice)."""
    _restore(run, image, services)
    db = run.db
    tag_of_seq = {seq: tag for tag, seq in run.seq_of_tag.items()}
    want = {tag_of_seq[s] for s in acked if s in tag_of_seq}
    store_root = run.root / "objects"
    d = InProcessDaemon(run.root, lake_settings(store_root, iceberg=run.iceberg, dsn=run.dsn))
    counts: dict[tuple[int, int], int] = {}

    def complete() -> bool:
        nonlocal counts
        counts = _row_counts(store_root, db)
        return all(counts.get((t, i), 0) >= 1 for t in want
                   for i in range(run.rows_of_tag[t])) and (
            not run.iceberg or table_settled(db, store_root, CLIENT))

    d.start()
    try:
        # One bundle more, after the restart: it must reach the lake too (a segment
        # number reused would make it look uploaded already).
        from quiverd.client import Client

        fresh = max(run.rows_of_tag) + 1
        with Client.connect(d.socket) as c:
            c.send_many([tagged(fresh, 7)], client=CLIENT)
        want.add(fresh)
        run.rows_of_tag.setdefault(fresh, 7)
        wait_until(complete, 30, lambda: "the restarted lake did not take every acked "
                   f"row:\n{d.log()[-3000:]}")
        time.sleep(0.2)
        complete()
        code = d.stop()
    finally:
        d.end()
        run.services.catalog.restored = None  # the daemon changed it
    problems = [f"row {key} is in the lake {n} times" for key, n in sorted(counts.items())
                if n > 1][:5]
    if run.iceberg:
        # Every acked row in the table's scan exactly once (T == R held a moment before
        # the stop; a compaction since leaves the replaced files there: the same rows).
        scanned = scan_counts(db, store_root, CLIENT)
        rows = [(t, i) for t in sorted(want) for i in range(run.rows_of_tag[t])]
        problems += [f"acked row {key} is in the Iceberg scan {scanned[key]} times"
                     for key in rows if scanned[key] != 1][:5]
        problems += [f"row {key} is in the Iceberg scan {n} times"
                     for key, n in sorted(scanned.items()) if n > 1][:5]
    if code != 0:
        problems.append(f"the restarted daemon exited {code}")
    return problems


def _row_counts(store_root: Path, db: CatalogDb) -> dict[tuple[int, int], int]:
    """(tag, i) -> how many registered files hold that row."""
    files, _ = _catalog_facts(db)
    counts: dict[tuple[int, int], int] = {}
    for key, _size in files.values():
        try:
            t: pa.Table = pq.read_table(store_root / key, columns=["tag", "i"])
        except FileNotFoundError:
            continue
        for tag, i in zip(t.column("tag").to_pylist(), t.column("i").to_pylist(),
                          strict=True):
            counts[(tag, i)] = counts.get((tag, i), 0) + 1
    return counts


def digest_of(run: LakeRun) -> str:
    """A short digest of a run's ops (for a failure message)."""
    return hashlib.blake2b(repr(run.ops[:50]).encode(), digest_size=6).hexdigest()
