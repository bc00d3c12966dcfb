"""A Spark standalone cluster for tests: one master and N workers, each its own process
tree, started from the pyspark wheel's ``spark-class`` and killed as whole trees.

    master  127.0.0.1:P (web UI on Q: /json/ says which workers are ALIVE)
    worker1 127.0.0.2  --cores 1 --memory 1g, work dir <root>/worker1 ─▶ executor JVM
    worker2 127.0.0.3                                                    ─▶ python workers

Each worker binds its own loopback address (Linux routes all of 127/8 to ``lo``), so
Spark sees two hosts: a speculative copy of a task is never placed on a host that
already runs the task. Measured with both workers on 127.0.0.1: the original held for
30 s, its sibling partition long done, and no copy ran; with 127.0.0.2 and 127.0.0.3 the
copy starts within seconds on the other worker. Separate network namespaces are not
needed for that (Spark compares host names, and a Unix socket path reaches the daemon
from any of them).

Nothing here waits on a daemon's own stop script: a test may SIGKILL a worker's whole
tree (the worker JVM, its executor JVM and the executor's Python workers, which pyspark
puts in a process group of their own) to stand for a host that dies. Every process is
started with PR_SET_PDEATHSIG, so a test run killed outright leaves no JVM behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 90.0


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(argv: list[str], log: Path, env: Mapping[str, str], cwd: Path | None = None
          ) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=out, env=dict(env), cwd=cwd,
                                start_new_session=True, preexec_fn=_die_with_parent)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGKILL ``proc`` and everything it started (stopped first, so none forks again)."""
    if proc.poll() is not None:
        return
    tree = descendants(proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.wait(timeout_s)


class Cluster:
    """A master and ``workers`` workers under ``root``; ``start()``, then ``stop()``."""

    def __init__(self, root: Path, *, workers: int = 2, python: str) -> None:
        self.root = root
        self.home = spark_home()
        self.python = python
        self.port = free_port()
        self.ui_port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.hosts = [f"127.0.0.{i + 2}" for i in range(workers)]
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes] | None] = [None] * workers

    def env(self, local_ip: str) -> dict[str, str]:
        return {**os.environ, "SPARK_HOME": str(self.home), "SPARK_LOCAL_IP": local_ip,
                "PYSPARK_PYTHON": self.python, "PYSPARK_DRIVER_PYTHON": self.python,
                # No REST submission server on a fixed port (6066) and no update checks.
                "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}

    def start(self, *, wait: bool = True) -> Cluster:
        """Start the master and the workers; with ``wait``, until all are registered
        (without, a driver can start its JVM meanwhile: it waits for executors anyway)."""
        spark_class = str(self.home / "bin" / "spark-class")
        self.master = spawn([spark_class, "org.apache.spark.deploy.master.Master",
                             "--host", "127.0.0.1", "--port", str(self.port),
                             "--webui-port", str(self.ui_port)],
                            self.root / "master.log", self.env("127.0.0.1"))
        for i in range(len(self.workers)):
            self.start_worker(i, wait=False)
        if wait:
            self.wait_alive(len(self.workers))
        return self

    def start_worker(self, i: int, *, wait: bool = True) -> None:
        host = self.hosts[i]
        work = self.root / f"worker{i + 1}"
        work.mkdir(exist_ok=True)
        self.workers[i] = spawn(
            [str(self.home / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
             "--host", host, "--cores", "1", "--memory", "1g", "--work-dir", str(work),
             "--webui-port", "0", self.url],
            self.root / f"worker{i + 1}.log", self.env(host))
        if wait:
            self.wait_alive(sum(w is not None for w in self.workers))

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` with its executor and Python workers: a host gone."""
        proc = self.workers[i]
        assert proc is not None, f"worker {i} is not running"
        kill_tree(proc)
        self.workers[i] = None

    def state(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.ui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)  # type: ignore[no-any-return]

    def alive_hosts(self) -> list[str]:
        return sorted(w["host"] for w in self.state()["workers"] if w["state"] == "ALIVE")

    def wait_alive(self, n: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the master reports ``n`` live workers, one per running worker's host."""
        want = sorted(h for h, w in zip(self.hosts, self.workers, strict=True) if w)
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while time.monotonic() < deadline:
            for name, proc in [("master", self.master), *zip(self.hosts, self.workers,
                                                             strict=True)]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.logs()}")
            try:
                seen = self.alive_hosts()
            except OSError:
                seen = []  # the master's web UI is not up yet
            if len(seen) == n and seen == want:
                return
            time.sleep(0.25)
        raise RuntimeError(f"master reports {seen} alive, not {want}:\n{self.logs()}")

    def logs(self, tail: int = 2000) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in [*self.workers, self.master]:
            if proc is not None:
                kill_tree(proc)
        self.workers = [None] * len(self.workers)
        self.master = None
