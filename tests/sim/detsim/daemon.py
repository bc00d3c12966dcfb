"""Deterministic simulation of whole daemons (issue 28, item 4): each daemon's real shard
(as in ``core``: WAL writer with its lock-step threads, segment builder, finalizer,
dispatcher, ack logger, gc) feeds its real lake (as in the package: uploader, indexer,
janitor with compaction, projector with Iceberg in-process), on a ModelFS; one or two
daemons share one catalog database and one store with the lake's faults, under one
seeded SimLoop; each daemon loses power at seeded times (or is killed, when its
projection worker is to land a sync after the daemon died).

    run_daemon(seed) ─▶ CoreLoop ─ per daemon, life 0: Shard.recover, run; subscribers "s"
                                 │   and "uploader"
                                 │   producer ─AppendRequests─▶ WAL ─▶ segment ─▶ dispatcher
                                 │   dispatcher ─▶ "s" (acks or nacks by seed)
                                 │              └▶ Lake: uploader ─▶ staging/ (the ModelFS)
                                 │                   ─▶ FaultyOperator ─▶ <root>/objects
                                 │                   ─▶ FaultyCatalog ─▶ <root>/catalog.sqlite
                                 │                   ─▶ ack ─▶ ack.log ─▶ gc; projector ─▶ Iceberg
                                 │   power cut at a seeded time: ModelFS.crash(), the daemon's
                                 │   task group cancelled, its catalog and store calls refused
                                 │   from that instant; a drawn Cut checked (crashstates) and
                                 │   put back at the same data directory (the catalog names its
                                 │   paths); the catalog and the store keep what they hold
                                 ├─ life 1..k: a new ModelFS, Shard and Lake recover it
                                 └─ last life: production ends, "s" acks every acked bundle,
                                    the lake settles (every bundle acked by the uploader, T == R
                                    for each table, and 200 s more); once every daemon has, the
                                    final scan; then each daemon's last cut, checked

One seam serves the process (``fs.active()``): ``RoutingFS`` sends each call to the
ModelFS of the daemon whose task or WAL thread makes it (``CURRENT``, a context variable
each daemon's tasks and threads inherit). At each cut the data directory must mirror its
model (nothing bypassed the seam).

Checked after every step: the core's C1-C3 (``core.CoreFS``; C2 and C3 for both
subscribers) and the lake's I1-I3 (``checks.Checker``; "acked" is the uploader's ack of a
bundle, recorded as it is handed to the dispatcher). At each cut, the crash-state check
of the image. At the end: every row of every producer-acked bundle is in the Iceberg scan
exactly once, and nothing else is there but whole bundles that were sent (a bundle whose
ACK a cut lost may still be in the lake, once). The same seed gives the same trace
(``DaemonResult.digest``).

    PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.detsim.daemon SEED [SEED ...] [--json]
        [--daemons N] [--bundles N] [--smoke] [--harsh] [--trace N] [--plant NAME]
        [--no-faults] [--janitor-grace-s S] [--janitor-interval-s S] [--size-cap-bytes N]

Planted bugs (tests/sim/mutations.py) it catches: lake_ack_before_register (I1 at the
first ack), ack_before_fdatasync (C1), acklog_append_not_synced (C2),
segment_rename_without_dir_fsync (a cut's image, seed 1); ``--plant`` no_removals (I2),
expire_now (I3).
"""

from __future__ import annotations

import argparse
import contextvars
import inspect
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import msgspec
import opendal
import opendal.exceptions as oe

import quiverd.runtime.lake as runtime_lake
from quiverd.acks import format as ackfmt
from quiverd.acks.registry import UnknownSubscriber
from quiverd.acks.state import AckState
from quiverd.kernel import fs
from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.config import CatalogConfig, Config
from quiverd.kernel.errors import CatalogUnavailable
from quiverd.kernel.faults import Hooks
from quiverd.kernel.fs import FileSystem
from quiverd.kernel.layout import DataDir
from quiverd.kernel.metrics import Metrics
from quiverd.kernel.reply import Reply
from quiverd.lake.catalog.sqlite import SqliteCatalog
from quiverd.lake.iceberg import catalog_uri
from quiverd.lake.store import LocalStore
from quiverd.lake.tier import Tier, load_source_id
from quiverd.runtime.shard import Shard
from quiverd.segments.reader import SegmentReader
from quiverd_actors.inbox import Batches
from quiverd_actors.messages import (
    AppendRequest,
    ChangeSubscriber,
    LocalDelivery,
    ProducerReply,
)
from quiverd_actors.uploader import SUBSCRIBER as UPLOADER
from tests.sim.crashstates import _config, check_image, durable_acks
from tests.sim.detsim import stepthreads
from tests.sim.detsim.checks import Checker, InvariantViolated
from tests.sim.detsim.core import (
    PRODUCER_WINDOW,
    CoreFS,
    CoreLoop,
    CoreResult,
    CoreSize,
    _describe,
    _Sim,
)
from tests.sim.detsim.faults import FaultPlan, FaultyCatalog, FaultyOperator
from tests.sim.detsim.loop import close_loop, simulated
from tests.sim.detsim.world import SimLake, SimLog, World, lake_config
from tests.sim.modelfs import Cut, Image, State
from tests.sim.workload import SUBSCRIBER, tagged

CLIENT = "p"  # the producer's client: the lake's tables quiver.p and quiver.p__slot1
TABLES = (CLIENT, f"{CLIENT}__slot1")  # the Checker's "clients": a table name each
TWO_SLOTS_P = 0.3  # bundles with a slot 1 as well (the uploader acks after both files)
# Planted bugs of the projection (faults.FaultyProjection); the lake's uploader acking
# before registration is planted in product code (tests/sim/mutations.py).
PLANTS = ("", "no_removals", "expire_now")


@dataclass(frozen=True)
class DaemonSize(CoreSize):
    bundles: int = 40
    span_s: float = 200.0  # production, virtual seconds (the lake's timers are seconds)
    faults_s: float = 260.0  # store, catalog and Iceberg faults until then; cuts before
    settle_s: float = 1800.0
    max_steps: int = 1_500_000
    fault_scale: float = 1.0
    janitor_grace_s: int = 300
    janitor_interval_s: int = 45
    restart_max_s: float = 10.0  # a restarted daemon comes back 0.5 s .. this later
    # The last life runs on at least this long after the faults stop: compaction, expiry
    # and the janitor's deletes of replaced files (what I3 guards) come minutes later.
    linger_s: float = 200.0
    size_cap_bytes: int = 0  # retention.size_cap_bytes (backpressure): 0, no cap


SMOKE = DaemonSize(bundles=16, span_s=80.0, faults_s=110.0, max_cuts=2)


@dataclass
class DaemonResult(CoreResult):
    kills: int = 0  # lives ended by a kill (the projection worker outlived the daemon)
    lake_checks: int = 0
    commits: int = 0
    uploader_acks: int = 0
    rows: int = 0  # in the final scan
    lake_faults: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, Any]:
        return {**super().counts(), "kills": self.kills, "lake_checks": self.lake_checks,
                "commits": self.commits, "uploader_acks": self.uploader_acks,
                "rows": self.rows, "faults": self.lake_faults, "events": self.events,
                "restarts": self.restarts}


class DaemonSimFailed(AssertionError):
    def __init__(self, result: DaemonResult, replay: str = "") -> None:
        self.result = result
        super().__init__(f"seed {result.seed}: {result.error}\nreplay: PYTHONHASHSEED=0 "
                         f".venv/bin/python -m tests.sim.detsim.daemon {result.seed}{replay}\n"
                         f"last steps:\n{result.tail()}")


def run_daemon(seed: int, *, size: DaemonSize = DaemonSize(), daemons: int = 1,
               faults: bool = True, plant: str = "", keep_trace: bool = True) -> DaemonResult:
    """One simulated run of ``daemons`` daemons on one catalog and store; raises
    DaemonSimFailed (seed, error, the trace's tail) when an invariant breaks or the run
    crashes, else returns what it did."""
    assert plant in PLANTS, plant
    result = DaemonResult(seed=seed)
    root = Path(tempfile.mkdtemp(prefix=f"daemonsim-{seed}-", dir="/tmp"))
    loop = CoreLoop(random.Random(f"schedule-{seed}"))

    def note(what: str) -> None:
        if keep_trace:
            result.trace.append((loop.vtime, "! " + what))

    plan = FaultPlan.draw_plan(seed, loop, size.faults_s, on=faults, scale=size.fault_scale)
    plan.note = note
    run = _Run(seed, size, loop, root, plan, plant, note)
    for i in range(daemons):
        run.add_node(i, result.trace)

    def on_step(label: str) -> None:
        if keep_trace:
            result.trace.append((loop.vtime, label))
        for node in run.nodes:
            node.after_step()
        run.world.checker.after_step(label)

    loop.on_step = on_step
    started = time.perf_counter()
    previous = fs.install(RoutingFS(fs.active()))
    saved_open_tier = runtime_lake.open_tier
    try:
        with simulated(seed, loop), stepthreads.patched(note):
            runtime_lake.open_tier = run.world.open_tier
            try:
                loop.run_until_complete(run.main())
            except Exception as exc:  # noqa: BLE001 - any crash of the run is a finding too
                result.error = _describe(exc)
            finally:
                close_loop(loop)
    finally:
        runtime_lake.open_tier = saved_open_tier
        fs.install(previous)
        run.world.checker.close()
        shutil.rmtree(root, ignore_errors=True)
    run.sum_up(result)
    result.wall_s = round(time.perf_counter() - started, 2)
    result.steps, result.virtual_s = loop.steps, round(loop.vtime, 3)
    if result.error:
        more = (f" --daemons {daemons}" if daemons != 1 else "") + \
            (f" --plant {plant}" if plant else "")
        raise DaemonSimFailed(result, more)
    return result


# The daemon whose task (or lock-step WAL thread) is running: every task a daemon's life
# starts, and every WAL thread it starts (stepthreads copies the context), inherits it.
CURRENT: contextvars.ContextVar[_DaemonSim | None] = contextvars.ContextVar(
    "daemon_sim_current", default=None)


class RoutingFS(FileSystem):
    """The seam (``fs.active()``, one for the process) shared by the simulated daemons:
    a call on a path goes to the file system of the daemon making it (its ModelFS while
    it lives), found through ``CURRENT``, outside any daemon (the crash-image checks, the
    harness) to the real one; a call on an fd to the file system that opened it (an fd
    of a life a cut ended stays with that life's dead model: EIO, as a single seam
    gives; a finalizer may flush it from anywhere)."""

    def __init__(self, real: FileSystem) -> None:
        self.real = real
        self.owner: dict[int, FileSystem] = {}  # fd -> the file system that opened it
        # A call the seam gains must be routed too: inherited, it would reach the real
        # file system behind the model's back (as ``link`` once did: a mirror finding).
        missing = [n for n in dir(FileSystem) if not n.startswith("_")
                   and callable(getattr(FileSystem, n)) and n not in type(self).__dict__]
        assert not missing, f"RoutingFS does not route {missing}"

    def _fs(self) -> FileSystem:
        node = CURRENT.get()
        return self.real if node is None else node.seam

    def _of(self, fd: Any) -> FileSystem:
        fd = fd if isinstance(fd, int) else fd.fileno()
        return self.owner.get(fd) or self._fs()

    def open(self, path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        seam = self._fs()
        fd = seam.open(path, flags, mode, **kw)
        self.owner[fd] = seam
        return fd

    def close(self, fd: int) -> None:
        seam = self.owner.pop(fd, None) or self._fs()
        seam.close(fd)

    def write(self, fd: int, data: Any) -> int:
        return self._of(fd).write(fd, data)

    def writev(self, fd: int, buffers: Any) -> int:
        return self._of(fd).writev(fd, buffers)

    def ftruncate(self, fd: int, length: int) -> None:
        self._of(fd).ftruncate(fd, length)

    def fsync(self, fd: Any) -> None:
        self._of(fd).fsync(fd)

    def fdatasync(self, fd: Any) -> None:
        self._of(fd).fdatasync(fd)

    def copy_file_range(self, src: int, dst: int, count: int, offset_src: int) -> int:
        return self._of(dst).copy_file_range(src, dst, count, offset_src)

    def punch_hole(self, fd: int, offset: int, length: int) -> None:
        self._of(fd).punch_hole(fd, offset, length)

    def rename(self, src: Any, dst: Any) -> None:  # type: ignore[override]
        self._fs().rename(src, dst)

    def link(self, src: Any, dst: Any) -> None:  # type: ignore[override]
        self._fs().link(src, dst)

    def chmod(self, path: Any, mode: int) -> None:  # type: ignore[override]
        self._fs().chmod(path, mode)

    def unlink(self, path: Any, *, missing_ok: bool = False) -> None:
        self._fs().unlink(path, missing_ok=missing_ok)

    def mkdir(self, path: Any) -> None:
        self._fs().mkdir(path)

    def fsync_dir(self, path: Any) -> None:
        self._fs().fsync_dir(path)

    def mark(self, event: str, **facts: Any) -> None:
        self._fs().mark(event, **facts)


class _Run:
    """The daemons, the world they share, and the end: once every daemon has settled,
    the final scan, then each daemon's last cut."""

    def __init__(self, seed: int, size: DaemonSize, loop: CoreLoop, root: Path,
                 plan: FaultPlan, plant: str, note: Callable[[str], None]) -> None:
        self.seed, self.size, self.loop, self.root, self.note = seed, size, loop, root, note
        self.world = DaemonWorld(root, self, plan, plant)
        self.nodes: list[_DaemonSim] = []
        self.final = anyio.Event()
        self.rows = 0  # in the final scan

    def add_node(self, index: int, trace: list[tuple[float, str]]) -> None:
        node_root = self.root / f"n{index}"
        node_root.mkdir()
        result = DaemonResult(seed=self.seed, trace=trace)
        node = _DaemonSim(self, index, node_root, result)
        node.note = lambda what: self.note(f"d{index} {what}")
        self.nodes.append(node)
        self.world.daemons.append(node.node)  # type: ignore[arg-type]

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:
            for node in self.nodes:
                tg.start_soon(self._live, node)
            for node in self.nodes:
                await node.settled.wait()
            # Each one settled on its own; the final scan needs them settled at once
            # (one's compaction may be waiting for its next Iceberg sync meanwhile).
            deadline = self.loop.vtime + self.size.settle_s
            while waits := [f"d{n.index}: {w}" for n in self.nodes if (w := n.waits())]:
                if self.loop.vtime > deadline:
                    raise NotSettled(f"the daemons never settled at once: {waits}")
                await anyio.sleep(1.0)
            self.final_scan()
            self.final.set()

    async def _live(self, node: _DaemonSim) -> None:
        CURRENT.set(node)
        await node.main()

    def final_scan(self) -> None:
        """Each table (slot 0: quiver.p, slot 1: quiver.p__slot1) by a real pyiceberg
        scan: each producer-acked bundle's rows exactly once; nothing but whole bundles
        that were sent, each in every table it sent rows for."""
        acked = sorted(t for node in self.nodes for t in node.facts.seq_of_tag)
        two_slots = {t for node in self.nodes for t in node.rows_of[1]}
        present: list[set[int]] = []
        self.rows = 0
        for slot, table in enumerate(TABLES):
            rows_of = {t: n for node in self.nodes for t, n in node.rows_of[slot].items()}
            by_tag = self._scan(table)
            for tag in acked:
                have = by_tag.get(tag, set())
                if have != set(range(rows_of.get(tag, 0))):
                    raise InvariantViolated(
                        f"final: acked bundle of tag {tag}: {len(have)} of its "
                        f"{rows_of.get(tag, 0)} rows in the scan of quiver.{table}")
            for tag, have in sorted(by_tag.items()):
                if have != set(range(rows_of.get(tag, -1))):
                    raise InvariantViolated(f"final: tag {tag} in the scan of quiver.{table} "
                                            "is not a whole bundle that was sent")
            present.append(set(by_tag) & two_slots)
            self.rows += sum(len(v) for v in by_tag.values())
        if present[0] != present[1]:
            raise InvariantViolated(f"final: two-slot bundles with one slot in the lake: "
                                    f"tags {sorted(present[0] ^ present[1])[:10]}")

    def _scan(self, table: str) -> dict[int, set[int]]:
        """The rows (tag -> values of i) of quiver.<table>; a row twice fails."""
        reader = self.world.checker.reader
        assert reader is not None
        from pyiceberg.exceptions import NoSuchTableError

        try:
            tbl = reader.load_table(("quiver", table))
        except NoSuchTableError:
            return {}
        arrow = tbl.scan(selected_fields=("tag", "i")).to_arrow()
        got = Counter(zip(arrow.column("tag").to_pylist(), arrow.column("i").to_pylist(),
                          strict=True))
        twice = sorted(k for k, n in got.items() if n > 1)
        if twice:
            raise InvariantViolated(f"final: rows (tag, i) twice in the scan of "
                                    f"quiver.{table}: {twice[:10]}")
        by_tag: dict[int, set[int]] = {}
        for tag, i in got:
            by_tag.setdefault(tag, set()).add(i)
        return by_tag

    def sum_up(self, result: DaemonResult) -> None:
        """The run's counts: the daemons' added up, the lake's."""
        w, many = self.world, len(self.nodes) > 1
        checks: Counter[str] = Counter()
        for n in self.nodes:
            r = n.result
            for name in ("power_cuts", "kills", "sent", "acked", "deliveries", "sub_acks"):
                setattr(result, name, getattr(result, name) + getattr(r, name))
            result.cuts += [f"d{n.index} {c}" if many else c for c in r.cuts]
            checks.update(n.checks.counts)
        result.checks = dict(sorted(checks.items()))
        result.rows = self.rows
        result.lake_checks, result.commits = w.checker.checks, w.checker.commits_seen
        result.uploader_acks = sum(len(d.dispatcher.acked) for d in w.daemons)
        result.lake_faults = dict(sorted(w.plan.counts.items()))
        result.events = dict(sorted(w.log.counts.items()))
        result.restarts = dict(sorted(w.log.restarts.items()))


class DaemonFS(CoreFS):
    """CoreFS whose C2 asks both subscribers: a segment goes only once the durable
    ack.log has "s" and the uploader ack each of its bundles."""

    def _check_deletable(self, path: Any, seg: int) -> None:
        self.checks.count("C2 delete after durable acks")
        with SegmentReader.open(path) as reader:
            indexes = [b.index for b in reader.bundles()]
        acks = self.durable_acks()
        for sub in (SUBSCRIBER, UPLOADER):
            undone = [i for i in indexes if not _done(acks, sub, seg, i)]
            if undone:
                self.checks.fail(f"C2: segment {seg} deleted while the durable ack.log lacks "
                                 f"{sub}'s acks of bundles {undone}")


def _done(acks: AckState | None, sub: str, seg: int, idx: int) -> bool:
    try:
        return acks is not None and acks.is_done(sub, seg, idx)
    except UnknownSubscriber:
        return False


class Node:
    """A daemon as the lake's Checker and SimLake see one (``world.Daemon``'s part)."""

    def __init__(self, sim: _DaemonSim, index: int, data_dir: Path) -> None:
        self.sim, self.index = sim, index
        self.node_id = f"n{index}"
        self.source_id = ""  # lake.id, read at each start of the lake
        self.data_dir = data_dir
        base = _config(data_dir)
        self.cfg = msgspec.structs.replace(
            base, catalog=CatalogConfig(),
            lake=lake_config(sim.run.root, self.node_id, cast(Any, sim.size)),
            retention=msgspec.structs.replace(base.retention,
                                              size_cap_bytes=sim.size.size_cap_bytes))
        # The uploader's acks, as the Checker reads them: (segment_seq, bundle_index).
        self.dispatcher = SimpleNamespace(acked=set(), bundles={})
        self.projections: list[Any] = []

    def kill(self) -> None:
        """Its projection worker holds a sync: the daemon dies, the worker lands it."""
        self.sim.power_cut("kill")


class DaemonWorld(World):
    """World's catalog, store and Iceberg glue for daemons with real shards: the source
    id is each data directory's own (lake.id); a daemon without power calls nothing."""

    def __init__(self, root: Path, run: _Run, plan: FaultPlan, plant: str) -> None:
        self.root, self.loop, self.seed, self.plan, self.plant = (root, run.loop, run.seed,
                                                                  plan, plant)
        self.run = run
        self.rng = random.Random(f"world-{run.seed}")
        self.log = SimLog()
        self.catalog_db = DataDir(root).catalog_db
        self.iceberg_uri = catalog_uri(CatalogConfig(), root)
        self.born: dict[str, int] = {}
        self.size = run.size  # type: ignore[assignment]
        self.store_seq = 0
        self.daemons = []
        self.checker = Checker(self, clients=TABLES)

    def note(self, what: str) -> None:
        self.run.note(what)

    def changed(self, what: str) -> None:
        node = CURRENT.get()
        if (node is not None and node.model is not None and node.model.dead
                and what != "iceberg.zombie"):
            node.checks.fail(f"harness: {what} after daemon {node.index} lost power")
        super().changed(what)

    @asynccontextmanager
    async def open_tier(self, cfg: Config, log: Any) -> AsyncIterator[Tier]:
        """``open_tier`` for the sim: the real source id (lake.id, through the ModelFS);
        the shared database and store, faulty, and silent once this life's power is cut."""
        d = cast(Node, self.daemon_of(cfg))
        model = d.sim.model
        assert model is not None
        data = DataDir(Path(cfg.data_dir))
        source_id = await anyio.to_thread.run_sync(load_source_id, data)
        if d.source_id and source_id != d.source_id:
            d.sim.checks.fail(f"lake.id changed across a restart: {d.source_id} -> "
                              f"{source_id} (the catalog's coverage is keyed by it)")
        d.source_id = source_id

        def alive() -> bool:
            return not model.dead

        store = LocalStore(cfg.lake.store, data_dir=data.root, log=log)
        self.store_seq += 1
        store._rng = random.Random(f"store-{self.seed}-{self.store_seq}")
        store._op = cast(Any, _PoweredOperator(
            opendal.Operator("fs", **dict(store._options)), self.plan,
            cfg.lake.store.timeout_ms / 1000, self.born, self.changed, alive))
        inner = SqliteCatalog(self.catalog_db, log=log)
        catalog = FaultyCatalog(_Powered(inner, alive), self.plan, self.changed)
        try:
            await inner.start()
            yield Tier(cfg=cfg, data=data, store=store, catalog=cast(Any, catalog),
                       node_id=d.node_id, source_id=source_id, log=log)
        finally:
            with anyio.CancelScope(shield=True):
                await inner.close()
                await store.close()


class _Delivered:
    """A session's delivery stream that shows each delivery to ``check`` first."""

    def __init__(self, inner: Any, check: Callable[[LocalDelivery], None]) -> None:
        self._inner, self._check = inner, check

    def send_nowait(self, item: LocalDelivery) -> None:
        self._check(item)
        self._inner.send_nowait(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PoweredOperator(FaultyOperator):
    """The store as a daemon without power sees it: nothing it asks for gets done."""

    def __init__(self, op: opendal.Operator, plan: FaultPlan, timeout_s: float,
                 born: dict[str, int], changed: Callable[[str], None],
                 alive: Callable[[], bool]) -> None:
        super().__init__(op, plan, timeout_s, born, changed)
        self._alive = alive

    async def _call(self, name: str, mutating: bool, fn: Callable[[], Any],
                    key: str = "") -> Any:
        def powered() -> Any:
            if not self._alive():  # checked when the call would be done, not before
                raise oe.Unexpected(f"Unexpected (temporary) at send http request => sim: "
                                    f"{name} {key}: the daemon lost power")
            return fn()

        return await super()._call(name, mutating, powered, key)


class _Powered:
    """The catalog's async calls refused once the calling daemon lost power."""

    def __init__(self, inner: Any, alive: Callable[[], bool]) -> None:
        self._inner, self._alive = inner, alive

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name in ("start", "close"):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if not self._alive():
                await anyio.lowlevel.checkpoint()
                raise CatalogUnavailable(f"sim: catalog {name}: the daemon lost power")
            return await attr(*args, **kwargs)

        return call if _is_async(attr) else attr


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn)


class NotSettled(InvariantViolated):
    """The last life did not get every bundle into the lake (and to "s") in time."""


class _DaemonSim(_Sim):
    """core._Sim's producer, subscriber "s" and crash-state checks, with the daemon's
    lake in every life, and lives that end at seeded virtual times."""

    size: DaemonSize
    result: DaemonResult

    def __init__(self, run: _Run, index: int, root: Path, result: DaemonResult) -> None:
        super().__init__(run.seed, run.size, run.loop, root, result)
        self.run, self.index = run, index
        self.rng = random.Random(f"core-{run.seed}" + (f"-{index}" if index else ""))
        self.world = run.world
        self.data = root / "data"  # the same path in every life: the catalog names it
        self.node = Node(self, index, self.data)
        self.seam: FileSystem = self.real_fs  # this daemon's file system (RoutingFS)
        self.first_tag = index * 1_000_000  # tags are unique across the daemons
        self.rows_of: tuple[dict[int, int], ...] = ({}, {})  # per slot: tag -> rows sent
        self.cut_time: float | None = None  # virtual time of this life's power cut
        self.ending = ""  # how this life ended: "power", "kill" or "final"
        self.settled = anyio.Event()  # the last life's work is done (_Run.final next)

    # ---- after every step --------------------------------------------------------
    def after_step(self) -> None:
        if (self.cut_time is not None and self.cut_at is None
                and self.loop.vtime >= self.cut_time):
            # The first step at or past the cut's time, then up to 200 more: a cut lands
            # inside a burst of work, not only on the timer that ended a quiet spell.
            self.cut_at = self.loop.steps + self.rng.randint(0, 200)
        super().after_step()

    def power_cut(self, kind: str = "power") -> None:
        """The daemon's host loses power (``kill``: the daemon alone dies, its page
        cache kept: every write and name it made survives)."""
        if self.crashed is not None or self.model is None or self.scope is None:
            return  # already down, or not yet running: the cut waits for the next step
        self.ending = kind
        self.note(f"{'kill' if kind == 'kill' else 'power cut'} at step {self.loop.steps}")
        # Every change under the data directory went through this daemon's seam (the
        # routing, and the lake's staging files): else the image would miss it.
        self.checks.count("seam mirror checks")
        for problem in self.model.check_mirror():
            self.checks.fail(f"seam: {problem}")
        self.crashed = self.model.crash()
        self.scope.cancel()

    # ---- lives ---------------------------------------------------------------------
    async def main(self) -> None:
        self.data.mkdir()
        times = sorted(self.rng.uniform(5, self.size.faults_s)
                       for _ in range(self.rng.randint(1, self.size.max_cuts)))
        life = 0
        while True:
            self.cut_time = times.pop(0) if times else None
            image = await self.life(life)
            if self.ending == "final":
                return
            if self.ending == "kill" and self.cut_time is not None:
                times.insert(0, self.cut_time)  # a kill came first: the cut is still due
            shutil.rmtree(self.data)
            image.materialize(self.data)
            await anyio.sleep(self.rng.uniform(0.5, self.size.restart_max_s))
            life += 1

    async def life(self, life: int) -> Image:  # type: ignore[override]
        node = self.node
        self.model = model = DaemonFS(self.data, self.checks)
        self.seam = model
        self.crashed, self.cut_at, self.ending = None, None, ""
        shard = self.shard = Shard(0, node.cfg, shard_count=1, faults=Hooks(),
                                   metrics=Metrics())
        self.note(f"life {life} starts")
        try:
            await shard.recover()
            assert shard.recovered is not None
            wal = shard.recovered.wal  # its locks are shared with the lock-step threads
            wal._lock, wal._mutex = stepthreads.SimLock(), stepthreads.SimLock()  # type: ignore[assignment]
            async with anyio.create_task_group() as tg:
                self.scope = tg.cancel_scope
                await tg.start(shard.run)
                self._watch_uploader(shard)
                if life == 0:
                    await _change(shard, SUBSCRIBER)
                tg.start_soon(self._lake(shard).run)
                tg.start_soon(self.produce, shard)
                tg.start_soon(self.subscribe, shard, model)
                if self.cut_time is None:
                    await self.settle_all(shard)
                    self.settled.set()
                    await self.run.final.wait()
                    self.power_cut("final")
                await anyio.sleep_forever()
        except Exception as exc:  # noqa: BLE001 - a dying daemon fails in many ways
            if self.crashed is None:
                raise
            self.note(f"daemon ended by the cut: {_describe(exc)[:200]}")
        finally:
            self.scope = None
            shard.ack_tx.close()
            shard._ack_rx.close()
            for p in node.projections:
                p.close()
            node.projections.clear()
            self.seam = self.real_fs  # recovery of the crash images runs on the real disk
        assert self.crashed is not None
        if self.ending == "kill":
            return self.check_kill(self.crashed, model)
        return self.check_cut(self.crashed, model, last=self.ending == "final")

    def check_kill(self, state: State, model: CoreFS) -> Image:
        """A kill keeps every write and name (the page cache outlives the process)."""
        self.result.kills += 1
        self.earlier = known = self.known(model)
        durable = durable_acks(state.image(Cut(0, "none")), self.checks.scratch / "durable")
        cut = Cut(len(state.pending_meta), "all")
        self.result.cuts.append(f"{cut.meta_prefix}/{cut.meta_prefix} kill")
        image = state.image(cut)
        problems = check_image(image, durable, known, self.facts, self.checks.scratch / "check")
        self.checks.count("crash images checked")
        if problems:
            raise InvariantViolated(f"after the kill: {problems}")
        return image

    def _watch_uploader(self, shard: Shard) -> None:
        """Record the uploader's acks as it hands them to the dispatcher (I1's "acked")."""
        d = shard.dispatcher
        assert d is not None
        feedback, acked = d.feedback, self.node.dispatcher.acked

        async def watched(session: Any, segment_seq: int, bundle_index: int,
                          outcome: int) -> None:
            if session.name == UPLOADER and outcome == ackfmt.ACK:
                acked.add((segment_seq, bundle_index))
                self.world.changed("ack")
            await feedback(session, segment_seq, bundle_index, outcome)

        d.feedback = watched  # type: ignore[method-assign]
        attach = d.attach

        def attached(session: Any) -> None:
            if session.name == UPLOADER:
                session.deliveries = _Delivered(session.deliveries, self.delivered_to_lake)
            attach(session)

        d.attach = attached  # type: ignore[method-assign]

    def delivered_to_lake(self, b: LocalDelivery) -> None:
        """C3 for the uploader: nothing the durable ack.log says it acked is delivered."""
        self.checks.count("C3 delivery not durably acked")
        assert self.model is not None
        if _done(self.model.durable_acks(), UPLOADER, b.segment_seq, b.bundle_index):
            self.checks.fail(f"C3: bundle {(b.segment_seq, b.bundle_index)} delivered to the "
                             "uploader, though the durable ack.log says it acked it")

    def _lake(self, shard: Shard) -> SimLake:
        w = self.world

        async def subscribe(op: str, name: str, start: str) -> None:
            await _change(shard, name, op=op, start=start)

        lake = SimLake(self.node.cfg, [shard], subscribe=subscribe, metrics=Metrics(),
                       faults={})
        lake.world, lake.daemon = w, cast(Any, self.node)
        lake.log = cast(Any, w.log)
        lake.health.log = cast(Any, w.log)
        return lake

    # ---- the end -------------------------------------------------------------------
    async def settle_all(self, shard: Shard) -> None:
        """Wait until ``waits`` finds nothing to wait for."""
        deadline = self.loop.vtime + self.size.settle_s
        while waits := self.waits():
            if self.loop.vtime > deadline:
                raise NotSettled(f"{self.size.settle_s:.0f} s into the last life of daemon "
                                 f"{self.index}: {waits}")
            await anyio.sleep(1.0)

    def waits(self) -> str:
        """What the last life still waits for ("" when nothing): every bundle sent and
        answered, "s" has acked every acked one, the lake holds them all (no bundle the
        uploader has not acked, none left in the WAL only, each table's current
        snapshot == its registered files), ``linger_s`` passed since the faults."""
        if self.result.sent < self.size.bundles or self.outstanding:
            return f"sends: {self.result.sent} sent, {len(self.outstanding)} unanswered"
        waiting = self._not_sub_acked()
        if waiting:
            return (f"acked bundles never acked by {SUBSCRIBER}: tags {waiting[:20]} "
                    f"({len(waiting)})")
        lake = self._lake_waits(self.shard)
        if lake:
            return f"lake: {lake}"
        if self.loop.vtime < self.size.faults_s + self.size.linger_s:
            return "linger"
        return ""

    def _not_sub_acked(self) -> list[int]:
        known = self.known(self.model) if self.model else self.earlier
        tags = {t for t, s in self.facts.seq_of_tag.items() if s in known.acked}
        return sorted(tags - known.sub_acked)

    def _lake_waits(self, shard: Shard) -> str:
        """What the lake still waits for ("" when nothing)."""
        try:
            pending = list(shard.acks.pending_for(UPLOADER))
        except UnknownSubscriber:
            return "the uploader is not subscribed"
        if pending:
            return f"{len(pending)} bundles not acked by the uploader, first {pending[:5]}"
        assert shard.recovered is not None
        if shard.recovered.wal.unreleased_entries:
            return f"{shard.recovered.wal.unreleased_entries} WAL entries in no segment"
        if not self.world.checker.projected():
            return "a table's snapshot differs from its registered files"
        return ""

    # ---- producer ------------------------------------------------------------------
    async def produce(self, shard: Shard) -> None:
        """core._Sim.produce, the rows of each tag kept for the final scan."""
        replies: Batches[ProducerReply] = Batches()
        self.outstanding = {}
        rate = self.size.bundles / self.size.span_s
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.answers, replies)
            while self.result.sent < self.size.bundles:
                await anyio.sleep(self.rng.expovariate(rate))
                while len(self.outstanding) >= PRODUCER_WINDOW:
                    self.room = anyio.Event()
                    await self.room.wait()
                n = min(self.rng.randint(1, 3), self.size.bundles - self.result.sent)
                reqs = []
                for _ in range(n):
                    tag = self.first_tag + self.result.sent
                    self.result.sent += 1
                    rows = self.rows_of[0][tag] = self.rng.choice((10, 200, 1500))
                    slots = [make_slot(0, tagged(tag, rows))]
                    if self.rng.random() < TWO_SLOTS_P:
                        more = self.rows_of[1][tag] = self.rng.choice((5, 300))
                        slots.append(make_slot(1, tagged(tag, more)))
                    self.outstanding[tag] = tag
                    reqs.append(AppendRequest(request_id=tag, reply=replies, bundle=Bundle(
                        client=CLIENT, slots=tuple(slots))))
                await shard.inbox.put(reqs)
            while self.outstanding:
                self.room = anyio.Event()
                await self.room.wait()
            tg.cancel_scope.cancel()


async def _change(shard: Shard, name: str, *, op: str = "add", start: str = "earliest"
                  ) -> None:
    """What ``subscribers.add`` (or remove) does for one shard."""
    reply: Reply[None] = Reply()
    await shard.ack_tx.send(ChangeSubscriber(op=cast(Any, op), name=name,
                                             start=cast(Any, start), reply=reply))
    await reply.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.detsim.daemon")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--daemons", type=int, default=1, help="daemons on one catalog")
    parser.add_argument("--bundles", type=int, default=0, help="bundles per daemon")
    parser.add_argument("--smoke", action="store_true", help="the test's smaller size")
    parser.add_argument("--harsh", action="store_true", help="3x the fault rates")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--janitor-grace-s", type=int, default=0,
                        help="lake.janitor.grace_s (orphans younger are kept)")
    parser.add_argument("--janitor-interval-s", type=int, default=0)
    parser.add_argument("--size-cap-bytes", type=int, default=0,
                        help="retention.size_cap_bytes (backpressure: ingest waits)")
    parser.add_argument("--plant", choices=[p for p in PLANTS if p], default="")
    parser.add_argument("--trace", type=int, default=0, help="print the last N steps")
    parser.add_argument("--json", action="store_true", help="one line of counts per seed")
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("note: PYTHONHASHSEED is not 0: the trace may differ from the test's run",
              file=sys.stderr)
    from quiverd.kernel import logs

    logs.configure(level="error")
    size = SMOKE if args.smoke else DaemonSize()
    if args.bundles:
        size = DaemonSize(**{**size.__dict__, "bundles": args.bundles})
    if args.harsh:
        size = DaemonSize(**{**size.__dict__, "fault_scale": 3.0})
    for knob in ("janitor_grace_s", "janitor_interval_s", "size_cap_bytes"):
        if getattr(args, knob):
            size = DaemonSize(**{**size.__dict__, knob: getattr(args, knob)})
    failed = 0
    for seed in args.seeds:
        try:
            result = run_daemon(seed, size=size, daemons=args.daemons,
                                faults=not args.no_faults, plant=args.plant)
        except DaemonSimFailed as exc:
            failed += 1
            result = exc.result
            if not args.json:
                print(exc)
        line = result.counts()
        if args.json:
            line["tail"] = result.tail() if result.error else ""
            print(json.dumps(line), flush=True)
        else:
            print(line)
            if args.trace:
                print(result.tail(args.trace))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
