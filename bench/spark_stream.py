"""Spark's streaming source against the push subscriber, on the same stored data.

    python bench/spark_stream.py [--mib 256] [--bundle-kib 64] [--repeat 1] [--json out.json]

One fresh daemon (2 shards, lake off, every other key at its default) with two
subscribers registered before anything is produced: ``bench-push`` and
``bench-spark``. Two clients (one per shard) send ``--mib`` MiB of ``--bundle-kib`` KiB
bundles (bench/_common.make_table: int64 + utf8); the bench waits until every bundle is
in a finalized segment. Then, per repeat, in this order:

    push    bench/e2e.py's subscriber loop (``quiverd.client.subscribe``, window 64,
            decode every delivery's tables, ack it) drains the backlog as
            ``bench-push``: the e2e subscriber's throughput, minus the producers.
    spark   ``spark.readStream.format("quiver")`` as ``bench-spark`` →
            ``writeStream.format("noop")`` with ``trigger(availableNow=True)`` on a
            local[2] session started beforehand and warmed by a small stream (not
            timed): from ``start()`` to the query's end, every row through Spark (the
            count is checked).
    ceiling a batch Python data source whose read() yields the same rows as
            ready-made RecordBatches from memory → ``write.format("noop")``: what Spark's
            Python data source path alone costs (no daemon, no decode), the most any
            Python source can reach on this machine.

Throughput = payload bytes / seconds. The ratio spark / push is the issue-19 target
(>= 0.8). A second repeat registers fresh subscribers (``-r1``) to read it all again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from quiverd.client import Client, subscribe
from quiverd.net.admin import request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Daemon, KiB, MiB, client_names, make_table  # noqa: E402

WINDOW = 64
WARM = 4  # bundles of client bench-warm, for the untimed warm-up stream


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    table, ipc = make_table(args.bundle_kib * KiB)
    count = max(2, args.mib * MiB // len(ipc))
    total_bytes = count * len(ipc)
    print(f"spark_stream: {count} bundles of {len(ipc) / KiB:.0f} KiB ({table.num_rows} rows),"
          f" {total_bytes / MiB:.0f} MiB, 2 shards, cpus {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="qss-", dir=args.dir))
    daemon = Daemon(root, policy=None, shards=2, settings={"lake.enabled": False})
    results: list[dict[str, Any]] = []
    try:
        names = [f"{n}-r{r}" for r in range(args.repeat) for n in ("bench-push", "bench-spark")]
        for name in [*names, "bench-warm"]:
            request(daemon.admin_socket, "subscribers.add", {"name": name, "start": "earliest"})
        _produce(daemon, table, count)
        with Client.connect(daemon.socket) as c:  # read by every subscriber, counted
            c.send_many([table] * WARM, client="bench-warm")
        count += WARM
        total_bytes = count * len(ipc)
        _wait_finalized(daemon, count)
        spark = _spark()
        _stream(spark, daemon, "bench-warm", client="bench-warm")  # warm-up, not timed
        for r in range(args.repeat):
            push_s = _push(daemon, f"bench-push-r{r}", count, table.num_rows)
            spark_s, rows, batches_s = _stream(spark, daemon, f"bench-spark-r{r}", report=True)
            if rows != count * table.num_rows:
                raise AssertionError(f"spark read {rows} rows, {count * table.num_rows} stored")
            ceiling_s = _ceiling(spark, count, args.bundle_kib * KiB)
            push_mb, spark_mb = total_bytes / MiB / push_s, total_bytes / MiB / spark_s
            ceiling_mb = total_bytes / MiB / ceiling_s
            running_mb = total_bytes / MiB / batches_s
            results.append({"repeat": r, "push_s": push_s, "spark_s": spark_s,
                            "spark_batches_s": batches_s, "ceiling_s": ceiling_s,
                            "push_mib_s": push_mb, "spark_mib_s": spark_mb,
                            "spark_running_mib_s": running_mb, "ceiling_mib_s": ceiling_mb,
                            "ratio": spark_mb / push_mb, "running_ratio": running_mb / push_mb})
            print(f"repeat {r}: push {push_mb:6.1f} MiB/s ({push_s:.2f} s)\n"
                  f"  spark   {spark_mb:6.1f} MiB/s ({spark_s:.2f} s, query start to end)   "
                  f"ratio {spark_mb / push_mb:.2f} (target >= 0.8)\n"
                  f"  spark   {running_mb:6.1f} MiB/s ({batches_s:.2f} s in micro-batches, "
                  f"the query running)   ratio {running_mb / push_mb:.2f}\n"
                  f"  ceiling {ceiling_mb:6.1f} MiB/s ({ceiling_s:.2f} s)   ceiling / push "
                  f"{ceiling_mb / push_mb:.2f}", flush=True)
        spark.stop()
    finally:
        daemon.stop()
        daemon.remove()
        root.rmdir()
    if args.json:
        Path(args.json).write_text(json.dumps({"bundles": count, "bundle_bytes": len(ipc),
                                               "results": results}, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="payload MiB stored (default 256)")
    p.add_argument("--bundle-kib", type=int, default=64, help="bundle size (default 64 KiB)")
    p.add_argument("--repeat", type=int, default=1, help="push + spark pairs (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the data directory goes (a real disk, not tmpfs)")
    return p


def _produce(daemon: Daemon, table: pa.Table, count: int) -> None:
    clients = client_names(2, 2, "ss")
    with Client.connect(daemon.socket) as c:
        for k, client in enumerate(clients):
            n = count // 2 + (count % 2 if k == 0 else 0)
            for _ in c.iter_send((table for _ in range(n)), client=client):
                pass


def _wait_finalized(daemon: Daemon, count: int) -> None:
    deadline = time.monotonic() + 120
    while sum(s["bundles"] for s in request(daemon.admin_socket, "segments")) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("bundles not finalized within 120 s")
        time.sleep(0.1)


def _push(daemon: Daemon, name: str, count: int, rows: int) -> float:
    """e2e's subscriber loop over the backlog: seconds from connect to the last ack."""
    seen: set[tuple[int, int, int]] = set()

    async def run() -> float:
        t0 = time.perf_counter()
        async with subscribe(daemon.socket, name, window=WINDOW) as deliveries:
            async for d in deliveries:
                got = sum(t.num_rows for t in d.tables.values())  # decode, as e2e does
                await d.ack()
                if got != rows:
                    raise AssertionError(f"bundle {d.id}: {got} rows, sent {rows}")
                seen.add(d.id)
                if len(seen) == count:
                    return time.perf_counter() - t0
        raise ConnectionError("quiverd closed the subscriber connection")

    return anyio.run(run, backend="asyncio", backend_options={"use_uvloop": True})


def _spark() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from quiverd.spark import register

    spark = (SparkSession.builder.master("local[2]").appName("bench-spark-stream")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    register(spark)
    spark.dataSource.register(_Memory)
    spark.range(1).count()  # the first job starts the Python workers: not timed
    _ceiling(spark, 16, 64 * KiB)  # warm-up, not timed
    return spark


def _stream(spark: Any, daemon: Daemon, name: str, *, client: str = "",
            report: bool = False) -> tuple[float, int, float]:
    """readStream → noop, Trigger.AvailableNow: seconds from start() to the end, rows,
    seconds inside its micro-batches (Spark's triggerExecution)."""
    t0 = time.perf_counter()
    reader = (spark.readStream.format("quiver").schema("id long, event string")
              .option("socket", str(daemon.socket)).option("subscriber", name))
    if client:
        reader = reader.option("client", client)
    q = reader.load().writeStream.format("noop").trigger(availableNow=True).start()
    q.awaitTermination()
    seconds = time.perf_counter() - t0
    if q.exception() is not None:
        raise RuntimeError(f"the streaming query failed: {q.exception()}")
    spent: dict[str, int] = {}
    for p in q.recentProgress:
        for k, v in p["durationMs"].items():
            spent[k] = spent.get(k, 0) + v
    if report:
        print(f"  spark: {len(q.recentProgress)} micro-batches, ms by step: {spent}",
              flush=True)
    return (seconds, sum(p["numInputRows"] for p in q.recentProgress),
            spent.get("triggerExecution", 0) / 1000)


class _Part(InputPartition):
    def __init__(self, bundles: int) -> None:
        self.bundles = bundles


class _MemoryReader(DataSourceReader):
    """The ceiling's reader: ``bundles`` ready-made RecordBatches per partition."""

    def __init__(self, count: int, bundle_bytes: int) -> None:
        self.count, self.bundle_bytes = count, bundle_bytes

    def partitions(self) -> list[_Part]:
        return [_Part(self.count // 2), _Part(self.count - self.count // 2)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Part)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import make_table

        batch = make_table(self.bundle_bytes)[0].combine_chunks().to_batches()[0]
        for _ in range(partition.bundles):
            yield batch


class _Memory(DataSource):
    @classmethod
    def name(cls) -> str:
        return "bench_memory"

    def schema(self) -> str:
        return "id long, event string"

    def reader(self, schema: Any) -> _MemoryReader:
        return _MemoryReader(int(self.options["count"]), int(self.options["bundle_bytes"]))


def _ceiling(spark: Any, count: int, bundle_bytes: int) -> float:
    """The same rows from memory through Spark's Python data source path → noop."""
    t0 = time.perf_counter()
    (spark.read.format("bench_memory").option("count", count)
     .option("bundle_bytes", bundle_bytes).load()
     .write.format("noop").mode("overwrite").save())
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
