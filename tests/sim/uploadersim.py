"""A seeded simulation of the uploader alone: every interleaving of its intake, row-group
writes, rotations, publishers and acks that a seed draws, with the staging disk failing
(ENOSPC at a create, an append or a close), the store and the catalog failing
(tests/sim/detsim/faults.py: unavailable, reply lost, timeouts, outages), the uploader
killed and restarted, and every nacked bundle delivered again, as a shard does.

    run_uploader(seed) ─▶ SimLoop(seed) ─┬─ producer: bundles of 1-3 slots, some slot
                                         │  0 rows spanning two hours (split into two
                                         │  files), delivered within a window
                                         ├─ uploader (real: quiverd_actors.uploader) on
                                         │  the fs store and the SQLite catalog, both
                                         │  behind the fault plan; staging writes fail
                                         │  as drawn
                                         ├─ killer: the uploader cancelled at seeded
                                         │  times, a new one started (in-flight bundles
                                         │  delivered again)
                                         └─ settle: the faults stop; every bundle acked

Staged jobs (SPEC §7, ``uploader/staged.py``): about half the bundles belong to a job
(a partition's winning attempt, some with a losing twin); while the job is undecided the
shard hands each of them to the uploader early (``staged=True``, most of them, at any
time), then decides it (committed, or aborted): the winners' bundles are delivered
published (a few dropped as retention would), the rest never. Only published bundles'
rows may be in the lake; a ``rush`` (read your writes) comes for some jobs.

Checked at every ack: each slot of the bundle is covered by a registered file (the
catalog, read directly). At the end: every bundle acked; each (bundle, slot, hour) in
exactly one registered file, and the registered files' rows, read back with pyarrow,
hold each row sent exactly once (what the catalog's duplicate check cannot see: one
file holding a bundle's rows twice under one coverage row).

    PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.uploadersim SEED [SEED ...] [--trace N]

Found: a bundle nacked through one slot's failed file, delivered again while another
slot's file still held it, went into that file twice (fixed in 679959d).
"""

from __future__ import annotations

import argparse
import errno
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import msgspec
import opendal
import pyarrow as pa
import pyarrow.parquet as pq

import quiverd.lake.parquet as parquet_mod
from quiverd.acks import format as ackfmt
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.config import CatalogConfig, Config, LakeConfig, StoreConfig
from quiverd.kernel.jobs import JobDecision, Winner
from quiverd.kernel.layout import DataDir
from quiverd.kernel.metrics import Metrics
from quiverd.lake.catalog import sql
from quiverd.lake.catalog.sqlite import SqliteCatalog
from quiverd.lake.health import LakeHealth
from quiverd.lake.model import REGISTERED, decode_indexes
from quiverd.lake.store import LocalStore
from quiverd.lake.tier import Tier
from quiverd_actors.messages import LocalDelivery
from quiverd_actors.sessions import Session
from quiverd_actors.uploader import Uploader
from tests.sim.detsim.checks import InvariantViolated
from tests.sim.detsim.faults import FaultPlan, FaultyCatalog, FaultyOperator, Rates
from tests.sim.detsim.loop import SimLoop, Traced, close_loop, simulated
from tests.sim.detsim.world import SimLog

WINDOW = 12  # bundles in flight to the uploader (lake.window_bundles)
REDELIVER_S = (0.2, 3.0)  # a nacked bundle comes back after this long


@dataclass(frozen=True)
class UploaderSize:
    bundles: int = 40
    faults_s: float = 240.0  # production and faults; the hour turns at t=180 s
    settle_s: float = 900.0
    kills: int = 2  # uploader restarts while faults are on
    staging_p: float = 0.06  # chance a staging create/append/close fails with ENOSPC


SMOKE = UploaderSize(bundles=24, faults_s=200.0, kills=1)


class NotSettled(InvariantViolated):
    """Some bundle was never acked after the faults stopped."""


@dataclass
class UploaderResult(Traced):
    seed: int
    steps: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0
    acks: int = 0
    nacks: int = 0
    kills: int = 0
    staging_faults: int = 0
    files: int = 0
    staged: dict[str, int] = field(default_factory=dict)  # staged files by outcome
    faults: dict[str, int] = field(default_factory=dict)
    trace: list[tuple[float, str]] = field(default_factory=list)
    error: str = ""


class UploaderSimFailed(AssertionError):
    def __init__(self, result: UploaderResult) -> None:
        self.result = result
        super().__init__(f"seed {result.seed}: {result.error}\nreplay: PYTHONHASHSEED=0 "
                         f".venv/bin/python -m tests.sim.uploadersim {result.seed}\n"
                         f"last steps:\n{result.tail()}")


def run_uploader(seed: int, *, size: UploaderSize = UploaderSize(),
                 keep_trace: bool = True) -> UploaderResult:
    """One run; raises UploaderSimFailed (seed, error, the trace's tail) on a broken
    invariant or a crash, else returns what it did."""
    result = UploaderResult(seed=seed)
    root = Path(tempfile.mkdtemp(prefix=f"upsim-{seed}-", dir="/tmp"))
    loop = SimLoop(random.Random(f"schedule-{seed}"))

    def on_step(label: str) -> None:
        if keep_trace:
            result.trace.append((loop.vtime, label))

    loop.on_step = on_step
    started = time.perf_counter()
    sim = _Sim(seed, size, loop, root, result)
    try:
        with simulated(seed, loop), sim.staging_faults():
            try:
                loop.run_until_complete(sim.main())
            except Exception as exc:  # noqa: BLE001 - any crash of the run is a finding
                result.error = _describe(exc)
            finally:
                close_loop(loop)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result.wall_s = round(time.perf_counter() - started, 2)
    result.steps, result.virtual_s = loop.steps, round(loop.vtime, 3)
    result.faults = dict(sorted(sim.plan.counts.items()))
    result.staged = {k: int(v) for k, v in
                     sorted(sim.metrics.lake_staged_files.by_label("outcome").items())}
    if result.error:
        raise UploaderSimFailed(result)
    return result


class _Sim:
    def __init__(self, seed: int, size: UploaderSize, loop: SimLoop, root: Path,
                 result: UploaderResult) -> None:
        self.seed, self.size, self.loop, self.root, self.result = seed, size, loop, root, result
        self.rng = random.Random(f"uploader-{seed}")
        self.fs_rng = random.Random(f"staging-{seed}")
        self.plan = FaultPlan.draw_plan(seed, loop, size.faults_s)
        self.plan.rates = Rates(crash=0.0, zombie=0.0)  # no actor deaths: the killer kills
        self.plan.note = self.note
        self.log = SimLog()
        self.sent: dict[tuple[int, int], LocalDelivery] = {}
        # Staged: bundle -> its job; each job's bundles; decisions; what was given early.
        self.held: dict[tuple[int, int], str] = {}
        self.jobs: dict[str, list[tuple[int, int]]] = {}
        self.decisions: dict[str, JobDecision] = {}
        self.previewed: set[tuple[int, int]] = set()
        self.published: set[tuple[int, int]] = set()  # staged bundles delivered published
        self.uploader: Uploader | None = None
        self.metrics = Metrics()  # every lifetime's: what became of the staged files
        self.expected: Counter[tuple[int, int, int, int]] = Counter()  # (seg, idx, slot, v)
        self.unacked: set[tuple[int, int]] = set()
        self.queue: list[tuple[int, int]] = []
        self.inflight: set[tuple[int, int]] = set()
        self.session: Session | None = None
        self.changed = anyio.Event()
        self.db = DataDir(root).catalog_db
        self._reader: sqlite3.Connection | None = None

    def note(self, what: str) -> None:
        self.result.trace.append((self.loop.vtime, "! " + what))

    # ---- staging faults ---------------------------------------------------------------
    @contextmanager
    def staging_faults(self) -> Iterator[None]:
        cls = parquet_mod.ActiveFile
        saved = (cls.create, cls.append, cls.close)
        create, append, close = cls.create.__func__, cls.append, cls.close  # type: ignore[attr-defined]

        def maybe_fail(op: str) -> None:
            if self.loop.vtime < self.size.faults_s and \
                    self.fs_rng.random() < self.size.staging_p:
                self.result.staging_faults += 1
                self.note(f"fault staging.{op} ENOSPC")
                raise OSError(errno.ENOSPC, f"No space left on device (sim: {op})")

        def faulty_create(klass: Any, *args: Any, **kwargs: Any) -> Any:
            maybe_fail("create")
            return create(klass, *args, **kwargs)

        def faulty_append(self_: Any, table: pa.Table) -> None:
            maybe_fail("append")
            append(self_, table)

        def faulty_close(self_: Any) -> Any:
            maybe_fail("close")
            return close(self_)

        cls.create = classmethod(faulty_create)  # type: ignore[assignment]
        cls.append = faulty_append  # type: ignore[method-assign,assignment]
        cls.close = faulty_close  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            cls.create, cls.append, cls.close = saved  # type: ignore[method-assign]

    # ---- the run ------------------------------------------------------------------
    async def main(self) -> None:
        cfg = Config(data_dir=str(self.root), catalog=CatalogConfig(), lake=LakeConfig(
            node_id="n1", file_duration_ms=self.rng.choice((2_000, 8_000, 30_000)),
            window_bundles=WINDOW, time_column="t",
            row_group_bytes=self.rng.choice((1, 4096, 8 << 20)),
            file_size_bytes=self.rng.choice((1, 64 << 10, 64 << 20)),
            store=StoreConfig(root=str(self.root / "objects"), max_attempts=3,
                              retry_base_ms=100, retry_max_ms=1000, timeout_ms=10_000,
                              max_concurrency=2)))
        data = DataDir(self.root)
        for d in (data.staging_active, data.staging_stable):
            d.mkdir(parents=True, exist_ok=True)
        store = LocalStore(cfg.lake.store, data_dir=self.root, log=cast(Any, self.log))
        store._rng = random.Random(f"store-{self.seed}")
        store._op = cast(Any, FaultyOperator(opendal.Operator("fs", **dict(store._options)),
                                             self.plan, cfg.lake.store.timeout_ms / 1000,
                                             {}, lambda _what: None))
        inner = SqliteCatalog(self.db, log=cast(Any, self.log))
        await inner.start()
        catalog = FaultyCatalog(inner, self.plan, lambda _what: None)
        tier = Tier(cfg=cfg, data=data, store=store, catalog=cast(Any, catalog), node_id="n1",
                    source_id="01SIMSOURCE000000000000000", log=cast(Any, self.log))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.produce)
                tg.start_soon(self.deliver)
                tg.start_soon(self.lifetimes, tier)
                await anyio.sleep(self.size.faults_s)
                deadline = self.loop.vtime + self.size.settle_s
                while self.unacked or self.held or len(self.sent) < self.size.bundles:
                    if self.loop.vtime > deadline:
                        raise NotSettled(f"bundles never acked: {sorted(self.unacked)[:20]} "
                                         f"({len(self.unacked)})")
                    await anyio.sleep(5)
                await anyio.sleep(30)  # late acks (a repeat) would show up here
                self.final_check()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await inner.close()
                await store.close()
                if self._reader is not None:
                    self._reader.close()

    async def lifetimes(self, tier: Tier) -> None:
        """The uploader, restarted after each kill (its state is lost; the shard
        delivers every unacked bundle again)."""
        kills = sorted(self.rng.uniform(10, self.size.faults_s * 0.9)
                       for _ in range(self.size.kills))
        while True:
            tx, rx = anyio.create_memory_object_stream[LocalDelivery](WINDOW)
            session = Session(name="uploader", window=WINDOW, deliveries=tx, local=True)
            uploader = Uploader(tier, [cast(Any, self)], session,
                                limiter=anyio.CapacityLimiter(2), log=cast(Any, self.log),
                                metrics=self.metrics,
                                health=LakeHealth(log=cast(Any, self.log)),
                                decided=self.fate)
            self.uploader = uploader
            with anyio.CancelScope() as scope:
                self.attach(session)
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(uploader.run, rx)
                        if kills:
                            await anyio.sleep(max(0.0, kills.pop(0) - self.loop.vtime))
                            self.note("kill the uploader")
                            self.result.kills += 1
                            scope.cancel()
                        else:
                            await anyio.sleep_forever()
                finally:
                    self.detach(session)
                    tx.close()
            await anyio.sleep(self.rng.uniform(0.5, 5))

    # ---- producer and the shard's side -----------------------------------------------
    async def produce(self) -> None:
        n = self.size.bundles
        job: str | None = None
        for i in range(n):
            await anyio.sleep(self.rng.expovariate(n / (self.size.faults_s * 0.9)))
            key = (1 + i // 4, i % 4)
            if job is None and self.rng.random() < 0.15:
                job = f"job{i}"
                self.jobs[job] = []
            txn = None
            if job is not None:
                # Partition 0's winner is attempt 1 (a twin, attempt 2, loses), partition
                # 1's is 3 (4 loses); the job ends after a few bundles.
                part = self.rng.randint(0, 1)
                attempt = 2 * part + 1 + (1 if self.rng.random() < 0.3 else 0)
                txn = TxnTag(job_id=job, partition=part, attempt=attempt, row_offset=0)
                self.held[key] = job
                self.jobs[job].append(key)
                if self.rng.random() < 0.25 or i == n - 1:
                    self.loop.call_later(self.rng.uniform(0.5, 20), self.decide, job)
                    job = None
            now_us = self.loop.wall_ns() // 1000
            tables: dict[int, pa.Table] = {}
            for slot in range(self.rng.choice((1, 2, 2, 3))):
                rows = self.rng.randint(1, 4)
                vs = list(range(i * 100 + slot * 10, i * 100 + slot * 10 + rows))
                # Some of slot 0's rows an hour earlier: the bundle's slot in two files.
                ts = [now_us - (3_600_000_000 if slot == 0 and self.rng.random() < 0.3
                                else 0) for _ in vs]
                tables[slot] = pa.table({"v": pa.array(vs, pa.int64()),
                                         "t": pa.array(ts, pa.timestamp("us", tz="UTC"))})
                if txn is None:
                    for v in vs:
                        self.expected[(*key, slot, v)] += 1
            self.sent[key] = LocalDelivery(shard=0, segment_seq=key[0], bundle_index=key[1],
                                           client="app", txn=txn,
                                           ingestion_ts_ns=self.loop.wall_ns(), tables=tables)
            if txn is None:
                self.unacked.add(key)
                self.queue.append(key)
            self.changed.set()

    def fate(self, job_id: str) -> JobDecision | None:
        """Staging's answer: the decision, None while undecided."""
        return self.decisions.get(job_id)

    def decide(self, job: str) -> None:
        """Commit (odd attempts win) or abort; the winners' bundles are published, a few
        of them dropped first as retention would (never delivered, not expected)."""
        if self.rng.random() < 0.2:
            decision = JobDecision(job_id=job, state="aborted")
        else:
            decision = JobDecision(job_id=job, state="committed", winners=(
                Winner(partition=0, attempt=1, rows=0, checksum=0),
                Winner(partition=1, attempt=3, rows=0, checksum=0)))
        self.decisions[job] = decision
        published: set[tuple[int, int, int]] = set()
        for key in self.jobs[job]:
            del self.held[key]
            d = self.sent[key]
            assert d.txn is not None
            winner = decision.winner(d.txn.partition)
            if winner is None or winner.attempt != d.txn.attempt:
                continue
            if self.rng.random() < 0.05:
                self.note(f"drop {key} (retention)")
                continue
            for slot, table in d.tables.items():
                for v in table["v"].to_pylist():
                    self.expected[(*key, slot, v)] += 1
            self.unacked.add(key)
            self.queue.append(key)
            self.published.add(key)
            published.add((0, *key))
        self.note(f"decide {job}: {decision.state}, {len(published)} published")
        if published and self.uploader is not None and self.rng.random() < 0.5:
            try:
                self.uploader.rush(job, published)
            except AttributeError:
                pass  # between lifetimes: not running
        self.changed.set()

    def attach(self, session: Session) -> None:
        self.session = session
        self.previewed.clear()  # a new uploader: the held bundles are offered again
        self.queue[:0] = sorted(self.inflight)
        self.inflight.clear()
        self.changed.set()

    def detach(self, session: Session) -> None:
        if self.session is session:
            self.session = None
            self.queue[:0] = sorted(self.inflight)
            self.inflight.clear()

    async def deliver(self) -> None:
        while True:
            s = self.session
            while s is not None and self.queue and len(self.inflight) < WINDOW:
                key = self.queue.pop(0)
                if key not in self.unacked or key in self.inflight:
                    continue
                try:
                    s.deliveries.send_nowait(self.sent[key])  # type: ignore[arg-type]
                except (anyio.ClosedResourceError, anyio.BrokenResourceError,
                        anyio.WouldBlock):
                    self.queue.insert(0, key)
                    break
                self.inflight.add(key)
            if s is not None:
                self.offer_held(s)
            await self.changed.wait()
            self.changed = anyio.Event()

    def offer_held(self, s: Session) -> None:
        """Held bundles not offered to this uploader yet, each given early or skipped by
        the draw (then offered again on a later pass)."""
        for key in list(self.held):
            if key in self.previewed or self.rng.random() < 0.3:
                continue
            try:
                early = msgspec.structs.replace(self.sent[key], staged=True)
                s.deliveries.send_nowait(early)  # type: ignore[arg-type]
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.WouldBlock):
                return
            self.previewed.add(key)

    async def feedback(self, session: Session, segment_seq: int, bundle_index: int,
                       outcome: int) -> None:
        key = (segment_seq, bundle_index)
        if session is self.session:
            self.inflight.discard(key)
        txn = self.sent[key].txn
        if txn is not None and key not in self.published:
            raise InvariantViolated(f"bundle {key} of job {txn.job_id} got outcome "
                                    f"{outcome}, never delivered published")
        if outcome == ackfmt.ACK:
            self.result.acks += 1
            self.check_acked(key)
            self.unacked.discard(key)
        else:
            self.result.nacks += 1
            if key in self.unacked:
                self.loop.call_later(self.rng.uniform(*REDELIVER_S), self._again, key)
        self.changed.set()

    def _again(self, key: tuple[int, int]) -> None:
        if key in self.unacked and key not in self.inflight and key not in self.queue:
            self.queue.append(key)
            self.changed.set()

    # ---- checks -------------------------------------------------------------------
    def _read(self) -> sqlite3.Connection:
        if self._reader is None:
            self._reader = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True,
                                           isolation_level=None, check_same_thread=False)
            self._reader.row_factory = sqlite3.Row
        return self._reader

    def check_acked(self, key: tuple[int, int]) -> None:
        """An ack only once each slot of the bundle is in a registered file."""
        seg, idx = key
        covered = sql.covered_parts(self._read().execute(
            sql.COVERED, ("01SIMSOURCE000000000000000", 0, seg)))
        slots = {slot for (slot, _part), idxs in covered.items() if idx in idxs}
        missing = set(self.sent[key].tables) - slots
        if missing:
            raise InvariantViolated(f"bundle {key} acked, slots {sorted(missing)} in no "
                                    "registered file")

    def final_check(self) -> None:
        """Each (bundle, slot, hour) in one registered file; each row sent once."""
        conn = self._read()
        states = tuple(s.value for s in REGISTERED)
        files = conn.execute(
            f"SELECT file_id, slot, object_key, row_count FROM files WHERE state IN "
            f"({', '.join('?' * len(states))})", states).fetchall()
        self.result.files = len(files)
        pieces: Counter[tuple[int, int, int, str]] = Counter()
        for r in conn.execute(
                "SELECT c.file_id, c.slot, c.segment_seq, c.bundle_indexes, f.object_key "
                "FROM coverage c JOIN files f ON f.file_id = c.file_id WHERE f.state IN "
                f"({', '.join('?' * len(states))})", states):
            part = sql.key_partition(r["object_key"] or "")
            for idx in decode_indexes(r["bundle_indexes"]):
                pieces[(r["segment_seq"], idx, r["slot"], part)] += 1
        twice = [k for k, n in pieces.items() if n > 1]
        if twice:
            raise InvariantViolated(f"(segment, bundle, slot, hour) in two registered files: "
                                    f"{twice[:5]}")
        got: Counter[tuple[int, int, int, int]] = Counter()
        for r in files:
            t = pq.read_table(self.root / "objects" / r["object_key"])
            if t.num_rows != r["row_count"]:
                raise InvariantViolated(f"{r['file_id']}: {t.num_rows} rows, the catalog "
                                        f"says {r['row_count']}")
            for seg, idx, v in zip(t.column("_quiver_segment").to_pylist(),
                                   t.column("_quiver_bundle").to_pylist(),
                                   t.column("v").to_pylist(), strict=True):
                got[(seg, idx, r["slot"], v)] += 1
        if got != self.expected:
            extra = sorted((k, n) for k, n in got.items() if n > self.expected.get(k, 0))
            lost = sorted(k for k in self.expected if got.get(k, 0) < self.expected[k])
            raise InvariantViolated(f"rows in the lake differ from those sent: twice or "
                                    f"more {extra[:5]} ({len(extra)}), missing {lost[:5]} "
                                    f"({len(lost)})")


def _describe(exc: BaseException) -> str:
    """The leaves of an exception group, each as ``Type: message``."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.uploadersim")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--smoke", action="store_true", help="the test's smaller size")
    parser.add_argument("--trace", type=int, default=0, help="print the last N steps")
    args = parser.parse_args(argv)
    from quiverd.kernel import logs

    logs.configure(level="error")
    failed = 0
    for seed in args.seeds:
        try:
            r = run_uploader(seed, size=SMOKE if args.smoke else UploaderSize())
        except UploaderSimFailed as exc:
            failed += 1
            print(exc)
            continue
        print(f"seed {seed}: ok, {r.steps} steps, {r.acks} acks, {r.nacks} nacks, "
              f"{r.kills} kills, {r.staging_faults} staging faults, {r.files} files, "
              f"staged files {r.staged}, faults {r.faults}, {r.wall_s} s, "
              f"digest {r.digest()}")
        if args.trace:
            print(r.tail(args.trace))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
