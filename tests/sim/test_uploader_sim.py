"""The uploader's seeded simulation (tests/sim/uploadersim.py): its intake, row groups,
rotations, publishers and acks under a seeded scheduler, with the staging disk, the
store and the catalog failing and the uploader restarted; every ack checked against the
catalog, and the registered files' rows against what was sent, each exactly once.

Sizes (tests/tiers.py): QUIVERD_UPLOADER_SIM_SEEDS seeds (smoke 12, full 200), seeds
1..N, in one child process with PYTHONHASHSEED=0 so that a failing seed replays exactly
with ``PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.uploadersim SEED``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import size

SEEDS = size(12, 200, env="QUIVERD_UPLOADER_SIM_SEEDS")
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(max(300, 5 * SEEDS))


def test_uploader_sim_seeds_hold_every_row_once() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sim.uploadersim", *map(str, range(1, SEEDS + 1))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=max(280, 4 * SEEDS),
        check=False)
    ok = [line for line in proc.stdout.splitlines() if ": ok," in line]
    print(f"uploader sim: {len(ok)} of {SEEDS} seeds ok")
    assert proc.returncode == 0 and len(ok) == SEEDS, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_uploader_sim_replays_from_its_seed() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    runs = [subprocess.run([sys.executable, "-m", "tests.sim.uploadersim", "7", "--smoke"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                           check=True).stdout for _ in range(2)]
    digests = [r.rsplit("digest ", 1)[-1].strip() for r in runs]
    assert digests[0] == digests[1] and len(digests[0]) == 16, runs
