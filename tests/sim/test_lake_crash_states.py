"""Crash states of the lake's local steps (staging files, catalog registration, the
janitor; on half the seeds compaction and the Iceberg projection too, on a few of those
with the catalog in PostgreSQL): seeded lake workloads
on an in-process daemon, every crash state their local barriers and the services'
changes allow, checked statically, and a seeded sample restarted and run until the lake
(and its Iceberg table) holds every acknowledged row (tests/sim/lakestates.py,
tests/sim/lakeiceberg.py).

Sizes: 2 workloads in the default tier, 10 in the full tier, ``QUIVERD_LAKE_WORKLOADS``
from ``scripts/prove``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.sim.lakeiceberg import iceberg_of, on_postgresql
from tests.sim.lakestates import CYCLE_WAIT_S, check_lake_crash_states, run_lake_workload
from tests.tiers import size

WORKLOADS = size(2, 10, "QUIVERD_LAKE_WORKLOADS")
CHUNKS = 2
FIRST_SEED = int(os.environ.get("QUIVERD_CRASH_FIRST_SEED", "0"))
# A chunk's seeds one after another: ~5 s a plain workload, ~20 s with Iceberg, ~45 s
# with PostgreSQL too, under load.
pytestmark = pytest.mark.timeout(max(120, 30 * WORKLOADS))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_lake_crash_states_keep_every_acked_row_once(chunk: int,
                                                    request: pytest.FixtureRequest) -> None:
    points = images = checked = restarted = pairs = behind = on_pg = 0
    seeds = range(FIRST_SEED + chunk, FIRST_SEED + WORKLOADS, CHUNKS)
    for seed in seeds:
        dsn = _database(request) if on_postgresql(seed) else ""
        on_pg += bool(dsn)
        run = run_lake_workload(seed, dsn=dsn)
        try:
            report = check_lake_crash_states(run, seed=seed)
        finally:
            run.services.close()
        points += report.points
        images += report.images
        checked += report.checked
        restarted += report.restarted
        pairs += report.iceberg_pairs
        behind += report.behind
        if report.violations:
            pytest.fail(f"lake workload seed {seed}: {report.violations[0]} "
                        f"({len(report.violations)} in all; the run is kept at {run.root})")
        assert run.cycled or not run.iceberg, (
            f"lake workload seed {seed}: no compaction, replace commit, expiry and deletion "
            f"of the replaced objects within {CYCLE_WAIT_S} s (the run is kept at {run.root})")
        shutil.rmtree(run.root, ignore_errors=True)
    no_server = sum(map(on_postgresql, seeds)) - on_pg
    print(f"lake crash states: {len(seeds)} workloads ({on_pg} on PostgreSQL"
          + (f", {no_server} meant for it on SQLite: no server" if no_server else "")
          + f"), {points} crash points, {images} "
          f"states, {checked} distinct checked, {restarted} restarted to the end; "
          f"{pairs} distinct (catalog, store) pairs with Iceberg data files checked, "
          f"{behind} states with a table behind the catalog (restarts drawn from them)")
    assert checked > 0
    assert pairs > 0 or not any(iceberg_of(s) for s in seeds), "no Iceberg state checked"


def _database(request: pytest.FixtureRequest) -> str:
    """A fresh PostgreSQL database of the test server ("" when none is installed: the
    seed runs on SQLite, and the summary line says so). The server starts only when a
    seed needs it (not in the default tier)."""
    try:
        server = request.getfixturevalue("postgres_dsn")
    except pytest.skip.Exception:
        return ""
    return str(server.create_database("lake"))
