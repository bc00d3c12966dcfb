"""spark.readStream.format("quiver") against a real daemon and a real local Spark.

The kill test runs the query in a child process (its own Spark), SIGKILLs it
mid-stream and restarts it from its checkpoint; the Parquet sink must then hold
every row exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.client.consumer import RangedReader
from quiverd.net.admin import request
from tests.daemon.helpers import tagged_table

FAST = {"shards": 2, "segment.max_open_duration_ms": 50}
ROWS = 10  # rows per bundle
SCHEMA = "tag long, i long, s string, _quiver_shard int, _quiver_bundle long"
ROOT = Path(__file__).resolve().parents[2]


def produce(d: Any, tags: range, client: str = "a") -> None:
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(t, rows=ROWS) for t in tags], client=client)


def finalized(d: Any) -> int:
    return sum(s["bundles"] for s in request(d.admin_socket, "segments"))


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def stream(spark: Any, d: Any, subscriber: str, **options: Any) -> Any:
    reader = (spark.readStream.format("quiver").schema(SCHEMA)
              .option("socket", str(d.socket)).option("subscriber", subscriber))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def rows_of(spark: Any, path: Path) -> list[tuple[int, int]]:
    """(tag, i) of every row the file sink committed (its _spark_metadata log)."""
    return [(r.tag, r.i) for r in spark.read.parquet(str(path)).select("tag", "i").collect()]


def expect(tags: range) -> list[tuple[int, int]]:
    return sorted((t, i) for t in tags for i in range(ROWS))


@pytest.mark.timeout(300)
def test_stream_client_filter_max_bundles_and_registration_on_first_use(spark, daemon_factory):
    d = daemon_factory(FAST).start()
    produce(d, range(12), client="a")
    produce(d, range(100, 106), client="b")
    wait_for(lambda: finalized(d) == 18, what="18 finalized bundles")
    assert "first-use" not in str(request(d.admin_socket, "subscribers.list"))
    q = (stream(spark, d, "first-use", client="b", maxBundlesPerTrigger=4)
         .writeStream.format("memory").queryName("stream_b")
         .trigger(availableNow=True).start())
    q.awaitTermination(60)
    assert q.exception() is None
    got = sorted((r.tag, r.i) for r in spark.table("stream_b").collect())
    assert got == expect(range(100, 106))  # client b only, every row once
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    # 18 bundles of both clients at most 4 per batch: 5 batches or more, each at most
    # 4 bundles (of b: 40 rows).
    assert len(sizes) >= 2 and max(sizes) <= 4 * ROWS and sum(sizes) == 6 * ROWS
    assert len(q.recentProgress) >= 5
    assert "first-use" in str(request(d.admin_socket, "subscribers.list"))
    with RangedReader.connect(d.socket) as r:  # what the query committed is acked
        start = r.open("first-use")["start"]
        assert r.latest("first-use", start)["bundles"] <= 4


def test_stream_unknown_or_missing_option_refused(spark, daemon_factory):
    d = daemon_factory(FAST).start()
    bad = stream(spark, d, "typo", maxBundlePerTrigger=5)
    with pytest.raises(Exception, match='unknown option "maxbundlepertrigger".*did you mean '
                                        '"maxbundlespertrigger"'):
        bad.writeStream.format("memory").queryName("typo").trigger(availableNow=True) \
            .start().awaitTermination(30)
    no_sub = (spark.readStream.format("quiver").schema(SCHEMA)
              .option("socket", str(d.socket)).load())
    with pytest.raises(Exception, match='option "subscriber" is required'):
        no_sub.writeStream.format("memory").queryName("nosub").trigger(availableNow=True) \
            .start().awaitTermination(30)


@pytest.mark.timeout(300)
def test_stream_daemon_restart_between_batches(spark, daemon_factory, tmp_path):
    d = daemon_factory(FAST).start()
    produce(d, range(10))
    wait_for(lambda: finalized(d) == 10, what="10 finalized bundles")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def run() -> None:
        q = (stream(spark, d, "restart").writeStream.format("parquet")
             .option("path", str(out)).option("checkpointLocation", str(ckpt))
             .trigger(availableNow=True).start())
        q.awaitTermination(60)
        assert q.exception() is None

    run()
    assert sorted(rows_of(spark, out)) == expect(range(10))
    d.stop()
    d.start()
    produce(d, range(10, 20))
    wait_for(lambda: finalized(d) >= 10, what="the new bundles finalized")
    run()
    assert sorted(rows_of(spark, out)) == expect(range(20))


@pytest.mark.timeout(600)  # two local Sparks in child processes, on a busy machine
def test_stream_killed_mid_stream_restarts_exactly_once(spark_installed, daemon_factory, tmp_path):
    d = daemon_factory(FAST).start()
    produce(d, range(60))
    wait_for(lambda: finalized(d) == 60, what="60 finalized bundles")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = [sys.executable, "-m", "tests.spark.stream_child", str(d.socket), "killed",
            str(ckpt), str(out)]
    child = subprocess.Popen([*args, "forever", "5"], cwd=ROOT)
    try:
        commits, offsets = ckpt / "commits", ckpt / "offsets"

        def mid_batch() -> bool:
            # Killed inside a micro-batch: its offsets are logged, its commit is not, so
            # the restart must re-run exactly that range.
            done = len(list(commits.glob("[0-9]*"))) if commits.exists() else 0
            planned = len(list(offsets.glob("[0-9]*"))) if offsets.exists() else 0
            return done >= 2 and planned > done

        wait_for(mid_batch, timeout=120, what="a micro-batch under way after 2 committed")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    done = len(list(commits.glob("[0-9]*")))
    assert done < 12, "the query finished before it was killed: nothing to resume"
    produce(d, range(60, 100))  # more while it is down
    wait_for(lambda: finalized(d) >= 40, what="the new bundles finalized")
    again = subprocess.run([*args, "available"], cwd=ROOT, timeout=400)
    assert again.returncode == 0
    # What the file sink committed, as the restarted child's Spark read it (rows_of).
    got = [tuple(row) for row in json.loads((tmp_path / "out.rows.json").read_text())]
    assert len(got) == len(set(got)), "a row was written twice"
    assert sorted(got) == expect(range(100))


def test_stream_without_schema_takes_the_clients_lake_schema(spark, daemon_factory):
    from tests.daemon.lake_helpers import FAST_LAKE, registered_rows

    d = daemon_factory({**FAST, **FAST_LAKE}).start()
    # Before the rows: once the lake has acked them, only a registered subscriber holds them.
    request(d.admin_socket, "subscribers.add", {"name": "no-schema", "start": "earliest"})
    produce(d, range(4), client="lk")
    wait_for(lambda: sum(r.row_count for r in registered_rows(d)) == 4 * ROWS,
             what="4 bundles in the lake")
    q = (spark.readStream.format("quiver").option("socket", str(d.socket))
         .option("subscriber", "no-schema").load("lk")  # load("<client>"): the client
         .writeStream.format("memory").queryName("no_schema")
         .trigger(availableNow=True).start())
    q.awaitTermination(60)
    assert q.exception() is None
    df = spark.table("no_schema")
    assert {"tag", "i", "s", "_quiver_shard", "_quiver_bundle"} <= set(df.columns)
    assert sorted((r.tag, r.i) for r in df.collect()) == expect(range(4))
    every = spark.readStream.format("quiver").option("socket", str(d.socket)) \
        .option("subscriber", "every")
    with pytest.raises(Exception, match="of every client has no one schema"):
        every.load()


MiB = 1 << 20
DROPPING = {  # tests/daemon/test_retention.py's small shard, dropping the oldest
    "shards": 1, "segment.max_open_duration_ms": 100, "segment.target_size_bytes": MiB,
    "ingest.max_bundle_bytes": MiB, "wal.max_entry_bytes": 2 * MiB, "wal.max_chunks": 4,
    "wal.max_size_bytes": 4 * MiB, "retention.size_cap_bytes": 6 * MiB,
    "retention.size_cap_policy": "drop_oldest",
}


@pytest.mark.timeout(300)
def test_stream_fails_naming_bundles_retention_dropped(spark, daemon_factory, tmp_path):
    d = daemon_factory(DROPPING).start()
    produce(d, range(4))
    wait_for(lambda: finalized(d) == 4, what="4 finalized bundles")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def run(**options: Any) -> Any:
        q = (stream(spark, d, "dropping", **options).writeStream.format("parquet")
             .option("path", str(out)).option("checkpointLocation", str(ckpt))
             .trigger(availableNow=True).start())
        try:
            q.awaitTermination(120)
        except Exception:  # noqa: BLE001 - q.exception() has it
            pass
        return q

    assert run().exception() is None
    assert sorted(rows_of(spark, out)) == expect(range(4))
    big = tagged_table(0, rows=4000, text_bytes=40)  # ~200 KB: 60 of them pass the 6 MiB cap
    with Client.connect(d.socket) as c:
        for _ in range(60):
            c.send(big, client="a")
    wait_for(lambda: d.status()["metrics"]["quiver_segment_dropped_total"] >= 2,
             what="drop_oldest deleting unread segments")
    failed = run().exception()
    assert failed is not None, "the query went on past bundles it never read"
    text = str(failed)
    assert "data lost" in text and "subscriber 'dropping'" in text and "shard 0 segment" in text
    assert 'failOnDataLoss", "false"' in text  # says how to go on
    # Told to go on: it reads what is left, past the gap, and says what it skipped.
    assert run(failOnDataLoss="false").exception() is None
    left = spark.read.parquet(str(out)).where("tag = 0 and i >= 10").count()
    assert 0 < left < 60 * 4000
    with RangedReader.connect(d.socket) as r:  # the checkpoint is past the gap
        assert r.latest("dropping", r.open("dropping")["start"])["lost"] == []


@pytest.mark.timeout(300)
def test_stream_second_query_on_one_subscriber_refused(spark, daemon_factory):
    d = daemon_factory(FAST).start()
    produce(d, range(4))
    wait_for(lambda: finalized(d) == 4, what="4 finalized bundles")
    first = (stream(spark, d, "shared").writeStream.format("memory").queryName("shared_1")
             .trigger(processingTime="200 milliseconds").start())
    try:
        wait_for(lambda: spark.table("shared_1").count() == 4 * ROWS, what="query 1's rows")
        second = (stream(spark, d, "shared").writeStream.format("memory")
                  .queryName("shared_2").trigger(availableNow=True).start())
        with pytest.raises(Exception, match="is read by another live query"):
            second.awaitTermination(60)
        assert second.exception() is not None
        assert ("subscriber 'shared' is read by another live query (query reader"
                in str(second.exception()))
        assert first.isActive and first.exception() is None
    finally:
        first.stop()
    # Stopped, its lease is given back: the subscriber can be read again at once.
    produce(d, range(4, 6))
    wait_for(lambda: finalized(d) == 6, what="6 finalized bundles")
    third = (stream(spark, d, "shared").writeStream.format("memory").queryName("shared_3")
             .trigger(availableNow=True).start())
    third.awaitTermination(60)
    assert third.exception() is None
    # A new checkpoint starts at the oldest unacked bundle: query 1's last batch is acked
    # only by its next commit, which never came (the module doc of stream.py).
    assert sorted((r.tag, r.i) for r in spark.table("shared_3").collect()) == expect(range(6))
