"""Read your writes (SPEC §7): the JOB op ``visible`` on real daemons, no Spark.

A committed job's rows reach the catalog when the driver asks, with a 5 min
``lake.file_duration_ms`` (the default is 1 s; the long timer shows nothing waits for
it) and the default ``segment.max_open_duration_ms`` (1 s); with the Iceberg projection
on, they are also in a committed snapshot when the answer comes. A daemon without a
lake says so at once; a lake that cannot publish (an unreachable store) gets an
answer at the timeout saying the job is committed.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.kernel.errors import JobConflict
from quiverd.lake.model import FileState
from quiverd.spark.visible import wait_visible
from tests.daemon.lake_helpers import registered_rows
from tests.daemon.test_lake_degraded import s3_settings
from tests.daemon.test_staging import write_attempt

pytestmark = pytest.mark.timeout(120)
DEFAULT_LAKE = {"lake.enabled": True, "lake.janitor.interval_s": 0,
                "lake.compaction.interval_s": 0, "lake.file_duration_ms": 300_000}


def rows_in_catalog(d: Any, client: str) -> int:
    return sum(r.row_count for r in registered_rows(d) if r.client_name == client)


def test_visible_after_commit_with_the_default_lake_config(daemon_factory: Any) -> None:
    d = daemon_factory(DEFAULT_LAKE, in_process=True).start()
    with Client.connect(d.socket) as c:
        c.send(write_table(), client="other")  # untagged rows of another client
        w0 = write_attempt(c, "ryw", 0, 1, [1, 2, 3])
        w1 = write_attempt(c, "ryw", 1, 2, [4, 5])
        assert w0 and w1
        c.commit_job("ryw", [w0, w1])
        started = time.monotonic()
        seen = c.wait_visible("ryw", timeout_s=30)
        took = time.monotonic() - started
    assert seen.visible and seen.lake and seen.pending == 0, seen
    assert seen.iceberg is None, seen  # the projection is off here
    assert seen.bundles == 5 and seen.job_id == "ryw", seen
    assert took < 10, took  # not the 5 min file timer, nor a segment's 1 s per step
    assert rows_in_catalog(d, "spark") == 500  # every row of the job, at once
    assert rows_in_catalog(d, "other") == 0  # the other client's file waits for its timer
    rotated = [e for e in d.events("lake_file_rotated") if e.get("reason") in ("commit", "staged")]
    assert rotated, d.log()[-3000:]
    with Client.connect(d.socket) as c:  # asking again: visible at once
        again = c.wait_visible("ryw", timeout_s=5)
        assert again.visible and again.waited_ms < 3000, again
        with pytest.raises(JobConflict, match="not committed"):
            c.wait_visible("never-committed", timeout_s=1)
    assert d.stop() == 0


def test_visible_waits_for_the_iceberg_snapshot_too(daemon_factory: Any) -> None:
    """With the projection on, ``visible`` answers once the job's files are in a committed
    snapshot: a pyiceberg reader loading the table right after sees every row (it saw
    none before the answer waited for the snapshot: the projection lingers 200 ms and
    commits after the registration)."""
    from tests.daemon.iceberg_helpers import scan

    d = daemon_factory({**DEFAULT_LAKE, "lake.iceberg.enabled": True,
                        "lake.iceberg.linger_ms": 1000}, in_process=True).start()
    for job in ("ice-1", "ice-2"):
        with Client.connect(d.socket) as c:
            w0 = write_attempt(c, job, 0, 1, [1, 2, 3])
            assert w0
            c.commit_job(job, [w0])
            seen = c.wait_visible(job, timeout_s=30)
        assert seen.visible and seen.iceberg is True and seen.pending == 0, seen
        t = scan(d, "quiver.spark")  # right after the answer, as a driver's next read
        assert t.num_rows == 300 * (1 + (job == "ice-2")), (job, t.num_rows)
    assert [e for e in d.events("job_visible") if e.get("iceberg") is True]
    assert d.stop() == 0


def test_visible_job_without_rows_answers_at_once(daemon_factory: Any) -> None:
    d = daemon_factory(DEFAULT_LAKE, in_process=True).start()
    with Client.connect(d.socket) as c:
        empty = write_attempt(c, "empty", 0, 1, [])
        assert empty is not None and empty.rows == 0
        c.commit_job("empty", [empty])
        seen = c.wait_visible("empty", timeout_s=30)
    assert seen.visible and seen.bundles == 0 and seen.waited_ms < 5000, seen
    assert d.stop() == 0


def test_visible_lake_off_answers_at_once_that_there_is_no_lake(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 2}, in_process=True).start()  # the factory turns the lake off
    with Client.connect(d.socket) as c:
        w = write_attempt(c, "nolake", 0, 1, [1])
        assert w is not None
        c.commit_job("nolake", [w])
        started = time.monotonic()
        seen = c.wait_visible("nolake", timeout_s=30)
    assert time.monotonic() - started < 2
    assert not seen.lake and not seen.visible and "lake.enabled = false" in seen.reason, seen
    assert d.stop() == 0


def test_visible_store_unreachable_times_out_saying_committed_and_durable(
        daemon_factory: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = daemon_factory({**DEFAULT_LAKE, **s3_settings({
        "bucket": "nowhere", "endpoint": f"http://127.0.0.1:{port}", "region": "us-east-1",
        "access_key_id": "x", "secret_access_key": "y", "disable_config_load": "true",
        "disable_ec2_metadata": "true"})}, in_process=True).start()
    with Client.connect(d.socket) as c:
        w = write_attempt(c, "stuck", 0, 1, [1, 2])
        assert w is not None
        c.commit_job("stuck", [w])
        started = time.monotonic()
        seen = c.wait_visible("stuck", timeout_s=4)
        took = time.monotonic() - started
        assert c.job_status("stuck")["state"] == "committed"
    assert 3.5 < took < 10, took
    assert not seen.visible and seen.lake and seen.pending == 2 == seen.bundles, seen
    assert "committed and durable" in seen.reason, seen.reason
    assert "quiverd status" in seen.reason and "store" in seen.reason, seen.reason
    assert d.events("job_not_visible_yet")
    # The Spark driver's side of it: the commit returns, with one warning saying why.
    problems = wait_visible([str(d.socket)], "stuck", 1.0)
    assert len(problems) == 1 and "committed and durable" in problems[0], problems
    assert "spark_commit_not_visible" in capsys.readouterr().err
    # The file was rotated for the commit and waits for the store, not for its timer.
    states = Counter(r.state for r in pending_rows(d))
    assert states.get(FileState.ROTATED, 0) >= 1, states
    assert d.stop() == 0


def pending_rows(d: Any) -> list[Any]:
    import anyio

    from quiverd.kernel.config import load
    from quiverd.kernel.logs import get as get_logger
    from quiverd.lake.tier import open_tier

    async def rows() -> list[Any]:
        async with open_tier(load(d.config_path), get_logger("test")) as tier:
            return list(await tier.catalog.list_files(states=[FileState.ROTATED]))

    return anyio.run(rows)


def write_table() -> Any:
    import pyarrow as pa

    return pa.table({"x": list(range(10))})
