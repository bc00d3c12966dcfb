"""The demo's PySpark job: logs-like rows written with ``df.write.format("quiver")`` to a
running daemon, waited for in the lake, read back with ``spark.read.format("quiver")``.

    python scripts/demo_job.py --socket DATA_DIR/ingest.sock --config CONFIG [--rows N]

scripts/demo starts the daemon and runs this; bench/spark.py builds its DataFrame with
``logs_frame`` from here, so the demo and the benchmark write the same rows.

Exit 0 when every count agrees (rows written = rows the catalog registered = rows the
reader returns, ERROR rows read back = ERROR rows written, and the same content checksum
on both sides); 1 otherwise, or when the lake does not hold every row in time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

CLIENT = "weblogs"
LAKE_TIMEOUT_S = 120.0
POLL_S = 0.5
# 2026-01-01T00:00:00Z in µs; one row every ~150 µs from there.
START_US = 1_767_225_600_000_000
LEVELS = (("INFO", 70), ("DEBUG", 85), ("WARN", 95), ("ERROR", 99), ("FATAL", 100))
SERVICES = [f"{team}-{role}" for team in ("checkout", "payments", "search", "catalog",
                                          "auth", "cart", "orders", "shipping")
            for role in ("api", "worker", "gateway", "cron", "consumer")]
HOSTS = [f"ip-10-{i // 256}-{i % 256}-{i * 37 % 250}.eu-west-1.compute.internal"
         for i in range(240)]
VERBS = ["GET", "GET", "GET", "POST", "PUT", "DELETE"]
RESOURCES = ["items", "users", "orders", "carts", "search", "health", "sessions"]
STATUSES = [200, 200, 200, 200, 201, 204, 304, 400, 404, 500]
COLUMNS = ["ts", "host", "level", "service", "latency_ms", "message"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spark = session("quiverd-demo")
    try:
        return run(spark, args)
    finally:
        spark.stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, help="the daemon's ingest socket")
    p.add_argument("--config", required=True, help="the daemon's config.toml (catalog, store)")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--client", default=CLIENT)
    return p


def run(spark: Any, args: argparse.Namespace) -> int:
    from pyspark.sql import functions as F

    df = logs_frame(spark, args.rows)
    want_errors = df.where("level = 'ERROR'").count()
    _, want_sum = summary(df)

    t0 = time.perf_counter()
    (df.write.format("quiver").option("path", args.socket).option("client", args.client)
     .mode("append").save())
    print(f"spark job: wrote {args.rows} rows to {args.socket} as client {args.client!r} "
          f"in {time.perf_counter() - t0:.1f} s (committed: the daemon publishes them now)")

    t1 = time.perf_counter()
    registered = wait_for_lake(args.config, args.client, args.rows)
    print(f"lake: {registered} rows in registered Parquet files "
          f"{time.perf_counter() - t1:.1f} s after the commit")

    lake = (spark.read.format("quiver").option("config", args.config)
            .option("client", args.client).load())
    in_lake, got_sum = summary(lake)
    errors = lake.where("level = 'ERROR'")
    got_errors = errors.count()
    print(f"read back: {got_errors} ERROR rows, the first ones:")
    errors.select(*COLUMNS).orderBy("ts").show(5, truncate=60)
    lake.groupBy("level").agg(F.count("*").alias("rows"),
                              F.round(F.avg("latency_ms"), 1).alias("avg_latency_ms")
                              ).orderBy(F.desc("rows")).show()
    ok = in_lake == registered == args.rows and got_errors == want_errors \
        and got_sum == want_sum
    print(f"{'OK' if ok else 'MISMATCH'}: written {args.rows}, in lake {in_lake} (catalog "
          f"{registered}), errors {got_errors} (written {want_errors}), row checksum "
          f"{'equal' if got_sum == want_sum else 'DIFFERENT'}")
    return 0 if ok else 1


def session(name: str, **conf: str) -> Any:
    """A local[2] session as the project's field notes ask (UTC, no UI, this python for
    the workers) with the quiver data source registered."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import quiverd.spark

    builder = (SparkSession.builder.master("local[2]").appName(name)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    quiverd.spark.register(spark)
    return spark


def logs_frame(spark: Any, rows: int, partitions: int | None = None) -> Any:
    """``rows`` logs-like rows (ts timestamp UTC, host, level, service, latency_ms,
    message), a pure function of the row number: every action recomputes the same rows,
    so two writes of it do equal work without a cache. Levels: 70 % INFO, 15 % DEBUG,
    10 % WARN, 4 % ERROR, 1 % FATAL; latency log-uniform over 0.1 ms–10 s."""
    from pyspark.sql import functions as F

    def h(salt: int) -> Any:  # a non-negative hash of the row number, one per column
        return F.pmod(F.xxhash64("id", F.lit(salt)), F.lit(1 << 30))

    def pick(values: list[Any], salt: int) -> Any:
        choices = F.array(*[F.lit(v) for v in values])
        return F.element_at(choices, (h(salt) % len(values) + 1).cast("int"))

    percent = h(1) % 100
    level = F.when(percent < LEVELS[0][1], LEVELS[0][0])
    for name, upper in LEVELS[1:-1]:
        level = level.when(percent < upper, name)
    level = level.otherwise(LEVELS[-1][0])
    parts = partitions or spark.sparkContext.defaultParallelism
    return spark.range(0, rows, 1, parts).select(
        F.timestamp_micros(F.lit(START_US) + F.col("id") * 150 + h(2) % 150).alias("ts"),
        pick(HOSTS, 3).alias("host"),
        level.alias("level"),
        pick(SERVICES, 4).alias("service"),
        F.round(F.pow(F.lit(10.0), h(5) % 100_000 / 20_000.0 - 1), 3).alias("latency_ms"),
        F.format_string("%s /api/v%d/%s/%d status=%d bytes=%d ua=Mozilla/5.0",
                        pick(VERBS, 6), h(7) % 3 + 1, pick(RESOURCES, 8), h(9) % 10_000_000,
                        pick(STATUSES, 10), h(11) % 65536).alias("message"))


def summary(df: Any) -> tuple[int, int]:
    """Rows, and the sum of every row's hash over ``COLUMNS``: equal for the same
    multiset of rows (a lost, doubled or altered row changes it). One pass; the sum is a
    decimal, so it cannot overflow."""
    from pyspark.sql import functions as F

    rows, total = df.select(F.count("*"),
                            F.sum(F.xxhash64(*COLUMNS).cast("decimal(20,0)"))).first()
    return int(rows), int(total or 0)


def wait_for_lake(config: str, client: str, rows: int, timeout_s: float = LAKE_TIMEOUT_S
                  ) -> int:
    """Rows in the registered files of ``client`` (``quiverd files list --json``), once
    they reach ``rows``; raises after ``timeout_s`` or when the lake holds more."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = lake_rows(config, client)
        if got > rows:
            raise SystemExit(f"demo: the lake holds {got} rows of {client!r}, {rows} written")
        if got == rows:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: the lake holds {got} of {rows} rows after {timeout_s:.0f} s"
                             " (see the daemon log)")
        time.sleep(POLL_S)


def lake_rows(config: str, client: str) -> int:
    out = subprocess.run([sys.executable, "-m", "quiverd", "files", "list", "--config", config,
                          "--client", client, "--json"], capture_output=True, text=True,
                         check=True).stdout
    return sum(f["row_count"] for f in json.loads(out))


if __name__ == "__main__":
    sys.exit(main())
