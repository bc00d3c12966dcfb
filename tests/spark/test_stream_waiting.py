"""spark.readStream.format("quiver") at an undecided exactly-once job (issue 26): the
query's progress names the job it waits for (the source's ``latestOffset``), and an
operator's abort (``quiverd jobs abort``) lets it go on. A real daemon, a real local
Spark, the real CLI."""

from __future__ import annotations

import json
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.kernel.bundle import TxnTag
from tests.daemon.helpers import tagged_table
from tests.daemon.test_cli import quiverd
from tests.spark.test_stream_source import ROWS, produce, stream, wait_for

pytestmark = pytest.mark.timeout(300)


def reported(progress: Any) -> Any:
    """The source's latestOffset in one progress (Spark hands it out as JSON text)."""
    latest = progress["sources"][0].get("latestOffset") if progress["sources"] else None
    return json.loads(latest) if isinstance(latest, str) else latest


def waiting_in_progress(q: Any) -> dict[str, Any] | None:
    for p in reversed(q.recentProgress):
        latest = reported(p)
        if isinstance(latest, dict) and latest.get("waiting_for_jobs"):
            return latest["waiting_for_jobs"]  # type: ignore[no-any-return]
    return None


def test_stream_progress_names_the_job_it_waits_for_and_an_abort_releases_it(
        spark: Any, daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "staging.poll_interval_ms": 100,
                        "staging.writer_timeout_s": 600}).start()
    produce(d, range(1, 2))
    with Client.connect(d.socket) as c:  # a writer gone without a decision
        c.send(tagged_table(99, rows=ROWS), client="a",
               txn=TxnTag(job_id="held-job", partition=0, attempt=1, row_offset=0))
    produce(d, range(2, 3))
    q = (stream(spark, d, "waiting").writeStream.format("memory").queryName("waiting_q")
         .trigger(processingTime="500 milliseconds").start())
    try:
        wait_for(lambda: waiting_in_progress(q) is not None, timeout=120,
                 what="the query's progress naming the job")
        assert waiting_in_progress(q) == {"0": "held-job"}
        assert sorted({r.tag for r in spark.table("waiting_q").collect()}) == [1]
        out = quiverd("jobs", "abort", "held-job", "--socket", str(d.admin_socket)).stdout
        assert "is now aborted" in out
        wait_for(lambda: sorted({r.tag for r in spark.table("waiting_q").collect()}) == [1, 2],
                 timeout=60, what="the rows after the job")
        # Spark asks for the report before planning the trigger: a later one is clear.
        wait_for(lambda: reported(q.lastProgress)["waiting_for_jobs"] == {}, timeout=60,
                 what="a progress no longer naming the job")
    finally:
        q.stop()
    assert q.exception() is None
    assert d.stop() == 0
