"""A fatal signal leaves a log line: the daemon's faulthandler prints every thread's
Python stack to stderr (journald) before the signal kills it.

Issue 17: restarts on a full filesystem died with SIGBUS 39 times in a row and logged
nothing. A SIGBUS from a bad memory-mapped page and one sent with kill(2) reach the same
handler, so a sent one tests it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.parametrize("signum", [signal.SIGBUS, signal.SIGSEGV], ids=["bus", "segv"])
def test_daemon_killed_by_a_fatal_signal_logs_a_traceback(
        daemon_factory: Any, short_dir: Path, monkeypatch: pytest.MonkeyPatch,
        signum: signal.Signals) -> None:
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)  # the daemon must enable it
    d = daemon_factory({"shards": 1})
    d.start()
    assert d.proc is not None
    os.kill(d.proc.pid, signum)
    assert d.wait(10) == -signum  # still dies of the signal: systemd sees the cause
    log = d.log()
    assert "Fatal Python error" in log, log[-2000:]
    assert "Current thread" in log or "Thread 0x" in log, log[-2000:]
    assert "quiverd/runtime/serve.py" in log, log[-2000:]  # the main thread's stack
