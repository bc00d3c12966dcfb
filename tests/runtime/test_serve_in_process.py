"""``serve`` on a thread of the test process (tests/inprocess.py): what it leaves as it was.

The in-process daemon runs the production entry with ``in_process``; these tests pin
what that mode must keep: its log in its own file, the process's switch interval and
structlog configuration back as they were, nothing open or running after its stop,
and a clear refusal of what only a subprocess can do.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import structlog

from tests.inprocess import check_threads


def test_serve_in_process_logs_to_its_file_and_restores_the_process(daemon_factory: Any) -> None:
    config, interval = structlog.get_config(), sys.getswitchinterval()
    d = daemon_factory({"shards": 1}, in_process=True).start(faults="acklog.fdatasync=eio@1000")
    assert sys.getswitchinterval() == 0.0005  # the daemon's, while it runs
    assert [e["shards"] for e in d.events("quiverd_ready")] == [1]
    assert [e["rules"] for e in d.events("quiverd_fault_injection_active")] == [
        "acklog.fdatasync=eio@1000"]
    assert d.status()["stopping"] is False
    assert d.stop() == 0
    assert len(d.events("quiverd_stopped")) == 1
    assert sys.getswitchinterval() == interval
    assert structlog.get_config() == config
    d.start()  # a second run of the same daemon appends to the same log
    assert d.stop() == 0
    assert len(d.events("quiverd_ready")) == 2


def test_in_process_daemon_refuses_what_needs_a_process(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1}, in_process=True)
    with pytest.raises(TypeError, match="in_process=False"):
        d.start(faults="finalize=kill:renamed")  # would SIGKILL pytest
    with pytest.raises(TypeError, match="in_process=False"):
        daemon_factory(env={"QUIVERD_GIL_SWITCH_S": "0.005"}, name="e", in_process=True)
    d.start()
    with pytest.raises(TypeError, match="cannot be killed"):
        d.kill()
    with pytest.raises(TypeError, match="has no process"):
        d.proc.send_signal(15)
    other = daemon_factory({"shards": 1}, name="o", in_process=True)
    with pytest.raises(RuntimeError, match="one at a time"):
        other.start()
    assert d.stop() == 0
    assert other.start().stop() == 0  # the slot is free again


def test_in_process_daemon_stop_fails_on_a_file_left_open(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1}, in_process=True).start()
    leaked = open(d.data_dir / "held", "w")  # noqa: SIM115 - what a leak looks like
    try:
        with pytest.raises(AssertionError, match="held"):
            d.stop()
    finally:
        leaked.close()


def test_check_threads_names_a_thread_that_outlives_the_daemons() -> None:
    before = set(threading.enumerate())
    release = threading.Event()
    stray = threading.Thread(target=release.wait, name="stray-worker")
    stray.start()
    try:
        with pytest.raises(AssertionError, match="stray-worker"):
            check_threads(before, grace_s=0.2)
    finally:
        release.set()
        stray.join()
