"""The lake's freshness (issue 29, item 3): ``quiver_lake_freshness_seconds`` and
``status`` give the age of the oldest acked bundle not yet in an Iceberg snapshot; it
grows while a bundle waits for its file to rotate and falls to 0 once it is in."""

from __future__ import annotations

import time
from typing import Any

from quiverd.client import Client
from tests.daemon.lake_helpers import FAST_LAKE, logs_table


def freshness(d: Any) -> float:
    return float(d.status()["lake"]["freshness_s"])


def test_freshness_grows_while_a_bundle_waits_and_falls_once_it_is_in(
        daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "lake.file_duration_ms": 4000}, in_process=True).start()
    assert freshness(d) == 0.0
    with Client.connect(d.socket) as c:
        c.send(logs_table(0, 0), client="web")
    time.sleep(1.5)
    first = freshness(d)
    time.sleep(1.0)
    second = freshness(d)
    assert 1.0 <= first < second, (first, second)  # the file has not rotated yet
    deadline = time.monotonic() + 60
    while freshness(d) > 0:
        assert time.monotonic() < deadline, d.status()["lake"]
        time.sleep(0.2)
    subs = {s["name"]: s for s in d.status()["subscribers"]} if "subscribers" in d.status() \
        else {}
    if "uploader" in subs:
        assert subs["uploader"]["oldest_pending_s"] == 0.0
