"""A Spark driver on the standalone cluster, in a process of its own, serving the tests.

    python driver.py MASTER_URL ADDRESS EVENT_LOG_DIR MARKS_DIR

The test process holds the suite's one local SparkSession; this process holds the
cluster's (one application, its executors kept across jobs: starting a driver and two
executor JVMs costs 10-20 s). It waits until both workers have given it an executor,
listens on the Unix socket ADDRESS (``multiprocessing.connection``, authkey
``AUTHKEY``), and answers one request at a time:

    {"op": "executors"}                      → {"hosts": [...]}  (the driver's excluded)
    {"op": "sync"}                           → {}: runs a one-task job, so that the event
                                               log is flushed (at stage and job ends) with
                                               every task end Spark has heard of so far
    {"op": "write", "socket", "client", "job_id", "rows", "partitions",
     "hold": {partition: fraction}, "gate": dir, "hold_s": s}
                                             → {"seconds": s} or {"error": "..."}

``write`` saves ids 0..rows-1 with ``h = 7 * id`` through ``df.write.format("quiver")``
in ``partitions`` partitions. Every task attempt leaves ``MARKS_DIR/<job>.<task attempt
id>.json`` (partition, attempt number, task attempt id, host, "held"). The first attempt
to run of each partition p in ``hold`` (the first to leave a mark: a retry or a
speculative copy is never held) sends ``hold[p]`` of its batches, marks itself held,
and waits until ``<gate>/go`` or ``<gate>/go-<p>`` exists (at most ``hold_s``) before
sending the rest: meanwhile a test kills its worker, or lets a speculative copy overtake
it.

Spark's event log (uncompressed, one file) is in EVENT_LOG_DIR: tests read task
attempts, their hosts and the speculative flag from it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import pyarrow as pa

AUTHKEY = b"quiverd-cluster-tests"
EXECUTORS = 2
BATCH_ROWS = 500


def main() -> None:
    from pyspark.sql import SparkSession

    from quiverd.spark import register

    master, address, events, marks = sys.argv[1:5]
    spark = (SparkSession.builder.master(master).appName("quiverd-cluster-tests")
             .config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.executor.memory", "512m")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(BATCH_ROWS))
             .config("spark.task.maxFailures", "4")
             # Real speculation: a task running 1.5x the median of its finished peers (and
             # over 1 s) gets a copy on another host. The efficiency check is off: a held
             # task has processed its rows at a fine rate, it just stopped.
             .config("spark.speculation", "true")
             .config("spark.speculation.interval", "100ms")
             .config("spark.speculation.multiplier", "1.5")
             .config("spark.speculation.quantile", "0.5")
             .config("spark.speculation.minTaskRuntime", "1s")
             .config("spark.speculation.efficiency.enabled", "false")
             .config("spark.eventLog.enabled", "true")
             .config("spark.eventLog.dir", events)
             .config("spark.eventLog.compress", "false")
             .config("spark.eventLog.rolling.enabled", "false")
             .getOrCreate())
    register(spark)
    deadline = time.monotonic() + 120
    while len(executor_hosts(spark)) < EXECUTORS:
        if time.monotonic() > deadline:
            raise SystemExit(f"only executors on {executor_hosts(spark)} after 120 s")
        time.sleep(0.2)
    ops: dict[str, Callable[..., dict[str, Any]]] = {
        "executors": lambda: {"hosts": executor_hosts(spark)},
        "sync": lambda: sync(spark),
        "write": lambda **kw: write(spark, Path(marks), **kw),
    }
    with Listener(address, family="AF_UNIX", authkey=AUTHKEY) as listener:
        with listener.accept() as conn:
            conn.send({"app_id": spark.sparkContext.applicationId})
            while True:
                try:
                    request = conn.recv()
                except EOFError:
                    break
                try:
                    reply = ops[request.pop("op")](**request)
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
                flush_event_log(spark)
                conn.send(reply)
    spark.stop()


def executor_hosts(spark: Any) -> list[str]:
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    hosts = [info.host() for info in infos]
    hosts.remove(spark.sparkContext.getConf().get("spark.driver.host"))
    return sorted(hosts)


def flush_event_log(spark: Any) -> None:
    """Let the listener bus deliver what happened so far (the event log writer flushes at
    each stage and job end)."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty(10_000)


def sync(spark: Any) -> dict[str, Any]:
    flush_event_log(spark)
    spark.sparkContext.parallelize([0], 1).count()
    return {}


def write(spark: Any, marks: Path, *, socket: str, client: str, job_id: str, rows: int,
          partitions: int, hold: dict[int, float] | None = None, gate: str = "",
          hold_s: float = 60.0) -> dict[str, Any]:
    from pyspark.sql import functions as F

    df = spark.range(0, rows, 1, partitions).select("id", (F.col("id") * 7).alias("h"))
    run = attempts(marks, job_id, hold or {}, Path(gate) if gate else marks / "no-gate", hold_s)
    started = time.monotonic()
    (df.mapInArrow(run, df.schema).write.format("quiver").mode("append")
     .option("path", socket).option("client", client).option("job_id", job_id)
     .option("batch_rows", str(BATCH_ROWS)).save())
    return {"seconds": round(time.monotonic() - started, 2)}


def attempts(marks: Path, job_id: str, hold: dict[int, float], gate: Path, hold_s: float
             ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The mapInArrow function in front of the writer: marks and maybe holds an attempt."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        p = ctx.partitionId()
        first = not any(json.loads(m.read_text())["partition"] == p
                        for m in marks.glob(f"{job_id}.*.json"))
        mark = {"partition": p, "attempt": ctx.attemptNumber(), "task": ctx.taskAttemptId(),
                "host": os.environ.get("SPARK_LOCAL_IP", "?"), "held": False}
        path = marks / f"{job_id}.{ctx.taskAttemptId()}.json"
        write_mark(path, mark)
        if not first or p not in hold:
            yield from batches
            return
        whole = list(batches)
        cut = int(len(whole) * hold[p])
        yield from whole[:cut]
        write_mark(path, {**mark, "held": True})
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            if (gate / "go").exists() or (gate / f"go-{p}").exists():
                break
            time.sleep(0.05)
        yield from whole[cut:]

    return run


def write_mark(path: Path, mark: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(mark))
    tmp.rename(path)


if __name__ == "__main__":
    main()
