"""``df.write.format("quiver")`` exactly once (SPEC §7): Spark in local mode writes into
real daemons; a subscriber sees what was published. The commit logic is also checked on
its own, without Spark or a daemon, first (the chunking and checksum, without pyspark, in
tests/sparkless/test_chunks.py)."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client, subscribe  # noqa: E402 - after the skip
from quiverd.kernel.errors import ConfigError  # noqa: E402
from quiverd.kernel.jobs import Winner  # noqa: E402
from quiverd.net.admin import request  # noqa: E402
from quiverd.spark.writer import (  # noqa: E402
    QuiverCommitMessage,
    QuiverWriter,
    WriteOptions,
    WriteRefused,
    query_id_of,
    winners_of,
)
from tests.daemon.lake_helpers import (  # noqa: E402
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
    wait_for_lake,
)
from tests.daemon.test_metrics import scrape, total  # noqa: E402

pytestmark = pytest.mark.timeout(300)
DISCARDED = "quiver_staged_bundles_discarded_total"
FAST = {"shards": 2, "segment.max_open_duration_ms": 50, "staging.poll_interval_ms": 100}


# --- without Spark or a daemon --------------------------------------------------------------

def message(partition: int, job_id: str = "j", **kw: Any) -> QuiverCommitMessage:
    fields = {"job_id": job_id, "partition": partition, "task_attempt_id": 10 + partition,
              "attempt_number": 0, "stage_id": 1, "rows": 5, "checksum": 7, "node_id": "n",
              "shard": 0, "sequence": 1, **kw}
    return QuiverCommitMessage(**fields)


def test_winners_of_raises_the_reason_of_a_refused_attempt() -> None:
    refused = message(1, refused="partition 1: a row of 9 bytes is too large")
    with pytest.raises(WriteRefused, match="job 'j' not written, nothing of it is published: "
                       "partition 1: a row of 9 bytes is too large$"):
        winners_of([message(0), refused], "j")


def test_winners_of_one_per_partition_and_refuses_a_missing_message() -> None:
    assert winners_of([message(0), message(1)], "j") == [
        Winner(partition=0, attempt=10, rows=5, checksum=7),
        Winner(partition=1, attempt=11, rows=5, checksum=7)]
    with pytest.raises(RuntimeError, match="partition 1 sent no commit message"):
        winners_of([message(0), None], "j")
    with pytest.raises(RuntimeError, match="wrote job 'other'"):
        winners_of([message(0, "other")], "j")


def test_options_defaults_paths_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUIVERD_SOCKET", raising=False)
    assert WriteOptions.parse({}) == WriteOptions(paths=("/var/lib/quiverd/ingest.sock",))
    monkeypatch.setenv("QUIVERD_SOCKET", "/run/q.sock")
    assert WriteOptions.parse({}).paths == ("/run/q.sock",)
    opts = WriteOptions.parse({"paths": "/a.sock, /b.sock", "PATH": "/x", "batch_rows": "10"})
    assert opts.paths == ("/a.sock", "/b.sock") and opts.batch_rows == 10
    assert [opts.path_for(p) for p in range(3)] == ["/a.sock", "/b.sock", "/a.sock"]
    with pytest.raises(ValueError, match='"client": client name .a b. must match'):
        WriteOptions.parse({"client": "a b"})
    with pytest.raises(ValueError, match='"batch_bytes" must be between 1024'):
        WriteOptions.parse({"batch_bytes": "10"})
    with pytest.raises(ConfigError, match="only appends"):
        QuiverWriter({}, overwrite=True)
    w1, w2 = QuiverWriter({}, overwrite=False), QuiverWriter({}, overwrite=False)
    assert len(w1.job_id) == 32 and w1.job_id != w2.job_id
    assert QuiverWriter({"job_id": "mine"}, overwrite=False).job_id == "mine"


def test_query_id_from_option_or_checkpoint_else_an_error_saying_what_to_set() -> None:
    assert query_id_of({"query_id": "q1"}) == "q1"
    by_ckpt = query_id_of({"checkpointLocation": "/ck/"})
    assert by_ckpt == query_id_of({"checkpointlocation": "/ck"}) != query_id_of(
        {"checkpointlocation": "/ck2"})
    with pytest.raises(ValueError, match='set option "query_id"'):
        query_id_of({})


# --- Spark into real daemons ------------------------------------------------------------------

def start(daemon_factory: Any, name: str = "d", **settings: Any) -> Any:
    d = daemon_factory({**FAST, **settings}, name=name).start()
    request(d.admin_socket, "subscribers.add", {"name": "x", "start": "earliest"})
    return d


def published(d: Any, *, rows: int, settle_s: float = 1.5, timeout_s: float = 120
              ) -> pa.Table | None:
    """Every row delivered to subscriber x: until ``rows`` came and then nothing more for
    ``settle_s`` (a duplicate would come in that time), or nothing at all for ``settle_s``
    when ``rows`` is 0."""
    tables: list[pa.Table] = []

    async def run() -> None:
        deadline = anyio.current_time() + timeout_s
        async with subscribe(d.socket, "x", window=64) as deliveries:
            while True:
                got = sum(t.num_rows for t in tables)
                wait = settle_s if got >= rows else deadline - anyio.current_time()
                with anyio.move_on_after(max(wait, 0.1)) as scope:
                    b = await anext(deliveries)
                if scope.cancelled_caught:
                    return
                tables.append(b.tables[0])
                await b.ack()

    anyio.run(run)
    return pa.concat_tables(tables) if tables else None


def wait_discarded(d: Any, timeout_s: float = 10) -> None:
    """Until the daemon (started with metrics.listen) has discarded a staged bundle."""
    [listening] = d.events("metrics_listening")
    deadline = time.monotonic() + timeout_s
    while total(scrape(listening["address"]), DISCARDED) == 0:
        assert time.monotonic() < deadline, "no staged bundle was discarded"
        time.sleep(0.2)


def hashed(spark: Any, rows: int, partitions: int) -> Any:
    from pyspark.sql import functions as F

    return spark.range(0, rows, 1, partitions).select(
        "id", F.pmod(F.xxhash64("id"), F.lit(1_000_003)).alias("h"))


def id_table(start: int, rows: int) -> pa.Table:
    ids = pa.array(range(start, start + rows), pa.int64())
    return pa.table({"id": ids, "h": pc.multiply(ids, 7)})


def sums(t: pa.Table) -> tuple[int, int, int]:
    return t.num_rows, pc.sum(t["h"]).as_py(), pc.count_distinct(t["id"]).as_py()


def write(df: Any, d: Any, **options: Any) -> None:
    w = df.write.format("quiver").mode("append").option("path", str(d.socket))
    for k, v in options.items():
        w = w.option(k, str(v))
    w.save()


def test_writer_one_million_rows_published_exactly_once(daemon_factory: Any, spark: Any
                                                        ) -> None:
    from pyspark.sql import functions as F

    # The lake on too: the uploader is a subscriber like x, and uploads exactly once.
    d = start(daemon_factory, **{**FAST_LAKE, "lake.enabled": True})
    df = hashed(spark, 1_000_000, 4)
    want = df.agg(F.count("*"), F.sum("h")).first()
    write(df, d, client="spark-1m", job_id="million")
    got = published(d, rows=1_000_000)
    assert got is not None and sums(got) == (want[0], want[1], 1_000_000)
    sent = Counter({("spark-1m", 0): 1_000_000})
    wait_for_lake(d, sent)
    rows, tables = lake_contents(d)
    assert_exactly_once(rows, tables, sent)
    uploaded = pa.concat_tables(t.select(["id", "h"]) for t in tables.values())
    assert sums(uploaded) == (want[0], want[1], 1_000_000)
    with Client.connect(d.socket) as c:
        status = c.job_status("million")
    assert status["state"] == "committed" and len(status["winners"]) == 4
    assert sum(w["rows"] for w in status["winners"]) == 1_000_000
    assert d.stop() == 0


def test_writer_first_attempt_fails_after_half_its_rows_then_retry_wins(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    d = start(daemon_factory, **{"metrics.listen": "127.0.0.1:0"})
    marks = tmp_path / "failed"
    marks.mkdir()

    def flaky(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        sent = 0
        for b in batches:
            yield b
            sent += b.num_rows
            if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and sent >= 2_000:
                (marks / str(ctx.taskAttemptId())).touch()
                time.sleep(1)  # let the writer send what it was given
                raise RuntimeError("injected failure half way through partition 0")

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
    try:
        df = hashed(spark, 8_000, 2)
        want = sums(df.toArrow())
        write(df.mapInArrow(flaky, df.schema), d, batch_rows=500, job_id="retry")
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    failed = [int(p.name) for p in marks.iterdir()]
    got = published(d, rows=8_000)
    assert got is not None and sums(got) == want
    with Client.connect(d.socket) as c:
        winners = {w["partition"]: w["attempt"] for w in c.job_status("retry")["winners"]}
    assert len(failed) == 1 and winners[0] != failed[0]
    wait_discarded(d)  # the failed attempt did send rows: staged, then discarded
    assert d.stop() == 0


def test_writer_task_failure_aborts_the_job_and_nothing_is_visible(
        daemon_factory: Any, spark: Any) -> None:
    d = start(daemon_factory, **{"metrics.listen": "127.0.0.1:0"})

    def last_fails(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        yield from batches
        if ctx.partitionId() == 2:
            time.sleep(0.5)  # the other partitions have ended theirs by now
            raise RuntimeError("injected failure in the last partition")

    df = hashed(spark, 3_000, 3)
    with pytest.raises(Exception, match="injected failure in the last partition"):
        write(df.mapInArrow(last_fails, df.schema), d, job_id="doomed")
    with Client.connect(d.socket) as c:
        status = c.job_status("doomed")
    assert status["state"] == "aborted"
    assert published(d, rows=0) is None
    wait_discarded(d)  # the partitions that ended had staged their rows
    assert d.stop() == 0


def marking(marks: Path) -> Any:
    """A mapInArrow function that leaves one file per task attempt it runs in."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        (marks / f"{ctx.partitionId()}-{ctx.attemptNumber()}").touch()
        yield from batches

    return run


def test_writer_reserved_column_is_refused_on_the_driver_before_any_task(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    d = start(daemon_factory)
    df = hashed(spark, 1_000, 2).withColumn("_quiver_ingested_at", F.lit("a string"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with pytest.raises(Exception) as info:
        write(df.mapInArrow(marking(tasks), df.schema), d, job_id="reserved")
    assert ("column '_quiver_ingested_at': the prefix '_quiver_' is reserved"
            in str(info.value))
    assert list(tasks.iterdir()) == []  # refused while planning: no task ran
    with Client.connect(d.socket) as c:
        assert c.job_status("reserved")["state"] == "unknown"  # nothing was sent
    assert published(d, rows=0) is None
    assert d.stop() == 0


def test_writer_row_over_max_bundle_bytes_fails_the_job_once_with_the_reason(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    d = start(daemon_factory, **{"ingest.max_bundle_bytes": 64 * 1024,
                                 "wal.max_entry_bytes": 256 * 1024,
                                 "metrics.listen": "127.0.0.1:0"})
    big = F.when(F.col("id") == 1_500, F.repeat(F.lit("y"), 100_000)).otherwise(F.lit("s"))
    df = hashed(spark, 2_000, 2).withColumn("s", big)  # the big row is in partition 1
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with pytest.raises(Exception) as info:
        write(df.mapInArrow(marking(tasks), df.schema), d, job_id="big-row")
    text = str(info.value)
    assert ("job 'big-row' not written, nothing of it is published: partition 1: a row of "
            in text)
    assert "larger than the daemon's ingest.max_bundle_bytes of 65536" in text
    assert sorted(p.name for p in tasks.iterdir()) == ["0-0", "1-0"]  # each task ran once
    with Client.connect(d.socket) as c:
        assert c.job_status("big-row")["state"] == "aborted"
    assert published(d, rows=0) is None
    wait_discarded(d)  # partition 0 and the rows of 1 before the big one were staged
    assert d.stop() == 0


def test_writer_job_id_already_decided_fails_once(daemon_factory: Any, spark: Any,
                                                   tmp_path: Path) -> None:
    d = start(daemon_factory)
    df = hashed(spark, 1_000, 2)
    write(df, d, job_id="once")
    assert published(d, rows=1_000) is not None
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with pytest.raises(Exception, match="job 'once' not written, nothing of it is published"):
        write(df.mapInArrow(marking(tasks), df.schema), d, job_id="once",
              if_committed="error")  # the default, "skip", makes this write a no-op
    assert sorted(p.name for p in tasks.iterdir()) == ["0-0", "1-0"]  # not retried
    assert published(d, rows=0) is None
    assert d.stop() == 0


def test_writer_streaming_replayed_micro_batch_is_published_once(
        daemon_factory: Any, spark: Any, tmp_path: Path) -> None:
    d = start(daemon_factory)
    source, checkpoint = tmp_path / "in", tmp_path / "ck"
    source.mkdir()
    pq.write_table(id_table(0, 500), source / "a.parquet")

    def run() -> None:
        df = spark.readStream.schema("id long, h long").parquet(str(source))
        q = (df.writeStream.format("quiver").option("path", str(d.socket))
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
        q.awaitTermination(120)

    run()
    first = published(d, rows=500)
    assert first is not None and sums(first) == sums(id_table(0, 500))
    # The query "crashed" after the commit but before Spark logged it: batch 0 is replayed.
    for name in ("0", ".0.crc"):
        (checkpoint / "commits" / name).unlink()
    run()
    assert (checkpoint / "commits" / "0").exists()  # the replay ran and was logged
    assert published(d, rows=0) is None  # ... and published nothing again
    pq.write_table(id_table(500, 800), source / "b.parquet")
    run()  # batch 1 goes through as usual
    second = published(d, rows=800)
    assert second is not None and sums(second) == sums(id_table(500, 800))
    assert d.stop() == 0
    shutil.rmtree(checkpoint, ignore_errors=True)


def test_writer_paths_spread_partitions_over_daemons_sharing_one_catalog(
        daemon_factory: Any, spark: Any, pg_catalog_dsn: str) -> None:
    # Two "hosts": each daemon takes the partitions p % 2 of its place in ``paths``; the
    # commit goes to the first, and the shared catalog carries it to the second.
    shared = {"catalog.dsn": pg_catalog_dsn, "lake.enabled": False}
    a, b = start(daemon_factory, "a", **shared), start(daemon_factory, "b", **shared)
    df = hashed(spark, 4_000, 4)
    want = sums(df.toArrow())
    w = df.write.format("quiver").mode("append").option("paths", f"{a.socket},{b.socket}")
    w.option("job_id", "spread").save()
    on_a, on_b = published(a, rows=2_000), published(b, rows=2_000)
    assert on_a is not None and on_b is not None
    assert sums(pa.concat_tables([on_a, on_b])) == want
    assert on_a.num_rows == on_b.num_rows == 2_000  # partitions 0, 2 on a; 1, 3 on b
    with Client.connect(b.socket) as c:
        assert c.job_status("spread")["state"] == "committed"
    for d in (a, b):
        assert d.stop() == 0
