"""A job's rows become Parquet while it writes (SPEC §7, ``lake.convert_staged``): real
daemon, real sockets, the embedded catalog and the fs store.

The dispatcher gives the uploader each held bundle once; the uploader writes it into a
staged file of its attempt, registered only once the bundles come published. The commit
then publishes those files: a losing attempt's file is abandoned and never registered,
an aborted job's too, and the lake holds each winning row once.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from quiverd.client import Client
from tests.daemon.lake_helpers import read_object, registered_rows
from tests.daemon.test_job_visible import DEFAULT_LAKE
from tests.daemon.test_staging import write_attempt
from tests.daemon.test_subscribers import wait_for

pytestmark = pytest.mark.timeout(120)
EARLY = {**DEFAULT_LAKE, "segment.max_open_duration_ms": 50}


def tags_in_lake(d: Any) -> Counter[int]:
    return Counter(v for r in registered_rows(d) if r.client_name == "spark"
                   for v in read_object(r)["tag"].to_pylist())


def test_a_jobs_rows_are_in_staged_files_before_the_commit_and_published_once(
        daemon_factory: Any) -> None:
    d = daemon_factory(EARLY, in_process=True).start()
    with Client.connect(d.socket) as c:
        write_attempt(c, "early", 0, 1, [1, 2, 3])  # a speculative twin that loses
        w0 = write_attempt(c, "early", 0, 2, [4, 5, 6])
        w1 = write_attempt(c, "early", 1, 3, [7, 8])
        assert w0 and w1
        # One staged file per attempt is open before anything is decided.
        wait_for(lambda: len(d.events("lake_file_received")) >= 3)
        assert registered_rows(d) == []
        c.commit_job("early", [w0, w1])
        seen = c.wait_visible("early", timeout_s=30)
    assert seen.visible and seen.lake and seen.pending == 0, seen
    assert tags_in_lake(d) == Counter({t: 100 for t in (4, 5, 6, 7, 8)})  # once each
    reasons = Counter(e.get("reason") for e in d.events("lake_file_rotated"))
    assert reasons == {"staged": 2}, reasons  # nothing converted after the commit
    wait_for(lambda: any(e.get("reason") == "staged file lost"
                         for e in d.events("lake_file_abandoned")))
    assert d.stop() == 0


def test_an_aborted_jobs_staged_files_are_abandoned(daemon_factory: Any) -> None:
    d = daemon_factory(EARLY, in_process=True).start()
    with Client.connect(d.socket) as c:
        write_attempt(c, "gone", 0, 1, [1, 2])
        write_attempt(c, "gone", 1, 2, [3])
        wait_for(lambda: len(d.events("lake_file_received")) >= 2)
        c.abort_job("gone")
    wait_for(lambda: len([e for e in d.events("lake_file_abandoned")
                          if e.get("reason") == "staged file lost"]) == 2)
    assert registered_rows(d) == []
    assert d.stop() == 0


def test_convert_staged_off_converts_after_the_commit(daemon_factory: Any) -> None:
    d = daemon_factory({**EARLY, "lake.convert_staged": False}, in_process=True).start()
    with Client.connect(d.socket) as c:
        w0 = write_attempt(c, "late", 0, 1, [1, 2])
        assert w0
        c.commit_job("late", [w0])
        assert c.wait_visible("late", timeout_s=30).visible
    assert tags_in_lake(d) == Counter({1: 100, 2: 100})
    reasons = Counter(e.get("reason") for e in d.events("lake_file_rotated"))
    assert reasons == {"commit": 1}, reasons
    assert d.stop() == 0
