"""Crash states of the lake's local steps (staging files, catalog registration, the
janitor): seeded lake workloads on an in-process daemon, every crash state their local
barriers and the services' changes allow, checked statically, and a seeded sample
restarted and run until the lake holds every acknowledged row (tests/sim/lakestates.py).

Sizes: 2 workloads in the default tier, 10 in the full tier, ``QUIVERD_LAKE_WORKLOADS``
from ``scripts/prove``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.sim.lakestates import check_lake_crash_states, run_lake_workload
from tests.tiers import size

WORKLOADS = size(2, 10, "QUIVERD_LAKE_WORKLOADS")
CHUNKS = 2
FIRST_SEED = int(os.environ.get("QUIVERD_CRASH_FIRST_SEED", "0"))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_lake_crash_states_keep_every_acked_row_once(chunk: int) -> None:
    points = images = checked = restarted = 0
    seeds = range(FIRST_SEED + chunk, FIRST_SEED + WORKLOADS, CHUNKS)
    for seed in seeds:
        run = run_lake_workload(seed)
        try:
            report = check_lake_crash_states(run, seed=seed)
        finally:
            run.services.close()
        points += report.points
        images += report.images
        checked += report.checked
        restarted += report.restarted
        if report.violations:
            pytest.fail(f"lake workload seed {seed}: {report.violations[0]} "
                        f"({len(report.violations)} in all; the run is kept at {run.root})")
        shutil.rmtree(run.root, ignore_errors=True)
    print(f"lake crash states: {len(seeds)} workloads, {points} crash points, {images} "
          f"states, {checked} distinct checked, {restarted} restarted to the end")
    assert checked > 0
