"""quiverd's Spark integration: ``spark.read.format("quiver")`` over the lake, and
``df.write.format("quiver")`` into a daemon, exactly once (SPEC §7).

    from quiverd.spark import register
    register(spark)
    df = spark.read.format("quiver").option("client", "web").load()
    df.write.format("quiver").option("path", socket).option("client", "web").save()

Importing this package does not import pyspark; ``register`` does, and raises an
ImportError naming ``pip install 'quiverd[spark]'`` when it is missing. The reader, its
options and its pruning are described in ``quiverd/spark/reader.py``, the writer (batch
and streaming) in ``quiverd/spark/writer.py``.
"""

from __future__ import annotations

from typing import Any

PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark: Any) -> None:
    """Register the ``quiver`` data source with ``spark`` (a SparkSession), and set the
    session's ``PUSHDOWN_CONF`` to true: Spark refuses a Python reader that implements
    ``pushFilters`` otherwise, and pruning is how a time-range or zone-map filter opens
    only the files it needs."""
    from quiverd.spark.reader import QuiverDataSource  # ImportError says what to install

    spark.conf.set(PUSHDOWN_CONF, "true")
    spark.dataSource.register(QuiverDataSource)
