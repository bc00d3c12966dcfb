"""A Spark standalone cluster (a master and two workers, separate processes) and one
driver process on it, started once per module and killed at its end, even on failure.

The test process keeps the suite's rule of one SparkSession per run (tests/spark's
local one): jobs on the cluster run in the child driver (``driver.py``), which the tests
ask over a Unix socket. Skips, saying why, when pyspark or Java is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Client as Connect
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from tests.spark.cluster.standalone import Cluster, kill_tree, spawn

DRIVER = Path(__file__).with_name("driver.py")
DRIVER_START_S = 180.0
AUTHKEY = b"quiverd-cluster-tests"  # driver.AUTHKEY


def require_spark() -> None:
    try:
        import pyspark
    except ImportError:
        pytest.skip("pyspark is not installed: pip install 'quiverd[spark]' (scripts/setup)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java: Spark needs Java 17+ (apt-get install openjdk-17-jre-headless)")
    if not (Path(pyspark.__file__).parent / "bin" / "spark-class").exists():
        pytest.skip("this pyspark has no bin/spark-class to start a standalone cluster")


class Driver:
    """The child driver process and its connection; ``call`` sends one request."""

    def __init__(self, root: Path, cluster: Cluster) -> None:
        self.root = root
        self.cluster = cluster
        self.events_dir = root / "events"
        self.marks_dir = root / "marks"
        self.events_dir.mkdir()
        self.marks_dir.mkdir()
        self.address = str(root / "driver.sock")
        self.log = root / "driver.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.app_id = ""

    def start(self) -> Driver:
        env = self.cluster.env("127.0.0.1")
        self.proc = spawn([sys.executable, str(DRIVER), self.cluster.url, self.address,
                           str(self.events_dir), str(self.marks_dir)], self.log, env)
        deadline = time.monotonic() + DRIVER_START_S
        while not Path(self.address).exists():
            self._check_alive()
            assert time.monotonic() < deadline, f"driver not up:\n{self.logs()}"
            time.sleep(0.2)
        self.conn = Connect(self.address, family="AF_UNIX", authkey=AUTHKEY)
        self.app_id = self._recv(60)["app_id"]
        return self

    def call(self, op: str, *, timeout_s: float = 120, **args: Any) -> dict[str, Any]:
        assert self.conn is not None
        self.conn.send({"op": op, **args})
        return self._recv(timeout_s)

    def wait_executors(self, hosts: list[str], timeout_s: float = 120) -> None:
        """Until the application has an executor on each of ``hosts``."""
        deadline = time.monotonic() + timeout_s
        while (got := self.call("executors")["hosts"]) != sorted(hosts):
            assert time.monotonic() < deadline, f"executors on {got}:\n{self.logs()}"
            time.sleep(0.5)

    def _recv(self, timeout_s: float) -> dict[str, Any]:
        assert self.conn is not None
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            self._check_alive()
            assert time.monotonic() < deadline, f"no reply in {timeout_s} s:\n{self.logs()}"
        reply: dict[str, Any] = self.conn.recv()
        return reply

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"driver exited {self.proc.returncode}:\n{self.logs()}")

    def logs(self, tail: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- driver.log\n{text[-tail:]}\n{self.cluster.logs()}"

    def marks(self, job_id: str) -> list[dict[str, Any]]:
        """Every task attempt of ``job_id`` that started, by task attempt id."""
        return sorted((json.loads(p.read_text()) for p in self.marks_dir.glob(f"{job_id}.*.json")),
                      key=lambda m: m["task"])

    def events(self) -> list[dict[str, Any]]:
        """Spark's event log of the driver's application so far."""
        [path] = self.events_dir.glob(f"{self.app_id}*")
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line the writer has not finished
        return out

    def tasks(self, task_ids: set[int]) -> dict[int, dict[str, Any]]:
        """Task id → {"host", "speculative", "index", "end": reason or None, "kill": why}."""
        out: dict[int, dict[str, Any]] = {}
        for e in self.events():
            if e["Event"] not in ("SparkListenerTaskStart", "SparkListenerTaskEnd"):
                continue
            info = e["Task Info"]
            if info["Task ID"] not in task_ids:
                continue
            task = out.setdefault(info["Task ID"], {"end": None})
            task.update(host=info["Host"], speculative=info["Speculative"],
                        index=info["Index"])
            if e["Event"] == "SparkListenerTaskEnd":
                task["end"] = e["Task End Reason"]["Reason"]
                task["kill"] = e["Task End Reason"].get("Kill Reason")
        return out

    def describe(self, job_id: str) -> str:
        """The job's attempts (marks) and every task end that was not a success: for
        failure messages."""
        ends = [(e["Task Info"]["Task ID"], e["Task Info"]["Index"], e["Task Info"]["Host"],
                 e["Task End Reason"]) for e in self.events()
                if e["Event"] == "SparkListenerTaskEnd"
                and e["Task End Reason"]["Reason"] != "Success"]
        return f"attempts of {job_id!r}: {self.marks(job_id)}\nunsuccessful task ends: {ends}"

    def wait_ended(self, task_id: int, timeout_s: float = 60) -> dict[str, Any]:
        """The task, once Spark's event log has its end."""
        deadline = time.monotonic() + timeout_s
        while (task := self.tasks({task_id}).get(task_id, {})).get("end") is None:
            assert time.monotonic() < deadline, f"task {task_id} never ended: {task}"
            self.call("sync")
            time.sleep(0.5)
        return task

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the driver stops its session at end of stream
        if self.proc is not None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
            kill_tree(self.proc)


@pytest.fixture(scope="module")
def cluster_root() -> Iterator[Path]:
    """Logs, work dirs, event log and marks; QUIVERD_KEEP_CLUSTER=1 keeps them."""
    root = Path(tempfile.mkdtemp(prefix="qc", dir="/tmp"))  # short: Unix socket paths
    try:
        yield root
    finally:
        if os.environ.get("QUIVERD_KEEP_CLUSTER") != "1":
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(cluster_root: Path) -> Iterator[Cluster]:
    require_spark()
    c = Cluster(cluster_root, workers=2, python=sys.executable)
    try:
        yield c.start(wait=False)  # cluster_app waits, starting its driver meanwhile
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster_app(cluster: Cluster, cluster_root: Path) -> Iterator[Driver]:
    d = Driver(cluster_root, cluster)
    try:
        d.start()  # up once it has an executor on each worker
        cluster.wait_alive(len(cluster.workers))
        yield d
    finally:
        d.stop()


@pytest.fixture
def cluster_driver(cluster: Cluster, cluster_app: Driver) -> Driver:
    """The driver, with every worker up and an executor on each: a test before may have
    killed one (restarting it here costs that test nothing when it ran last)."""
    for i, proc in enumerate(cluster.workers):
        if proc is None:
            cluster.start_worker(i)
    cluster_app.wait_executors(cluster.hosts)
    return cluster_app
