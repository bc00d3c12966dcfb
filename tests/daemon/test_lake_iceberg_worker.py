"""The projection's worker process ends with its daemon: kill -9 the daemon while the
worker is stuck in a call (the Iceberg catalog's table locked in PostgreSQL), and the
worker must be gone within about a second, not when its call returns."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from tests.daemon.iceberg_helpers import wait_projected
from tests.daemon.lake_helpers import FAST_LAKE, send_logs, wait_for_lake

pytestmark = pytest.mark.timeout(180)
GONE_WITHIN_S = 2.0


def test_iceberg_worker_dies_with_a_killed_daemon(daemon_factory: Any,
                                                  pg_catalog_dsn: str) -> None:
    d = daemon_factory({**FAST_LAKE, "catalog.dsn": pg_catalog_dsn,
                        "lake.iceberg.enabled": True, "lake.iceberg.reconcile_interval_s": 0.5,
                        "lake.iceberg.linger_ms": 20}).start()
    assert d.proc is not None
    sent = send_logs(d, clients=1, batches=2, two_slots_every=0)
    wait_for_lake(d, sent)
    wait_projected(d)
    [worker] = _workers(d.proc.pid)
    lock = psycopg2.connect(pg_catalog_dsn)
    try:
        with lock.cursor() as cur:  # every read and commit of the worker now waits
            cur.execute("LOCK TABLE iceberg_tables IN ACCESS EXCLUSIVE MODE")
            _wait_for_a_blocked_query(cur)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _alive(worker):
            assert time.monotonic() < deadline, (
                f"the projection's worker {worker} outlived its killed daemon by "
                f"{GONE_WITHIN_S} s")
            time.sleep(0.05)
    finally:
        lock.rollback()
        lock.close()


def _workers(parent: int) -> list[int]:
    """Pids of ``parent``'s anyio process workers (``python -u -m anyio.to_process``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"anyio.to_process" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for_a_blocked_query(cur: Any, timeout_s: float = 30) -> None:
    """Until another session waits on a lock (the worker's next read or commit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND pid <> pg_backend_pid()")
        if cur.fetchone()[0]:
            return
        time.sleep(0.1)
    raise AssertionError("the worker never touched the locked table")

