"""The lake on a full filesystem, for real (a small tmpfs, root only): the SQLite
catalog's filesystem fills up, the daemon keeps ingesting with the lake degraded,
restarts while it is still full, and the lake catches up once space is back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.lake_helpers import (
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
    send_logs,
    wait_degraded,
    wait_for_lake,
)
from tests.daemon.mounts import MiB, fill, mounted_tmpfs

pytestmark = pytest.mark.timeout(240)


def test_lake_sqlite_catalog_fs_full_ingest_goes_on_restart_then_catches_up(
        daemon_factory: Any, short_dir: Path) -> None:
    with mounted_tmpfs(short_dir / "catfs", 8 * MiB) as fs:
        d = daemon_factory({**FAST_LAKE}, in_process=True)
        d.data_dir.mkdir()
        (d.data_dir / "catalog.sqlite").symlink_to(fs / "catalog.sqlite")
        d.start()
        sent = send_logs(d, clients=2, batches=2)
        wait_for_lake(d, sent)
        ballast = fs / "ballast"
        fill(ballast)
        sent.update(send_logs(d, clients=2, batches=4, start=2))  # acked meanwhile
        lake = wait_degraded(d, "catalog")
        assert lake["degraded"]["catalog"]["kind"] == "unavailable"
        time.sleep(2)
        assert d.running, d.log()[-3000:]
        assert d.stop() == 0, d.log()[-3000:]
        d.start()  # still full: starts, logs, ingests
        assert d.events("quiverd_ready")
        sent.update(send_logs(d, clients=1, batches=2, start=6))
        wait_degraded(d, "catalog")
        time.sleep(2)
        assert d.running, d.log()[-3000:]
        ballast.unlink()
        wait_for_lake(d, sent, timeout=120)
        rows, tables = lake_contents(d)
        assert_exactly_once(rows, tables, sent)
        assert d.stop() == 0


def test_lake_staging_fs_full_degraded_ingest_goes_on_then_catches_up(
        daemon_factory: Any, short_dir: Path) -> None:
    d = daemon_factory({**FAST_LAKE}, in_process=True)
    with mounted_tmpfs(d.data_dir / "staging", 4 * MiB) as fs:
        d.start()
        sent = send_logs(d, clients=2, batches=2)
        wait_for_lake(d, sent)
        deadline = time.monotonic() + 20  # evictions free space: let them finish first
        while any((fs / "stable").iterdir()) or any((fs / "active").iterdir()):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ballast = fs / "ballast"
        fill(ballast)
        sent.update(send_logs(d, clients=2, batches=4, start=2))
        lake = wait_degraded(d, "staging")
        assert lake["degraded"]["staging"]["kind"] == "no_space", lake
        assert d.events("lake_file_failed")
        assert d.running
        ballast.unlink()
        wait_for_lake(d, sent, timeout=120)
        rows, tables = lake_contents(d)
        assert_exactly_once(rows, tables, sent)
        deadline = time.monotonic() + 20
        while d.status()["lake"]["degraded"]:
            assert time.monotonic() < deadline, d.status()["lake"]
            time.sleep(0.2)
        assert d.stop() == 0
