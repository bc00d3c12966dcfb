"""How ``./scripts/test`` spreads the suite over pytest-xdist workers: by group.

Each work unit goes to one worker whole. A unit is a test file, except for the groups
below, which share something a second worker must not start or touch at the same time:

    spark    tests/spark/ (not cluster/): the run's one local Spark session (5-9 s to
             start, 1-2 GB of JVM; tests/spark/conftest.py), except the tests in
             SESSIONLESS, which drive Spark's code without the session (their own
             driver processes, or the writer's tasks called directly) and so run
             beside it; collection fails if a test there asks for the session
    cluster  tests/spark/cluster/: a standalone master and two workers on loopback
    loop     the loop-mounted filesystem images (power cuts, XFS disk-full): loop devices
             and dm targets are machine-wide

The PostgreSQL and moto S3 servers are per worker (session fixtures, each on its own
socket directory and port), and each test takes its own database, bucket and prefix, so
nothing else needs a group. Units are handed out longest first (groups, then files by
their number of tests), which keeps the Spark group, the longest, from starting last.

pytest-xdist's own ``--dist loadgroup`` reads ``xdist_group`` marks through a node-id
suffix that pytest 9.2 no longer lets it write (pytest-xdist#1386: the marks are ignored
and the tests run round-robin); this scheduler needs no marks, only paths. It replaces
the default ``--dist load`` when ``-n`` is given; an explicit ``--dist`` keeps its mode.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

GROUPS: tuple[tuple[str, str], ...] = (
    # (group, node-id prefix): the first prefix that matches wins.
    ("cluster", "tests/spark/cluster/"),
    ("spark", "tests/spark/"),
    ("loop", "tests/daemon/test_power_cut.py"),
    ("loop", "tests/daemon/test_disk_full.py"),
)
ORDER = ("spark", "cluster", "loop")
SESSIONLESS = (  # node-id prefixes under tests/spark/ that need no Spark session
    "tests/spark/test_writer_commit_outage.py",
    "tests/spark/test_writer_incarnation.py",
    "tests/spark/test_spark_types.py",
    "tests/spark/test_stream_source.py::test_stream_killed_mid_stream_restarts_exactly_once",
    "tests/spark/test_writer_faults.py::test_driver_killed_before_the_commit_leaves_nothing_",
    "tests/spark/test_stream_history.py::test_stream_history_killed_mid_batch_restarts_exactly",
    "tests/spark/test_stream_history.py::test_stream_history_batch_replanned_after_compaction",
    "tests/spark/test_stream_history.py::test_stream_history_source_id_comes_from_the_daemon",
)
SESSION_FIXTURE = "spark"


def group_of(nodeid: str) -> str:
    """The work unit of ``nodeid``: its group's name, or its file (or, for a SESSIONLESS
    prefix, that prefix)."""
    for prefix in SESSIONLESS:
        if nodeid.startswith(prefix):
            return prefix
    for group, prefix in GROUPS:
        if nodeid.startswith(prefix):
            return group
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "load":
        return None  # the caller chose a mode: keep it
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    # Units are queued in collection order, which the workers sort (below).
    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test that asks for the Spark session outside the Spark group (it would
    start a second session on another worker). On an xdist worker, sort the collection
    into the order units are handed out: the groups first (longest: the Spark
    session's), then files by number of tests. Every worker sorts the same way, so their
    collections stay identical (xdist checks)."""
    strays = [item.nodeid for item in items if SESSION_FIXTURE in getattr(
        item, "fixturenames", ()) and group_of(item.nodeid) != "spark"]
    if strays:
        raise pytest.UsageError(
            f"{len(strays)} test(s) ask for the Spark session outside the Spark group, "
            f"e.g. {strays[0]}: a parallel run would start a second session; hint: move "
            "the test under tests/spark/ (and out of SESSIONLESS in tests/xdist_groups.py)")
    if not hasattr(config, "workerinput"):
        return  # a plain run keeps pytest's order
    units = Counter(group_of(item.nodeid) for item in items)

    def key(unit: str) -> tuple[int, int]:
        rank = ORDER.index(unit) if unit in ORDER else len(ORDER)
        return rank, -units[unit]

    position = {unit: i for i, unit in enumerate(sorted(units, key=key))}
    items.sort(key=lambda item: position[group_of(item.nodeid)])  # stable within a unit
