"""The simulated world: two daemons (two sources, two data directories) on one catalog
database and one store, each running the real lake (``quiverd.runtime.lake.Lake``:
uploader, indexer, janitor with compaction, projector) fed by a simulated core.

    producer ──bundles──▶ SimDispatcher (the WAL/segments/ack.log as the lake sees them:
        ▲                 unacked bundles redelivered after a nack or a lake restart)
        │                     │ LocalDelivery (window-bounded)
        │ ack/nack            ▼
        └──────────────── Lake (real) ── uploader ─▶ FaultyOperator ─▶ <root>/objects
                                │            └────▶ FaultyCatalog ─▶ <root>/catalog.sqlite
                                ├── projector ─▶ FaultyProjection ─▶ Iceberg (same db)
                                └── indexer, janitor (sweep, compaction, expiry via
                                    the projector's reconcile)
    killer: cancels one daemon's lake at a seeded time (every actor stops at whatever
            await it is in), restarted after a seeded delay (recover, redeliver)

The glue is ``open_tier`` (patched into ``quiverd.runtime.lake`` for the run: the Tier on
the shared database with the faulty store and catalog), ``SimLake._projector`` (an
in-process projection instead of the worker process) and the dispatcher.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import opendal
import pyarrow as pa

import quiverd.runtime.lake as runtime_lake
from quiverd.acks import format as ackfmt
from quiverd.kernel.config import (
    CatalogConfig,
    CompactionConfig,
    Config,
    IcebergConfig,
    JanitorConfig,
    LakeConfig,
    LakeScrubConfig,
    StoreConfig,
)
from quiverd.kernel.layout import DataDir
from quiverd.kernel.metrics import Metrics
from quiverd.lake.catalog.sqlite import SqliteCatalog
from quiverd.lake.iceberg import Projection, catalog_uri
from quiverd.lake.store import LocalStore
from quiverd.lake.tier import Tier
from quiverd_actors.messages import LocalDelivery
from quiverd_actors.projector import Projector
from quiverd_actors.sessions import Session
from quiverd_actors.uploader import SUBSCRIBER
from tests.sim.detsim.faults import FaultPlan, FaultyCatalog, FaultyOperator, FaultyProjection
from tests.sim.detsim.loop import SimLoop

CLIENTS = ("a", "b")
KEEP_SNAPSHOTS_S = 120.0
REDELIVER_S = 1.0  # a nacked bundle comes back this long after


@dataclasses.dataclass(frozen=True)
class Size:
    bundles: int = 24  # per daemon
    faults_s: float = 400.0  # virtual seconds of production with faults
    settle_s: float = 1800.0  # then at most this long for the lake to settle
    kills: int = 2  # lake kills (either daemon) while faults are on
    fault_scale: float = 1.0  # every fault rate times this (exploration: --harsh)
    janitor_grace_s: int = 300  # lake.janitor.grace_s (orphans younger are kept)
    janitor_interval_s: int = 45


class SimLog:
    """A logger that counts events (the sim's runs are long; lines are not kept)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.restarts: dict[str, int] = {}  # why the lake restarted: "part kind: error"

    def info(self, event: str, **kw: Any) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        if event == "lake_unavailable":
            why = f"{kw.get('part')} {kw.get('kind')}: {str(kw.get('error'))[:120]}"
            self.restarts[why] = self.restarts.get(why, 0) + 1

    warning = error = debug = exception = info

    def bind(self, **_kw: Any) -> SimLog:
        return self


class SimDispatcher:
    """One daemon's shard 0 as the uploader sees it: ``attach``/``detach`` a session,
    ``feedback`` acks and nacks; what is not acked is delivered again."""

    def __init__(self, world: World, window: int) -> None:
        self.world, self.window = world, window
        self.bundles: dict[tuple[int, int], LocalDelivery] = {}  # produced, not acked
        self.acked: dict[tuple[int, int], LocalDelivery] = {}
        self.queue: deque[tuple[int, int]] = deque()
        self.inflight: set[tuple[int, int]] = set()
        self.session: Session | None = None
        self.changed = anyio.Event()

    def add(self, delivery: LocalDelivery) -> None:
        key = (delivery.segment_seq, delivery.bundle_index)
        self.bundles[key] = delivery
        self.queue.append(key)
        self.changed.set()

    def attach(self, session: Session) -> None:
        self.session = session
        self._requeue()

    def detach(self, session: Session) -> None:
        if self.session is session:
            self.session = None
            self._requeue()

    def _requeue(self) -> None:
        back = sorted(self.inflight)
        self.inflight.clear()
        self.queue.extendleft(reversed(back))
        self.changed.set()

    async def feedback(self, session: Session, segment_seq: int, bundle_index: int,
                       outcome: int) -> None:
        key = (segment_seq, bundle_index)
        if session is self.session:
            self.inflight.discard(key)
        if outcome == ackfmt.ACK:
            if key in self.bundles:
                self.acked[key] = self.bundles.pop(key)
                self.world.changed("ack")
        elif key in self.bundles and key not in self.queue:
            loop = self.world.loop
            loop.call_later(REDELIVER_S, self._again, key)
        self.changed.set()

    def _again(self, key: tuple[int, int]) -> None:
        if key in self.bundles and key not in self.inflight and key not in self.queue:
            self.queue.append(key)
            self.changed.set()

    async def run(self) -> None:
        while True:
            s = self.session
            while s is not None and self.queue and len(self.inflight) < self.window:
                key = self.queue.popleft()
                if key not in self.bundles or key in self.inflight:
                    continue
                try:
                    s.deliveries.send_nowait(self.bundles[key])  # type: ignore[arg-type]
                except (anyio.ClosedResourceError, anyio.BrokenResourceError,
                        anyio.WouldBlock):
                    self.queue.appendleft(key)
                    break
                self.inflight.add(key)
                if self.world.plant == "ack_on_delivery":  # planted: acked before the lake
                    self.acked[key] = self.bundles[key]
                    self.world.changed("ack")
            await self.changed.wait()
            self.changed = anyio.Event()


class SimLake(runtime_lake.Lake):
    """The daemon's Lake with the projection in this process (no worker process)."""

    world: World
    daemon: Daemon

    def _projector(self, tier: Tier) -> Projector | None:
        w, d = self.world, self.daemon
        projection = Projection(catalog_uri=w.iceberg_uri, warehouse=tier.store.location(""),
                                io_properties={}, cfg=self.cfg.lake.iceberg)
        d.projections.append(projection)
        faulty = FaultyProjection(projection, w.plan, w.changed, w.plant,
                                  zombie=lambda call: w.zombie(d, tier.source_id, call))
        reads = cast(FaultyCatalog, tier.catalog).with_reads_to(
            w.checker.projector_read(tier.source_id))
        ptier = dataclasses.replace(tier, catalog=cast(Any, reads))
        return Projector(ptier, cast(Any, faulty), log=self.log, metrics=self.m,
                         health=self.health)


class Daemon:
    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.node_id = f"n{index}"
        self.source_id = ""
        self.data_dir = world.root / f"d{index}"
        self.cfg = Config(data_dir=str(self.data_dir), catalog=CatalogConfig(),
                          lake=lake_config(world.root, self.node_id, world.size))
        self.dispatcher = SimDispatcher(world, window=self.cfg.lake.window_bundles)
        self.shard = SimpleNamespace(dispatcher=self.dispatcher,
                                     acks=SimpleNamespace(registry={SUBSCRIBER}))
        self.scope: anyio.CancelScope | None = None
        self.projections: list[Projection] = []
        self.incarnations = 0
        self.produced = 0

    async def lifetime(self) -> None:
        """The lake, restarted after each kill."""
        while True:
            self.incarnations += 1
            lake = SimLake(self.cfg, [cast(Any, self.shard)], subscribe=_no_subscribe,
                           metrics=Metrics(), faults={})
            lake.world, lake.daemon = self.world, self
            lake.log = cast(Any, self.world.log)
            lake.health.log = cast(Any, self.world.log)
            with anyio.CancelScope() as self.scope:
                try:
                    await lake.run()
                finally:
                    for p in self.projections:
                        p.close()
                    self.projections.clear()
            self.scope = None
            await anyio.sleep(self.world.rng.uniform(1, 30))

    def kill(self) -> None:
        if self.scope is not None:
            self.scope.cancel()

    async def produce(self, n: int, span_s: float) -> None:
        rng = self.world.rng
        per_segment = 4
        for i in range(n):
            await anyio.sleep(rng.expovariate(n / span_s))
            rows = rng.randint(1, 5)
            start = self.index * 1_000_000 + self.produced * 10
            ids = pa.array(range(start, start + rows), pa.int64())
            self.dispatcher.add(LocalDelivery(
                shard=0, segment_seq=1 + i // per_segment, bundle_index=i % per_segment,
                client=rng.choice(CLIENTS), txn=None, ingestion_ts_ns=self.world.loop.wall_ns(),
                tables={0: pa.table({"id": ids, "daemon": pa.array([self.index] * rows,
                                                                    pa.int32())})}))
            self.produced += 1


def lake_config(root: Path, node_id: str, size: Size) -> LakeConfig:
    """The lake's settings in the sim: short timers, the store under ``root/objects``."""
    return LakeConfig(
        node_id=node_id, file_duration_ms=15_000, window_bundles=32,
        store=StoreConfig(root=str(root / "objects"), max_attempts=3,
                          retry_base_ms=100, retry_max_ms=1000, timeout_ms=10_000,
                          max_concurrency=2),
        janitor=JanitorConfig(interval_s=size.janitor_interval_s, grace_s=size.janitor_grace_s),
        compaction=CompactionConfig(interval_s=40, min_files=2, delete_grace_s=30),
        scrub=LakeScrubConfig(rate_mb_per_s=0),
        iceberg=IcebergConfig(keep_snapshots_s=KEEP_SNAPSHOTS_S, reconcile_interval_s=30,
                              linger_ms=200))


async def _no_subscribe(_op: str, _name: str, _start: str) -> None:
    return None


class World:
    def __init__(self, root: Path, loop: SimLoop, seed: int, plan: FaultPlan, plant: str,
                 note: Any, size: Size) -> None:
        from tests.sim.detsim.checks import Checker

        self.root, self.loop, self.seed, self.plan, self.plant = root, loop, seed, plan, plant
        self.rng = random.Random(f"world-{seed}")
        self.note = note
        self.log = SimLog()
        self.catalog_db = DataDir(root).catalog_db
        self.iceberg_uri = catalog_uri(CatalogConfig(), root)
        self.born: dict[str, int] = {}  # object key -> virtual ns of its commit
        self.size = size
        self.daemons = [Daemon(self, i) for i in range(2)]
        self.checker = Checker(self)
        self.store_seq = 0

    def changed(self, what: str) -> None:
        """A step changed ``what`` (``part.op subject``): checked after the step, and
        kept in the trace."""
        self.checker.changed(what)
        if " " in what:
            self.note(what)

    def zombie(self, d: Daemon, source_id: str, call: Any) -> None:
        """Daemon ``d`` dies while its projection worker holds ``call`` (a sync); the
        worker lands it 0-60 s later, in a step of its own."""
        self.note(f"kill lake of daemon {d.index} while its worker holds a sync")
        d.kill()
        # Its own Projection (the worker's connection): closed with d's others at exit.
        self.loop.call_later(self.rng.uniform(0, 60), self._land, source_id, call)

    def _land(self, source_id: str, call: Any) -> None:
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the worker's outcome is only noted
            self.note(f"zombie sync of {source_id} failed: {type(exc).__name__}: {exc}")
            return
        self.note(f"zombie sync of {source_id} landed: stale={result.stale} "
                  f"added={len(result.added)} removed={len(result.removed)}")
        self.checker.relaxed.add(source_id)
        self.changed("iceberg.zombie")

    def daemon_of(self, cfg: Config) -> Daemon:
        return next(d for d in self.daemons if str(d.data_dir) == cfg.data_dir)

    @asynccontextmanager
    async def open_tier(self, cfg: Config, log: Any) -> AsyncIterator[Tier]:
        """``quiverd.lake.tier.open_tier`` for the sim: the shared database, the faulty
        store and catalog, this daemon's source id."""
        d = self.daemon_of(cfg)
        store = LocalStore(cfg.lake.store, data_dir=d.data_dir, log=log)
        self.store_seq += 1
        store._rng = random.Random(f"store-{self.seed}-{self.store_seq}")
        options = dict(store._options)
        store._op = cast(Any, FaultyOperator(
            opendal.Operator("fs", **options), self.plan, cfg.lake.store.timeout_ms / 1000,
            self.born, self.changed))
        inner = SqliteCatalog(self.catalog_db, log=log)
        catalog = FaultyCatalog(inner, self.plan, self.changed)
        try:
            await inner.start()
            yield Tier(cfg=cfg, data=DataDir(d.data_dir), store=store,
                       catalog=cast(Any, catalog), node_id=d.node_id, source_id=d.source_id,
                       log=log)
        finally:
            with anyio.CancelScope(shield=True):
                await inner.close()
                await store.close()
