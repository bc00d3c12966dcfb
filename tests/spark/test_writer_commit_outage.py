"""The driver's commit through a PostgreSQL outage (issue 26): it waits for the catalog
(option decide_timeout_s, default 300 s) instead of failing after ~15 s, and its writer
lease keeps the job from expiring when the catalog comes back.

No Spark session: the driver's ``QuiverWriter.commit`` is plain Python, called here as
Spark's driver-side worker calls it, with the commit message a task would have sent.
A real daemon, a real PostgreSQL stopped (immediate) and started again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.kernel.errors import CatalogUnavailable  # noqa: E402
from quiverd.spark.writer import QuiverCommitMessage, QuiverWriter  # noqa: E402
from tests.daemon.test_staging import tags_of, write_attempt  # noqa: E402
from tests.daemon.test_subscribers import add, consume, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)
OUTAGE_S = 18  # longer than the old retry budget (~15.5 s) and the writer lease (3 s)


def written(d: Any, job: str) -> QuiverCommitMessage:
    """What one task attempt of ``job`` sends the driver: its rows staged, marker durable."""
    with Client.connect(d.socket) as c:
        w = write_attempt(c, job, 0, 1, [1, 2])
    assert w is not None
    return QuiverCommitMessage(job_id=job, partition=0, task_attempt_id=1, attempt_number=0,
                               stage_id=0, rows=w.rows, checksum=w.checksum, node_id="",
                               shard=0, sequence=0)


def test_commit_waits_out_a_catalog_outage_and_the_job_is_published(
        daemon_factory: Any, postgres_server: Any, pg_catalog_dsn: str) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "staging.poll_interval_ms": 100, "staging.writer_timeout_s": 3,
                        "catalog.dsn": pg_catalog_dsn, "lake.enabled": False}).start()
    add(d, "x")
    message = written(d, "outage")
    wait_for(lambda: d.status()["staging"]["jobs"] == 1)
    writer = QuiverWriter({"path": str(d.socket), "job_id": "outage",
                           "visible_timeout_s": "0"}, False)
    postgres_server.stop("immediate")
    back = threading.Timer(OUTAGE_S, postgres_server.start)
    back.start()
    started = time.monotonic()
    try:
        writer.commit([message])
    finally:
        back.join()
    took = time.monotonic() - started
    assert OUTAGE_S - 1 < took < OUTAGE_S + 60, took
    assert tags_of(consume(d, "x", want=10, idle_s=1.5)) == [1, 2]  # published, not expired
    assert not d.events("staged_job_expired")
    assert d.stop() == 0


def test_commit_gives_up_after_decide_timeout_s_with_the_retryable_error(
        daemon_factory: Any, postgres_server: Any, pg_catalog_dsn: str) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "catalog.dsn": pg_catalog_dsn, "lake.enabled": False}).start()
    message = written(d, "outage2")
    writer = QuiverWriter({"path": str(d.socket), "job_id": "outage2",
                           "decide_timeout_s": "3"}, False)
    postgres_server.stop("immediate")
    try:
        started = time.monotonic()
        with pytest.raises(CatalogUnavailable):
            writer.commit([message])
        assert time.monotonic() - started < 3 + 10
    finally:
        postgres_server.start()
    assert d.stop() == 0
