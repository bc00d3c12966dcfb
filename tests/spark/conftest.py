"""One local Spark session for the whole run (it takes 5–9 s to start).

Skips, saying why, when pyspark or Java is missing (``scripts/setup`` installs both).
Workers run this interpreter (PYSPARK_PYTHON), which has quiverd and pyarrow.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark_installed() -> None:
    """Skips, saying why, unless pyspark and Java are here: for tests that run Spark in
    processes of their own and need no session (tests/xdist_groups.py SESSIONLESS)."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        pytest.skip("pyspark is not installed: pip install 'quiverd[spark]' (scripts/setup)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java: Spark needs Java 17+ (apt-get install openjdk-17-jre-headless)")


@pytest.fixture(scope="session")
def spark(spark_installed: None) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    # local[2,4]: up to 4 tries per task, as on a cluster (local[2] never retries a task,
    # whatever spark.task.maxFailures says): the writer's tests fail first attempts.
    session = (SparkSession.builder.master("local[2,4]").appName("quiverd-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.python.filterPushdown.enabled", "true")
               .config("spark.sql.shuffle.partitions", "2")
               .getOrCreate())
    from quiverd.spark import register

    register(session)
    try:
        yield session
    finally:
        session.stop()
