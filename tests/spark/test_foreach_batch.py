"""The batch writer as data engineers call it from Spark: ``foreachBatch`` with a job id
per micro-batch (a replay after a restart is skipped, or refused with
``if_committed="error"``), and ``saveAsTable``, refused before any row is sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from tests.spark.test_writer import (  # noqa: E402
    hashed,
    id_table,
    marking,
    published,
    start,
    sums,
    write,
)

pytestmark = pytest.mark.timeout(180)


def test_foreach_batch_replay_is_skipped_error_mode_and_aborted_ids_refuse_once(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    d = start(daemon_factory)
    source, checkpoint = tmp_path / "in", tmp_path / "ck"
    source.mkdir()
    pq.write_table(id_table(0, 400), source / "a.parquet")

    def to_quiver(batch_df: Any, batch_id: int) -> None:
        write(batch_df, d, job_id=f"fb-{batch_id}", client="fb")

    def run() -> None:
        df = spark.readStream.schema("id long, h long").parquet(str(source))
        q = (df.writeStream.foreachBatch(to_quiver)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
        q.awaitTermination(120)
        assert q.exception() is None, q.exception()

    run()
    first = published(d, rows=400)
    assert first is not None and sums(first) == sums(id_table(0, 400))
    with Client.connect(d.socket) as c:
        winners = c.job_status("fb-0")["winners"]
    # The query "crashed" after foreachBatch returned but before Spark logged the batch:
    # batch 0 runs again, with the same job id. The default, if_committed=skip: no error,
    # no row sent again, and the job's decision unchanged.
    for name in ("0", ".0.crc"):
        (checkpoint / "commits" / name).unlink()
    run()
    assert (checkpoint / "commits" / "0").exists()
    with Client.connect(d.socket) as c:
        assert c.job_status("fb-0")["winners"] == winners
    # The same replay with if_committed=error fails once, saying what to do, and sends
    # nothing: every task asked first (its mark) and none was run again.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    again = spark.read.parquet(str(source))
    with pytest.raises(Exception) as info:
        write(again.mapInArrow(marking(tasks), again.schema), d, job_id="fb-0",
              if_committed="error")
    text = str(info.value)
    assert "job 'fb-0' is committed already" in text and 'if_committed="skip"' in text
    assert all(p.name.endswith("-0") for p in tasks.iterdir())  # not retried
    # A job id aborted before fails once whatever if_committed says.
    with Client.connect(d.socket) as c:
        c.abort_job("gone", "the test")
    with pytest.raises(Exception, match="job 'gone' is aborted already, and a job id is "
                       "decided once: use a new job_id"):
        write(hashed(spark, 100, 2), d, job_id="gone")
    # Nothing published since the first run's 400 rows: not the replay, not the refusals.
    assert published(d, rows=0) is None
    d.stop()


def test_save_as_table_is_refused_before_any_row_is_sent(daemon_factory: Any,
                                                         spark: Any) -> None:
    d = start(daemon_factory)
    df = hashed(spark, 500, 2)
    with pytest.raises(Exception) as info:
        (df.write.format("quiver").mode("append").option("path", str(d.socket))
         .option("job_id", "table").saveAsTable("quiver_table"))
    text = str(info.value)
    assert "saveAsTable (and CREATE TABLE ... AS SELECT" in text
    assert "CREATE TEMPORARY VIEW v USING quiver OPTIONS" in text
    with Client.connect(d.socket) as c:
        assert c.job_status("table")["state"] in ("unknown", "aborted")
    assert published(d, rows=0) is None
    spark.sql("DROP TABLE IF EXISTS quiver_table")
    d.stop()


def test_insert_into_a_create_table_is_refused_on_the_driver(spark: Any) -> None:
    # CREATE TABLE ... USING quiver keeps no options: INSERT INTO hands the writer none.
    spark.sql("CREATE TABLE quiver_created (id BIGINT) USING quiver")
    try:
        with pytest.raises(Exception) as info:
            spark.sql("INSERT INTO quiver_created VALUES (1), (2)").collect()
        text = str(info.value)
        assert "with no options at all is refused" in text
        assert "CREATE TEMPORARY VIEW ... USING quiver OPTIONS" in text
    finally:
        spark.sql("DROP TABLE IF EXISTS quiver_created")
