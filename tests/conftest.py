"""Shared fixtures: a real quiverd daemon as a subprocess, on real files and sockets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quiverd.net.admin import request
from tests.tiers import TIER_ENV, tier

START_TIMEOUT_S = 20.0
ICEBERG_OFF = "lake.iceberg.enabled"  # written False unless a test's settings say True

# Real services for the storage tier, started once per run and stopped at its end:
# PostgreSQL (initdb/pg_ctl under runuser) and moto's S3 server on loopback.
pytest_plugins = ["tests.services.postgres", "tests.services.s3", "tests.xdist_groups"]


class DaemonProcess:
    """One `quiverd serve` subprocess with its config, sockets and log."""

    in_process = False  # tests/inprocess.py's InProcessDaemon: serve on a thread

    def __init__(self, root: Path, settings: dict[str, Any], env: dict[str, str]) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.config_path = root / "config.toml"
        self.log_path = root / "daemon.log"
        self.settings = settings
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._write_config()

    @property
    def socket(self) -> Path:
        return self.root / "in.sock"

    @property
    def admin_socket(self) -> Path:
        return self.root / "adm.sock"

    def _write_config(self) -> None:
        lines = [f'data_dir = "{self.data_dir}"']
        sections: dict[str, dict[str, Any]] = {}
        # The Iceberg projection (on by default) starts a worker process, about a
        # CPU-second, in every daemon that registers a file; only the tests that say
        # so run it (tests/daemon/test_lake_iceberg*.py, the lake's defaults test, the
        # open-lake Spark test), which keeps the suite minutes shorter.
        for key, value in {ICEBERG_OFF: False, **self.settings}.items():
            if "." in key:
                section, name = key.split(".", 1)
                sections.setdefault(section, {})[name] = value
            else:
                lines.append(f"{key} = {_toml(value)}")
        sections.setdefault("ingest", {}).setdefault("socket_path", str(self.socket))
        sections.setdefault("admin", {}).setdefault("socket_path", str(self.admin_socket))
        sections.setdefault("log", {}).setdefault("format", "json")
        for section, values in sections.items():
            lines.append(f"[{section}]")
            lines.extend(f"{k} = {_toml(v)}" for k, v in values.items())
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self, *, faults: str = "", wait: bool = True) -> DaemonProcess:
        env = {**os.environ, **self.env}
        if faults:
            env["QUIVERD_FAULTS"] = faults
        else:
            env.pop("QUIVERD_FAULTS", None)
        self.socket.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quiverd", "serve", "--config", str(self.config_path)],
            stdout=log, stderr=log, env=env)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def exited(self) -> int | None:
        """The exit code if the daemon has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (code := self.exited()) is not None:
                raise AssertionError(f"daemon exited {code}:\n{self.log()[-3000:]}")
            if self.socket.exists() and self.admin_socket.exists():
                try:
                    self.status()
                    return
                except Exception:
                    pass
            time.sleep(0.02)
        raise AssertionError(f"daemon not ready:\n{self.log()[-3000:]}")

    def status(self) -> dict[str, Any]:
        return request(self.admin_socket, "status")  # type: ignore[no-any-return]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def end(self) -> None:
        """At the test's end: kill it if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{") and f'"{name}"' in line:
                event = json.loads(line)
                if event.get("event") == name:
                    out.append(event)
        return out


def pytest_report_header(config: pytest.Config) -> str:
    """Which tier this run is (tests/tiers.py): a smoke pass must not pass for a full one."""
    return f"quiverd test tier: {tier()} ({TIER_ENV}; ./scripts/test --full for the full tier)"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short path: Unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="q", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_factory(short_dir: Path) -> Iterator[Any]:
    """``make(settings, *, env=None, name="d", in_process=False)``: a daemon (not yet
    started) with its own root under ``short_dir``; every one still running at the end
    is killed (a subprocess) or stopped (in process).

    ``in_process=True`` runs the real ``serve`` on a thread of the test process
    (tests/inprocess.py): the same interface, no interpreter start (about a CPU-second
    each), but it cannot be killed or signalled, takes no ``env`` and no ``kill:`` fault
    rule, and one runs at a time; after it stops nothing it opened may be left, and at
    teardown no thread started meanwhile. Use it for tests that never kill or signal
    their daemon nor need a process of its own.
    """
    made: list[DaemonProcess] = []
    threads_before = set(threading.enumerate())

    def make(settings: dict[str, Any] | None = None, *, env: dict[str, str] | None = None,
             name: str = "d", in_process: bool = False) -> DaemonProcess:
        root = short_dir / name
        root.mkdir(exist_ok=True)
        settings = dict(settings or {})
        if not any(k.startswith(("lake.", "catalog.")) for k in settings):
            # The lake has its own tests (tests/daemon/test_lake*.py); elsewhere it would
            # hold segments back as a second subscriber.
            settings["lake.enabled"] = False
        d: DaemonProcess
        if in_process:
            from tests.inprocess import InProcessDaemon  # it imports this module

            if env:
                raise TypeError("an in-process daemon has no environment of its own: "
                                "make it with in_process=False")
            d = InProcessDaemon(root, {"shards": 2, **settings})
        else:
            d = DaemonProcess(root, {"shards": 2, **settings}, env or {})
        made.append(d)
        return d

    yield make
    with contextlib.ExitStack() as ends:  # every daemon ends, even when one fails to
        for d in made:
            ends.callback(d.end)
    if any(d.in_process for d in made):
        from tests.inprocess import check_threads

        check_threads(threads_before)
