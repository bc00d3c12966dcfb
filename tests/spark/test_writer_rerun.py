"""A batch write re-run under a committed job_id (issue 26): the same rows are a silent
no-op; different rows are not written either, and the driver says so, naming the earlier
commit (if_committed="skip", the default), or the write fails (if_committed="verify")."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.spark.writer import (  # noqa: E402
    QuiverCommitMessage,
    WriteRefused,
    rerun_differs,
)
from tests.spark.test_writer import hashed, published, start, write  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def warnings_in(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines()
            if line.startswith("{") and "spark_job_rerun_differs" in line]


def replayed(partition: int, rows: int, differs: str = "") -> QuiverCommitMessage:
    """A task's message for a skipped replay of job "j", committed with 2 partitions."""
    return QuiverCommitMessage(
        job_id="j", partition=partition, task_attempt_id=9, attempt_number=0, stage_id=0,
        rows=0, checksum=0, node_id="", shard=-1, sequence=-1, published_before=True,
        recorded=((0, 1, 500, 11), (1, 2, rows, 22)), differs=differs,
        committed_at_ns=1_764_633_600 * 10**9, committed_by="host-a")


def test_rerun_differs_warns_on_the_driver_naming_the_earlier_commit(
        capsys: pytest.CaptureFixture[str]) -> None:
    rerun_differs([replayed(0, 500), replayed(1, 500)], "j", refuse=False)
    assert warnings_in(capsys.readouterr().err) == []  # the same rows: silent
    rerun_differs([replayed(0, 500, "partition 0: 750 rows now, 500 committed"),
                   replayed(1, 500)], "j", refuse=False)
    [warning] = warnings_in(capsys.readouterr().err)
    assert warning["level"] == "warning" and warning["job_id"] == "j"
    assert warning["message"] == (
        "job 'j' was committed 2025-12-02T00:00:00Z by host-a with 1000 rows in 2 "
        "partitions; this write's rows differ (partition 0: 750 rows now, 500 committed) "
        "and are NOT written: a job id is written once")
    rerun_differs([replayed(0, 500)], "j", refuse=False)  # one partition now
    assert "1 partitions now, 2 committed" in warnings_in(capsys.readouterr().err)[0][
        "message"]
    with pytest.raises(WriteRefused, match=r'NOT written: a job id is written once '
                       r'\(if_committed="verify"\)'):
        rerun_differs([replayed(0, 500, "partition 0: other"), replayed(1, 500)], "j",
                      refuse=True)


def test_writer_rerun_of_a_committed_job_id_with_other_rows_is_told_or_refused(
        daemon_factory: Any, spark: Any) -> None:
    d = start(daemon_factory)
    write(hashed(spark, 1_000, 2), d, job_id="rerun")
    assert published(d, rows=1_000) is not None
    # Each task compares its input, as it would have sent it, with the commit's winner.
    write(hashed(spark, 1_000, 2), d, job_id="rerun", if_committed="verify")  # the same
    with pytest.raises(Exception, match=r"job 'rerun' was committed 20\S+ by \S+ with "
                       r"1000 rows in 2 partitions; this write's rows differ \(partition "
                       r"0: 750 rows now, 500 committed; partition 1: 750 rows now, 500 "
                       r"committed\) and are NOT written"):
        write(hashed(spark, 1_500, 2), d, job_id="rerun", if_committed="verify")
    write(hashed(spark, 1_500, 2), d, job_id="rerun")  # "skip": a warning, no error
    assert published(d, rows=0) is None  # nothing of the re-runs was published
    assert d.stop() == 0
