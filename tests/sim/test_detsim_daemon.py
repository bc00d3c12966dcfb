"""The deterministic simulation of a whole daemon (tests/sim/detsim/daemon.py): the real
shard feeding the real lake on a ModelFS, with the lake's faults and power cuts under the
seeded loop; the core's checks and the lake's invariants after every step, each cut's
crash state checked, and the final scan; the same seed gives the same trace.

Sizes (tests/tiers.py): QUIVERD_DAEMON_SIM_SEEDS seeds (smoke 3, full 200), seeds 1..N,
of one daemon, and a quarter as many of two daemons on one catalog, each in one child
process with PYTHONHASHSEED=0 so that a failing seed replays exactly with
``PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.detsim.daemon SEED``. The in-process
tests (replay, planted bugs) run the smaller DaemonSize ``SMOKE`` (``--smoke``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.sim.detsim.daemon import SMOKE, DaemonSimFailed, run_daemon
from tests.tiers import size

SEEDS = size(3, 200, env="QUIVERD_DAEMON_SIM_SEEDS")
TWO_DAEMON_SEEDS = max(1, SEEDS // 4)
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(max(300, 15 * SEEDS))


def _run_seeds(seeds: range, *more: str) -> list[dict[str, Any]]:
    """The seeds in one child process (PYTHONHASHSEED=0); every one must hold."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sim.detsim.daemon", *map(str, seeds), "--json", *more],
        cwd=REPO, env=env, capture_output=True, text=True,
        timeout=max(280, 14 * len(seeds) * (2 if more else 1)), check=False)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in results:
        print(f"seed {r['seed']}: {'ok' if r['ok'] else 'FAILED'} steps={r['steps']} "
              f"virtual_s={r['virtual_s']} wall_s={r['wall_s']} power_cuts={r['power_cuts']} "
              f"kills={r['kills']} images={r['cuts']} sent={r['sent']} acked={r['acked']} "
              f"uploader_acks={r['uploader_acks']} rows={r['rows']} "
              f"lake_checks={r['lake_checks']} commits={r['commits']} "
              f"faults={sum(r['faults'].values())} checks={r['checks']}")
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n\n".join(
        f"seed {r['seed']}: {r['error']}\nreplay: PYTHONHASHSEED=0 .venv/bin/python -m "
        f"tests.sim.detsim.daemon {r['seed']} {' '.join(more)}\n{r['tail']}" for r in failed)
    assert len(results) == len(seeds), proc.stderr[-3000:]
    for r in results:  # every seed reached what it checks
        assert r["acked"] > 0 and r["uploader_acks"] > 0 and r["rows"] > 0, r
        assert r["power_cuts"] >= 1 and r["commits"] > 0 and r["lake_checks"] > 0, r
        assert all(r["checks"].get(c, 0) > 0 for c in (
            "C1 ack after fdatasync", "C3 delivery not durably acked",
            "crash images checked", "seam mirror checks")), r["checks"]
    assert sum(r["checks"].get("C2 delete after durable acks", 0) for r in results) > 0
    assert sum(sum(r["faults"].values()) for r in results) > 0
    return results


def test_detsim_daemon_seeds_hold_every_invariant() -> None:
    _run_seeds(range(1, SEEDS + 1))


def test_detsim_daemon_two_daemons_one_catalog_hold_every_invariant() -> None:
    """Two daemons (two data directories, sources and node ids) on one catalog database
    and one store, both projecting into quiver.p: a quarter of the seeds."""
    results = _run_seeds(range(1, TWO_DAEMON_SEEDS + 1), "--daemons", "2")
    assert all(len({c.split()[0] for c in r["cuts"]}) == 2 for r in results)


def test_detsim_daemon_same_seed_same_trace() -> None:
    """Two daemons (the routing seam, two WAL thread pairs) replay step for step."""
    first = run_daemon(5, size=SMOKE, daemons=2)
    second = run_daemon(5, size=SMOKE, daemons=2)
    assert first.steps == second.steps and first.steps > 500
    assert first.trace == second.trace
    assert first.digest() == second.digest()
    assert first.cuts == second.cuts and first.lake_faults == second.lake_faults
    assert run_daemon(5, size=SMOKE).digest() != first.digest()


@pytest.mark.parametrize(("plant", "invariant"), [("no_removals", "I2"), ("expire_now", "I3")])
def test_detsim_daemon_catches_a_planted_bug(plant: str, invariant: str) -> None:
    """The projection never deletes a file a compaction replaced (``no_removals``), or
    expiry ignores the keep window (``expire_now``): some seed of 1..8 fails on it."""
    caught = []
    for seed in range(1, 9):
        try:
            run_daemon(seed, size=SMOKE, plant=plant, keep_trace=False)
        except DaemonSimFailed as exc:
            caught.append(exc.result.error)
            break
    assert caught, f"no seed of 1..8 caught the planted bug {plant}"
    assert caught[0].startswith(f"InvariantViolated: {invariant}:"), caught[0]
