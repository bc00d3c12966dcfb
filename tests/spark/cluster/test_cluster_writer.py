"""``df.write.format("quiver")`` exactly once on a Spark standalone cluster: a master and
two workers as separate processes (conftest.py), a driver process of its own, real
daemons. A plain job; a real speculative copy overtaking a held first attempt; the same
with the original released to race its copy to the end; a worker killed with SIGKILL
mid-job (its executor and Python workers with it).

Every job writes ids 0..n-1 with h = 7 * id. Exactly once is checked twice: the lake's
registered files hold every bundle once (lake_helpers.assert_exactly_once) with those
ids as soon as save() has returned (read your writes: lake files keep the default 5 min
timer, so only the commit's rotation can have published them; with visible_timeout_s=0
the check fails), and subscriber x receives each id once. What Spark did (which attempt ran
where, which was speculative, why one ended) comes from its event log and from marks
each task attempt leaves; quiverd's side from the job's winners and the daemon's
discarded-bundle counter.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from quiverd.client import Client  # noqa: E402 - after the skip
from tests.daemon.lake_helpers import (  # noqa: E402
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
)
from tests.daemon.test_metrics import scrape  # noqa: E402
from tests.spark.cluster.conftest import Driver  # noqa: E402
from tests.spark.cluster.standalone import Cluster  # noqa: E402
from tests.spark.test_writer import DISCARDED, published, start  # noqa: E402

# One cluster and one driver for the module: 70-115 s in all on 2 cores at load 4-14
# (other sessions running), mostly JVMs starting (25-55 s) and the first job's (17-38 s).
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
# 20 000 rows a partition: half of one (160 KB) is past the 64 KiB buffers between
# pyspark's Python workers and the JVM, so a held attempt's first half reaches the daemon.
ROWS = 40_000
DAEMON = {**{k: v for k, v in FAST_LAKE.items() if k != "lake.file_duration_ms"},
          "lake.enabled": True, "segment.max_open_duration_ms": 50,
          "staging.poll_interval_ms": 100, "metrics.listen": "127.0.0.1:0"}


def check_exactly_once(d: Any, client: str, rows: int) -> None:
    """The lake's registered files hold ids 0..rows-1 once each (h = 7 * id) without
    waiting: save() returned only once the catalog held every row of the job (read your
    writes; lake files have the default 5 min timer here). Then subscriber x got them
    once each too."""
    sent = Counter({(client, 0): rows})
    files, tables = lake_contents(d)
    assert_exactly_once(files, tables, sent)
    check_ids(pa.concat_tables(t.select(["id", "h"]) for t in tables.values()), rows)
    got = published(d, rows=rows)
    assert got is not None, "nothing was published"
    check_ids(got, rows)


def check_ids(t: pa.Table, rows: int) -> None:
    assert t.num_rows == rows
    assert sorted(t["id"].to_pylist()) == list(range(rows))
    assert pc.all(pc.equal(t["h"], pc.multiply(t["id"], 7))).as_py()


def winners(d: Any, job_id: str) -> dict[int, int]:
    with Client.connect(d.socket) as c:
        status = c.job_status(job_id)
    assert status["state"] == "committed", status
    return {w["partition"]: w["attempt"] for w in status["winners"]}


def discarded_bundles(d: Any, ends: int, timeout_s: float = 30) -> int:
    """Bundles of losing attempts that subscriber x was never given: its discarded count
    (which includes every end marker) less the ``ends`` end markers of the job, once
    that count has settled."""
    [listening] = d.events("metrics_listening")
    deadline = time.monotonic() + timeout_s
    last, since = -1.0, time.monotonic()
    while True:
        count = scrape(listening["address"]).get(DISCARDED, {}).get((("subscriber", "x"),), 0)
        if count != last:
            last, since = count, time.monotonic()
        elif count >= ends and time.monotonic() - since > 1.0:
            return int(count) - ends
        assert time.monotonic() < deadline, f"{count} bundles discarded for x"
        time.sleep(0.2)


def write(driver: Driver, d: Any, job_id: str, **kw: Any) -> dict[str, Any]:
    reply = driver.call("write", socket=str(d.socket), client=job_id, job_id=job_id, **kw)
    assert "error" not in reply, f"{reply['error']}\n{reply['traceback']}\n{driver.logs()}"
    return reply


def test_cluster_writer_job_over_two_workers_lands_every_row_once(
        cluster: Cluster, cluster_driver: Driver, daemon_factory: Any) -> None:
    assert cluster_driver.call("executors")["hosts"] == cluster.hosts  # two hosts
    d = start(daemon_factory, **DAEMON)
    write(cluster_driver, d, "plain", rows=20_000, partitions=4)
    marks = cluster_driver.marks("plain")
    # Speculation is on for the application: on a busy machine a partition may get a copy.
    assert {m["partition"] for m in marks} == {0, 1, 2, 3}
    assert {m["host"] for m in marks} == set(cluster.hosts)  # both workers wrote
    assert sorted(winners(d, "plain")) == [0, 1, 2, 3]
    check_exactly_once(d, "plain", 20_000)
    assert d.stop() == 0


class Job(threading.Thread):
    """One ``write`` of ROWS rows in 2 partitions, running in the driver while the test
    watches and opens gates (``<gate>/go-<p>`` releases partition p's held attempt)."""

    def __init__(self, driver: Driver, d: Any, job_id: str, gate: Path,
                 hold: dict[int, float]) -> None:
        super().__init__(name=f"job-{job_id}")
        self.driver, self.gate = driver, gate
        self.request = {"socket": str(d.socket), "client": job_id, "job_id": job_id,
                        "rows": ROWS, "partitions": 2, "hold": hold, "gate": str(gate),
                        "hold_s": 90}
        self.reply: dict[str, Any] | None = None
        gate.mkdir()
        self.start()

    def run(self) -> None:
        self.reply = self.driver.call("write", timeout_s=240, **self.request)

    def open(self, name: str = "go") -> None:
        (self.gate / name).touch()

    def result(self) -> dict[str, Any]:
        self.join(240)
        assert self.reply is not None, f"no reply:\n{self.driver.logs()}"
        assert "error" not in self.reply, (f"{self.reply['error']}\n"
                                           f"{self.reply['traceback']}\n{self.driver.logs()}")
        return self.reply

    def close(self) -> None:
        """Release every held attempt and wait for the driver's reply (even on failure)."""
        self.open()
        self.join(240)


def held_then_staged(driver: Driver, d: Any, job_id: str) -> list[dict[str, Any]]:
    """Until both partitions' first attempts hold and the rows sent so far (one of them
    sends half, the other nothing yet) are staged in the daemon: their attempts."""
    held = wait_held(driver, job_id, 2)
    wait_staged(d, job_id)
    return held


def test_cluster_writer_speculative_copy_overtakes_a_slow_attempt_once(
        cluster_driver: Driver, daemon_factory: Any, tmp_path: Path) -> None:
    d = start(daemon_factory, **DAEMON)
    # Partition 0's original sends half its rows and holds for good (up to 90 s);
    # partition 1 holds before sending anything until those rows are staged, so that
    # the original has really written something when its copy overtakes it.
    job = Job(cluster_driver, d, "spec", tmp_path / "gate", hold={0: 0.5, 1: 0.0})
    try:
        held_then_staged(cluster_driver, d, "spec")
        job.open("go-1")  # partition 1 ends: Spark speculates partition 0 on the other host
        job.result()
    finally:
        job.close()
    marks = {m["task"]: m for m in cluster_driver.marks("spec")}
    tasks = cluster_driver.tasks(set(marks))
    [original] = [m for m in marks.values() if m["partition"] == 0 and m["held"]]
    copies = [t for t, m in marks.items() if m["partition"] == 0 and not m["held"]]
    assert copies, f"Spark placed no speculative copy: {cluster_driver.describe('spec')}"
    [copy] = copies
    assert tasks[copy]["speculative"] is True, tasks
    assert tasks[copy]["end"] == "Success", tasks
    assert tasks[copy]["host"] != tasks[original["task"]]["host"], tasks
    assert tasks[original["task"]]["speculative"] is False, tasks
    killed = cluster_driver.wait_ended(original["task"])
    # Spark kills the original: "another attempt succeeded", or, when the copy's success
    # ended the stage first, "Stage cancelled: Stage finished".
    assert killed["end"] == "TaskKilled", killed
    assert killed["kill"] in ("another attempt succeeded", "Stage cancelled: Stage finished")
    assert winners(d, "spec")[0] == copy  # quiverd published the copy's rows ...
    check_exactly_once(d, "spec", ROWS)
    # ... and discarded the original's staged half (2 end markers: the copy's, partition 1's).
    assert discarded_bundles(d, ends=2) > 0
    assert d.stop() == 0


def test_cluster_writer_original_racing_its_speculative_copy_lands_once(
        cluster_driver: Driver, daemon_factory: Any, tmp_path: Path) -> None:
    # As above, but the original is released the moment its copy starts: both run to the
    # end, whichever commits first wins; the other is killed, or (its end marker sent)
    # denied the commit.
    d = start(daemon_factory, **DAEMON)
    job = Job(cluster_driver, d, "race", tmp_path / "gate", hold={0: 0.5, 1: 0.0})
    try:
        held_then_staged(cluster_driver, d, "race")
        job.open("go-1")
        deadline = time.monotonic() + 90
        while not any(m["partition"] == 0 and not m["held"] for m in cluster_driver.marks("race")):
            assert job.is_alive(), f"no copy was placed: {cluster_driver.describe('race')}"
            assert time.monotonic() < deadline, cluster_driver.describe("race")
            time.sleep(0.05)
        job.open("go-0")
        job.result()
    finally:
        job.close()
    attempts = [m["task"] for m in cluster_driver.marks("race") if m["partition"] == 0]
    winner = winners(d, "race")[0]
    [loser] = [t for t in attempts if t != winner]
    assert cluster_driver.tasks({winner})[winner]["end"] == "Success"
    assert cluster_driver.wait_ended(loser)["end"] in ("TaskKilled", "TaskCommitDenied")
    check_exactly_once(d, "race", ROWS)
    assert d.stop() == 0


def test_cluster_writer_worker_killed_mid_job_lands_every_row_once(
        cluster: Cluster, cluster_driver: Driver, daemon_factory: Any, tmp_path: Path) -> None:
    d = start(daemon_factory, **DAEMON)
    # Partition 1's first attempt sends half its rows and holds; partition 0's holds
    # before sending anything, so the rows staged are the doomed attempt's.
    job = Job(cluster_driver, d, "kill", tmp_path / "gate", hold={0: 0.0, 1: 0.5})
    try:
        held = held_then_staged(cluster_driver, d, "kill")
        assert {m["host"] for m in held} == set(cluster.hosts), held
        [doomed] = [m for m in held if m["partition"] == 1]
        cluster.kill_worker(cluster.hosts.index(doomed["host"]))  # worker, executor, Python
        job.open()
        job.result()
    finally:
        job.close()  # the worker killed is restarted by the next test's cluster_driver
    retries = [m for m in cluster_driver.marks("kill")
               if m["partition"] == 1 and m["task"] != doomed["task"]]
    assert [m["host"] for m in retries] == [h for h in cluster.hosts if h != doomed["host"]]
    assert winners(d, "kill")[1] == retries[0]["task"] != doomed["task"]
    lost = cluster_driver.tasks({doomed["task"]})[doomed["task"]]
    assert lost["end"] == "ExecutorLostFailure", lost
    check_exactly_once(d, "kill", ROWS)
    # The doomed attempt's staged rows were dropped (2 end markers: both winners').
    assert discarded_bundles(d, ends=2) > 0
    assert d.stop() == 0


def wait_held(driver: Driver, job_id: str, n: int, timeout_s: float = 90) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        held = [m for m in driver.marks(job_id) if m["held"]]
        if len(held) >= n:
            return held
        assert time.monotonic() < deadline, f"{driver.describe(job_id)}\n{driver.logs()}"
        time.sleep(0.1)


def wait_staged(d: Any, job_id: str, timeout_s: float = 30) -> None:
    """Until the job has staged bundles and no more for a second (its attempts hold)."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    with Client.connect(d.socket) as c:
        while True:
            staged = c.job_status(job_id).get("staged_bundles", 0)
            if staged != last:
                last, since = staged, time.monotonic()
            elif staged > 0 and time.monotonic() - since > 1.0:
                return
            assert time.monotonic() < deadline, f"{staged} bundles of {job_id!r} staged"
            time.sleep(0.1)
