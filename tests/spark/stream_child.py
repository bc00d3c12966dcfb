"""A streaming query in its own process (its own local Spark), for kill tests.

    python -m tests.spark.stream_child SOCKET SUBSCRIBER CHECKPOINT OUT MODE [MAX_BUNDLES [FROM]]

MODE ``forever``: processing-time trigger, runs until killed; ``available``:
Trigger.AvailableNow, exits 0 once it caught up, after writing ``OUT.rows.json``: the
(tag, i) of every row the file sink committed, read back by this Spark through the
sink's _spark_metadata log (so the test needs no Spark session of its own and runs
beside the Spark group, tests/xdist_groups.py). quiver → Parquet (Spark's file sink).
MAX_BUNDLES "" is no limit; FROM is the source's option ``from`` (default: not given).
"""

from __future__ import annotations

import json
import os
import sys

SCHEMA = "tag long, i long, s string, _quiver_shard int, _quiver_bundle long"


def main(argv: list[str]) -> int:
    socket, subscriber, checkpoint, out, mode = argv[:5]
    max_bundles = argv[5] if len(argv) > 5 else ""
    start = argv[6] if len(argv) > 6 else ""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    from quiverd.spark import register

    spark = (SparkSession.builder.master("local[2]").appName("quiver-stream-child")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    register(spark)
    reader = (spark.readStream.format("quiver").schema(SCHEMA)
              .option("socket", socket).option("subscriber", subscriber))
    if max_bundles:
        reader = reader.option("maxBundlesPerTrigger", max_bundles)
    if start:
        reader = reader.option("from", start)
    writer = (reader.load().writeStream.format("parquet")
              .option("checkpointLocation", checkpoint).option("path", out))
    if mode == "available":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="100 milliseconds")
    query = writer.start()
    print("started", flush=True)
    query.awaitTermination()
    if mode == "available":
        rows = [[r.tag, r.i] for r in spark.read.parquet(out).select("tag", "i").collect()]
        with open(out + ".rows.json", "w") as f:
            json.dump(rows, f)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
