"""A micro-batch whose job was expired (its query down longer than the writer lease) or
aborted by an operator is written again by the restarted query under the next
incarnation of its job id, and a committed one is found, not written twice (issue 26:
the lease made expiry minutes instead of a day). A real daemon; no Spark session (the
writer's ``incarnation`` and ``_written_as`` are what write() and commit() call)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from quiverd.kernel.errors import JobConflict  # noqa: E402
from quiverd.spark.writer import (  # noqa: E402
    QuiverCommitMessage,
    _written_as,
    incarnation,
)
from tests.daemon.test_staging import write_attempt  # noqa: E402
from tests.daemon.test_subscribers import wait_for  # noqa: E402


def message(job_id: str, partition: int) -> QuiverCommitMessage:
    return QuiverCommitMessage(job_id=job_id, partition=partition, task_attempt_id=1,
                               attempt_number=0, stage_id=0, rows=0, checksum=0,
                               node_id="", shard=0, sequence=0)


def test_a_replayed_micro_batch_writes_under_the_next_incarnation_of_an_expired_job(
        daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "staging.poll_interval_ms": 100,
                        "staging.writer_timeout_s": 1}).start()
    with Client.connect(d.socket) as c:
        assert incarnation(c, "q-5") == ("q-5", "unknown")
        write_attempt(c, "q-5", 0, 1, [1])  # the failed run: its query died
    with Client.connect(d.socket) as c:
        wait_for(lambda: c.job_status("q-5")["state"] == "expired", timeout=15)
        assert incarnation(c, "q-5") == ("q-5.1", "unknown")
        w = write_attempt(c, "q-5.1", 0, 1, [1])  # the replay
        assert w is not None
        c.abort_job("q-5.1", "an operator's abort")
        assert incarnation(c, "q-5") == ("q-5.2", "unknown")
        w = write_attempt(c, "q-5.2", 0, 2, [1])
        assert w is not None
        c.commit_job("q-5.2", [w])
        assert incarnation(c, "q-5") == ("q-5.2", "committed")  # a later replay: skipped
    assert _written_as([message("q-5.2", 0), message("q-5.2", 1)], "q-5") == "q-5.2"
    assert _written_as([], "q-5") == "q-5"
    with pytest.raises(JobConflict, match="an incarnation was expired while they ran"):
        _written_as([message("q-5.1", 0), message("q-5.2", 1)], "q-5")
    assert d.stop() == 0
