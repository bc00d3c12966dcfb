"""Deterministic simulation of the lake's actors (issue 28, item 4).

Two daemons' real lakes (``quiverd.runtime.lake.Lake``: uploader, indexer, janitor with
compaction, projector with expiry) run concurrently on one catalog database and one
store, under a seeded scheduler with a virtual clock (``loop``), with faults drawn from
the same seed (``faults``), fed by a simulated core (``world``); the invariants
(``checks``) are checked after every step that changed something. The same seed gives
the same run, step for step: ``python -m tests.sim.detsim SEED`` replays one.

    run(seed) ──▶ SimLoop(seed) ─┬─ daemon 0: lifetime (Lake, restarted after kills), producer,
                                 │            dispatcher
                                 ├─ daemon 1: the same
                                 ├─ killer: one daemon's lake cancelled mid-operation
                                 │  (and, drawn per Iceberg sync, a kill while the
                                 │  projection worker holds a sync it lands later)
                                 └─ driver: faults stop, production ends, the lake settles,
                                            final scan; then everything is cancelled
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import ulid

import quiverd.runtime.lake as runtime_lake
from tests.sim.detsim.checks import InvariantViolated
from tests.sim.detsim.faults import FaultPlan
from tests.sim.detsim.loop import SimLoop, Traced, close_loop, simulated
from tests.sim.detsim.world import Size, World

__all__ = ["PLANTS", "InvariantViolated", "Result", "Size", "SimFailed", "run"]

# Planted bugs: the projection never deletes replaced files, expiry ignores the keep
# window (faults.FaultyProjection), the core counts a delivered bundle as acked (world).
PLANTS = ("", "no_removals", "expire_now", "ack_on_delivery")


class NotSettled(InvariantViolated):
    """The lake did not reach its final state within Size.settle_s after the faults."""


@dataclass
class Result(Traced):
    seed: int
    steps: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0
    checks: int = 0
    commits: int = 0
    bundles_acked: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    settled_after_s: float = 0.0  # virtual seconds from the faults' end to the final state
    faults: dict[str, int] = field(default_factory=dict)
    kills: int = 0
    incarnations: list[int] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # lake restarts, by cause
    trace: list[tuple[float, str]] = field(default_factory=list)
    error: str = ""


class SimFailed(AssertionError):
    def __init__(self, result: Result, replay: str = "") -> None:
        self.result = result
        super().__init__(f"seed {result.seed}: {result.error}\n"
                         f"replay: PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.detsim "
                         f"{result.seed}{replay}\nlast steps:\n{result.tail()}")


def run(seed: int, *, size: Size | None = None, faults: bool = True, plant: str = "",
        keep_trace: bool = True) -> Result:
    """One simulated run; raises SimFailed (with the seed and the trace's tail) when an
    invariant breaks, else returns what it did."""
    assert plant in PLANTS, plant
    size = size or Size()
    result = Result(seed=seed)
    root = Path(tempfile.mkdtemp(prefix=f"detsim-{seed}-"))
    loop = SimLoop(random.Random(f"schedule-{seed}"))
    trace = result.trace

    def note(what: str) -> None:
        trace.append((loop.vtime, "! " + what))

    plan = FaultPlan.draw_plan(seed, loop, size.faults_s, on=faults, scale=size.fault_scale)
    plan.note = note
    world = World(root, loop, seed, plan, plant, note, size)

    def on_step(label: str) -> None:
        if keep_trace:
            trace.append((loop.vtime, label))
        world.checker.after_step(label)

    loop.on_step = on_step
    started = time.perf_counter()
    saved_open_tier = runtime_lake.open_tier
    try:
        with simulated(seed, loop):
            runtime_lake.open_tier = world.open_tier
            try:
                for d in world.daemons:
                    d.source_id = str(ulid.ULID())
                loop.run_until_complete(_main(world, size, result))
            except Exception as exc:  # noqa: BLE001 - any crash of the run is a finding too
                result.error = f"{type(exc).__name__}: {exc}"
            finally:
                close_loop(loop)  # still simulated: what unwinds calls to_thread too
    finally:
        runtime_lake.open_tier = saved_open_tier
        world.checker.close()
        shutil.rmtree(root, ignore_errors=True)
    result.wall_s = round(time.perf_counter() - started, 2)
    result.steps, result.virtual_s = loop.steps, round(loop.vtime, 3)
    result.checks, result.commits = world.checker.checks, world.checker.commits_seen
    result.faults = dict(sorted(plan.counts.items()))
    result.incarnations = [d.incarnations for d in world.daemons]
    result.bundles_acked = sum(len(d.dispatcher.acked) for d in world.daemons)
    result.events = dict(sorted(world.log.counts.items()))
    result.restarts = dict(sorted(world.log.restarts.items()))
    if result.error:
        raise SimFailed(result, f" --plant {plant}" if plant else "")
    return result


async def _main(world: World, size: Size, result: Result) -> None:
    async with anyio.create_task_group() as tg:
        for d in world.daemons:
            tg.start_soon(d.dispatcher.run)
            tg.start_soon(d.lifetime)
            tg.start_soon(d.produce, size.bundles, size.faults_s * 0.9)
        if world.plan.until > 0:
            tg.start_soon(_killer, world, size, result)
        await anyio.sleep(size.faults_s)
        deadline = world.loop.vtime + size.settle_s
        while not world.checker.settled():
            if world.loop.vtime > deadline:
                unacked = [len(d.dispatcher.bundles) for d in world.daemons]
                raise NotSettled(f"not settled {size.settle_s:.0f} s after the faults "
                                 f"stopped: unacked bundles per daemon {unacked}")
            await anyio.sleep(5)
        result.settled_after_s = round(world.loop.vtime - size.faults_s, 3)
        result.rows = world.checker.final_scan()
        tg.cancel_scope.cancel()


async def _killer(world: World, size: Size, result: Result) -> None:
    rng = random.Random(f"kills-{world.seed}")
    times = sorted(rng.uniform(20, size.faults_s * 0.9) for _ in range(size.kills))
    for at in times:
        await anyio.sleep(max(0.0, at - world.loop.vtime))
        d = rng.choice(world.daemons)
        world.note(f"kill lake of daemon {d.index}")
        result.kills += 1
        d.kill()


