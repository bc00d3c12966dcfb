"""A Spark task that waits for its input longer than the daemon's idle timeout and the
writer lease (issue 26): its keepalives keep the connection and the job alive, and the
write lands once, with no task retried. A real daemon, a real local Spark."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from tests.spark.test_writer import published, start, write  # noqa: E402

pytestmark = pytest.mark.timeout(240)
# Before each batch: more than idle_timeout_ms and writer_timeout_s. (A lease of 1 s is
# shorter than Spark's step from the last task to the driver's commit: 4 s.)
PAUSE_S = 4.5
WRITER_TIMEOUT_S = 4


def slow(marks: Path) -> Any:
    """A mapInArrow function that makes the writer wait for every batch, and leaves one
    file per task attempt."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        (marks / f"{ctx.partitionId()}-{ctx.attemptNumber()}").touch()
        for batch in batches:
            for i in range(0, batch.num_rows, 1_000):
                time.sleep(PAUSE_S)
                yield batch.slice(i, 1_000)

    return run


def test_writer_waiting_for_input_keeps_its_connection_and_job_with_keepalives(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    d = start(daemon_factory, **{"ingest.idle_timeout_ms": 1000,
                                 "staging.writer_timeout_s": WRITER_TIMEOUT_S})
    marks = tmp_path / "tasks"
    marks.mkdir()
    df = spark.range(0, 4_000, 1, 2).selectExpr("id", "id * 7 as h")  # 2 waits per task
    write(df.mapInArrow(slow(marks), df.schema), d, job_id="slow-job")
    got = published(d, rows=4_000)
    assert got is not None and got.num_rows == 4_000
    assert sorted(got["id"].to_pylist()) == list(range(4_000))
    assert sorted(p.name for p in marks.iterdir()) == ["0-0", "1-0"]  # none retried
    assert not d.events("staged_job_expired")
    assert d.stop() == 0
