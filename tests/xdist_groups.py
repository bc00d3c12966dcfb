"""How ``./scripts/test`` spreads the suite over pytest-xdist workers: by group.

Each work unit goes to one worker whole. A unit is a test file, except for the groups
below, which share something a second worker must not start or touch at the same time:

    spark    tests/spark/ (not cluster/): the run's one local Spark session (5-9 s to
             start, 1-2 GB of JVM; tests/spark/conftest.py)
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


def group_of(nodeid: str) -> str:
    """The work unit of ``nodeid``: its group's name, or its file."""
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
    """On an xdist worker, sort the collection into the order units are handed out: the
    groups first (longest: the Spark session's), then files by number of tests. Every
    worker sorts the same way, so their collections stay identical (xdist checks)."""
    if not hasattr(config, "workerinput"):
        return  # a plain run keeps pytest's order
    units: dict[str, int] = {}
    for item in items:
        unit = group_of(item.nodeid)
        units[unit] = units.get(unit, 0) + 1

    def key(unit: str) -> tuple[int, int]:
        rank = ORDER.index(unit) if unit in ORDER else len(ORDER)
        return rank, -units[unit]

    position = {unit: i for i, unit in enumerate(sorted(units, key=key))}
    items.sort(key=lambda item: position[group_of(item.nodeid)])  # stable within a unit
