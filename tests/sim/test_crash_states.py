"""Crash states of the real daemon: seeded workloads recorded through the file-system
seam, every crash state their barriers allow recovered by quiverd's own recovery and
checked (tests/sim/crashstates.py has the invariants, tests/sim/modelfs.py the model).

Sizes: 4 workloads in the default tier, 40 in the full tier, 1,000 from ``scripts/prove``
(``QUIVERD_CRASH_WORKLOADS``). A workload is timing-dependent (a real daemon on threads),
so a failure prints its ops log's path: ``replay_saved`` checks that log again exactly.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import pytest

from tests.sim.crashstates import check_crash_states
from tests.sim.workload import drops_in, run_workload
from tests.tiers import size

WORKLOADS = size(4, 40, "QUIVERD_CRASH_WORKLOADS")
CHUNKS = 4  # test ids, so that parallel workers share the workloads
FIRST_SEED = int(os.environ.get("QUIVERD_CRASH_FIRST_SEED", "0"))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_crash_states_of_seeded_workloads_keep_every_acked_bundle_once(chunk: int) -> None:
    points = images = recovered = false_loss = torn = 0
    for seed in range(FIRST_SEED + chunk, FIRST_SEED + WORKLOADS, CHUNKS):
        ops, facts = run_workload(seed, rounds=6)
        report = check_crash_states(ops, facts, seed=seed, drops=drops_in(seed))
        points += report.points
        images += report.images
        recovered += report.recovered
        false_loss += report.false_loss
        torn += report.torn_unsynced
        if report.violations:
            saved = Path(tempfile.mkdtemp(prefix="qcrash-fail")) / f"seed-{seed}.pkl"
            saved.write_bytes(pickle.dumps((ops, facts, seed)))
            pytest.fail(f"workload seed {seed}: {report.violations[0]} "
                        f"({len(report.violations)} in all; ops log kept at {saved}, "
                        "check it again with tests.sim.crashstates.replay_saved)")
    print(f"crash states: {len(range(FIRST_SEED + chunk, FIRST_SEED + WORKLOADS, CHUNKS))} "
          f"workloads, {points} crash points, {images} states, {recovered} distinct recovered, "
          f"{torn} with torn unsynced entries found (never acked, not loss), "
          f"{false_loss} with never-acked sequences reported lost")
    assert recovered > 0
