"""``df.write.format("quiver")`` under faults: a speculative twin, the daemon killed
between the tasks' writes and the driver's commit, and the driver killed before it.

Spark's local mode never speculates (the speculation scheduler is not started for a
local master, and a copy may not run on its original's host), so the speculative twin
is made with the writer's test hook ``_fail_after_end``: partition 0's first attempt
completes, end marker durable, and then fails, so its commit message never reaches the
driver, which is what a speculative copy that lost the race looks like to quiverd.
``_commit_gate`` holds the driver's commit until the test let it go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from tests.daemon.test_subscribers import add, consume  # noqa: E402
from tests.spark.test_writer import wait_discarded  # noqa: E402

pytestmark = pytest.mark.timeout(300)
FAST = {"shards": 2, "segment.max_open_duration_ms": 50, "staging.poll_interval_ms": 100}


def ids_of(bundles: list[Any]) -> list[int]:
    return sorted(i for b in bundles for i in b.tables[0]["id"].to_pylist())


def frame(spark: Any, n: int, parts: int) -> Any:
    return spark.range(0, n, numPartitions=parts).selectExpr("id", "cast(id as string) as s")


def test_speculative_twin_of_a_partition_is_published_once(daemon_factory: Any,
                                                            spark: Any) -> None:
    d = daemon_factory({**FAST, "metrics.listen": "127.0.0.1:0"}).start()
    add(d, "x")
    (frame(spark, 4000, 2).write.format("quiver").option("path", str(d.socket))
     .option("client", "spec").option("_fail_after_end", "0:0").mode("append").save())
    got = consume(d, "x", want=10_000, idle_s=2.0)
    assert ids_of(got) == list(range(4000))  # the twin's 2000 rows were not published
    assert d.status()["staging"]["undecided_jobs"] == 0
    wait_discarded(d)  # the twin really sent its rows and its end marker
    assert d.stop() == 0


def test_daemon_killed_between_the_writes_and_the_commit(daemon_factory: Any, spark: Any,
                                                         tmp_path: Path) -> None:
    d = daemon_factory(FAST).start()
    add(d, "x")
    gate = tmp_path / "gate"
    gate.mkdir()
    killed: list[bool] = []

    def kill_at_the_gate() -> None:  # the job runs in the main thread (Spark's session)
        deadline = time.monotonic() + 120
        while not (gate / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if (gate / "ready").exists():
            d.kill()  # every task's rows are staged and acked; the commit not yet sent
            d.start()
            killed.append(True)
        (gate / "go").touch()

    killer = threading.Thread(target=kill_at_the_gate)
    killer.start()
    try:
        (frame(spark, 6000, 3).write.format("quiver").option("path", str(d.socket))
         .option("client", "k9").option("_commit_gate", str(gate)).mode("append").save())
    finally:
        (gate / "go").touch()
        killer.join(60)
    assert killed == [True]
    assert ids_of(consume(d, "x", want=10_000, idle_s=2.0)) == list(range(6000))
    assert d.stop() == 0


DRIVER = textwrap.dedent("""
    import os, sys
    from pyspark.sql import SparkSession
    from quiverd.spark import register
    socket_path, gate = sys.argv[1], sys.argv[2]
    spark = (SparkSession.builder.master("local[1]").appName("doomed-driver")
             .config("spark.ui.enabled", "false").getOrCreate())
    register(spark)
    (spark.range(0, 3000, numPartitions=3).selectExpr("id", "cast(id as string) as s")
     .write.format("quiver").option("path", socket_path).option("client", "doomed")
     .option("_commit_gate", gate).mode("append").save())
""")


def test_driver_killed_before_the_commit_leaves_nothing_visible_after_the_ttl(
        daemon_factory: Any, spark_installed: None, tmp_path: Path) -> None:
    d = daemon_factory({**FAST, "staging.ttl_s": 2}).start()
    add(d, "x")
    gate = tmp_path / "gate"
    gate.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    log = tmp_path / "driver.log"
    with open(log, "wb") as out:
        driver = subprocess.Popen([sys.executable, str(script), str(d.socket), str(gate)],
                                  env=env, start_new_session=True, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 120
        while not (gate / "ready").exists() and time.monotonic() < deadline:
            assert driver.poll() is None, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        assert (gate / "ready").exists()
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its JVM, mid-job
        driver.wait(30)
    with Client.connect(d.socket) as c:
        deadline = time.monotonic() + 30
        jobs = []
        while time.monotonic() < deadline:
            jobs = d.events("staged_job_expired")
            if jobs:
                break
            time.sleep(0.2)
        assert jobs, "the abandoned job never expired"
        assert c.job_status(jobs[0]["job_id"])["state"] == "expired"
    assert ids_of(consume(d, "x", want=10_000, idle_s=1.5)) == []
    assert d.stop() == 0
