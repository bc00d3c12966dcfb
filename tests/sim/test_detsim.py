"""The deterministic simulation of the lake's actors (tests/sim/detsim): seeded runs of two
daemons' real lakes with faults, their invariants checked after every step that changed
something; the same seed gives the same trace; planted bugs are caught.

Sizes (tests/tiers.py): QUIVERD_SIM_SEEDS seeds (smoke 4, full 200), seeds 1..N. They run
in one child process with PYTHONHASHSEED=0, so that a failing seed replays exactly with
``PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.detsim SEED`` (str hashing orders sets).
What the sim found is kept at the end as a regression test (a short janitor grace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.detsim import SimFailed, Size, run
from tests.tiers import size

SEEDS = size(4, 200, env="QUIVERD_SIM_SEEDS")
REPO = Path(__file__).resolve().parents[2]
SMALL = Size(bundles=8, faults_s=150.0, kills=1)  # in-process runs: 1-3 s each

pytestmark = pytest.mark.timeout(max(900, 20 * SEEDS))  # ~8 s a seed under load


def test_detsim_seeds_hold_every_invariant() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sim.detsim", *map(str, range(1, SEEDS + 1)), "--json"],
        # Scaled to the seeds, inside the test's own timeout: a fixed 880 s stopped the
        # full size's 200 seeds (~6 s each quiet, more under load) before their end.
        cwd=REPO, env=env, capture_output=True, text=True, timeout=max(880, 18 * SEEDS),
        check=False)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if not r["ok"]]
    for r in results:
        print(f"seed {r['seed']}: {'ok' if r['ok'] else 'FAILED'} steps={r['steps']} "
              f"virtual_s={r['virtual_s']} wall_s={r['wall_s']} checks={r['checks']} "
              f"commits={r['commits']} acked={r['bundles_acked']} kills={r['kills']} "
              f"faults={sum(r['faults'].values())}")
    assert not failed, "\n\n".join(
        f"seed {r['seed']}: {r['error']}\nreplay: PYTHONHASHSEED=0 .venv/bin/python -m "
        f"tests.sim.detsim {r['seed']}\n{r['tail']}" for r in failed)
    assert len(results) == SEEDS, proc.stderr[-3000:]
    assert sum(r["kills"] for r in results) > 0
    assert all(r["commits"] > 0 and r["bundles_acked"] > 0 for r in results)


def test_detsim_same_seed_same_trace() -> None:
    first = run(7, size=SMALL)
    second = run(7, size=SMALL)
    assert first.steps == second.steps and first.steps > 500
    assert first.trace == second.trace
    assert first.digest() == second.digest()
    assert first.faults == second.faults and sum(first.faults.values()) > 0
    assert run(8, size=SMALL).digest() != first.digest()


@pytest.mark.parametrize(("plant", "invariant"), [
    ("no_removals", "I2"), ("expire_now", "I3"), ("ack_on_delivery", "I1")])
def test_detsim_catches_a_planted_bug(plant: str, invariant: str) -> None:
    """``no_removals``: the projection never deletes a replaced file (a compaction's
    inputs stay next to its output); ``expire_now``: expiry ignores keep_snapshots_s,
    so the janitor deletes objects a snapshot within the window still names;
    ``ack_on_delivery``: a bundle counts as acked when it is delivered, before any file
    holding it is registered."""
    caught = []
    for seed in range(1, 6):
        try:
            run(seed, size=SMALL, plant=plant)
        except SimFailed as exc:
            caught.append(exc.result.error)
            break
    assert caught, f"no seed of 1..5 caught the planted bug {plant}"
    assert caught[0].startswith(f"InvariantViolated: {invariant}:"), caught[0]


def test_detsim_short_janitor_grace_keeps_registered_objects() -> None:
    """Found by the sim (seed 11, --harsh, lake.janitor.grace_s = 5): an upload's verify
    stat timed out (t=24.3 s) while its row was still Rotated (no object key); the
    janitor listed rows, then objects, judged the 8 s old object an orphan and deleted
    it (t=32.3), its delete's reply timed out; the uploader deleted and uploaded the
    object again and registered the file (t=34.3, its bundles acked); the janitor's
    retried delete (t=42.4) removed the registered file's object. Acked rows lost their
    only copy in the lake (I1: a registered file without its object). Fixed: an object
    named after a file still being uploaded is never an orphan, and each attempt of an
    orphan delete asks the catalog again (quiverd/lake/janitor.py)."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sim.detsim", "11", "--harsh", "--janitor-grace-s", "5",
         "--janitor-interval-s", "10", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert line["ok"], line["error"]
