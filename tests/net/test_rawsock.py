"""Socket paths are never stolen: live sockets refused, stale ones replaced, ours removed."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from quiverd.kernel.errors import AlreadyRunning, QuiverError
from quiverd.net.rawsock import bind_unix, unlink_if_ours


def _listening(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def test_bind_unix_refuses_a_path_another_process_listens_on(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    other = _listening(path)
    inode = os.stat(path).st_ino
    with pytest.raises(AlreadyRunning, match=f"another process is listening on {path}") as err:
        bind_unix(path, 0o600, key="ingest.socket_path")
    assert "ingest.socket_path" in err.value.hint
    assert os.stat(path).st_ino == inode  # untouched: the other process is still reachable
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(str(path))
    probe.close()
    other.close()


def test_bind_unix_refuses_a_listener_whose_backlog_is_full(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    other.listen(0)
    queued = []
    for _ in range(4):  # fill the backlog: further connects would block (EAGAIN)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(str(path))
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    assert len(queued) < 4  # the backlog is full: the probe's connect gets EAGAIN
    with pytest.raises(AlreadyRunning):
        bind_unix(path, 0o600, key="admin.socket_path")
    for c in queued:
        c.close()
    other.close()


def test_bind_unix_replaces_a_socket_nobody_listens_on(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    dead = _listening(path)
    dead.close()  # the file stays, as after kill -9
    sock, identity = bind_unix(path, 0o640, key="ingest.socket_path")
    st = os.stat(path)
    assert (st.st_dev, st.st_ino) == identity
    assert st.st_mode & 0o777 == 0o640
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    client.close()
    sock.close()


def test_bind_unix_waits_for_a_claim_in_progress_instead_of_taking_it_for_a_dead_one(
        short_dir: Path) -> None:
    """Another daemon holds the directory's flock between its bind and its listen: a
    bound socket that does not listen yet answers ECONNREFUSED, like a dead one."""
    path = short_dir / "s.sock"
    claiming = os.open(short_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(claiming, fcntl.LOCK_EX)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))  # bound, not listening yet
    outcome: list[BaseException | None] = []

    def second() -> None:
        try:
            bind_unix(path, 0o600, key="ingest.socket_path")[0].close()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.3)
    assert outcome == []  # waiting for the claim in progress
    other.listen(1)
    os.close(claiming)
    thread.join(10)
    assert isinstance(outcome[0], AlreadyRunning), outcome
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(str(path))  # still the first claimant's
    probe.close()
    other.close()


def test_bind_unix_refuses_to_unlink_a_file_that_is_not_a_socket(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    path.write_text("precious")
    with pytest.raises(QuiverError, match="exists and is not a socket"):
        bind_unix(path, 0o600, key="ingest.socket_path")
    assert path.read_text() == "precious"


def test_unlink_if_ours_leaves_a_socket_that_replaced_ours(short_dir: Path) -> None:
    path = short_dir / "s.sock"
    sock, identity = bind_unix(path, 0o600, key="ingest.socket_path")
    newer = _listening(short_dir / "n.sock")
    os.rename(short_dir / "n.sock", path)  # another daemon took the path over
    unlink_if_ours(path, identity)
    assert path.exists()
    sock.close()
    newer.close()
    path.unlink()
    sock, identity = bind_unix(path, 0o600, key="ingest.socket_path")
    unlink_if_ours(path, identity)
    assert not path.exists()
    unlink_if_ours(path, identity)  # already gone: no error
    sock.close()


# --- both servers of a real daemon ---------------------------------------------------


@pytest.mark.parametrize("shared", ["ingest", "admin"])
def test_second_daemon_on_a_live_socket_path_is_refused_and_the_first_keeps_serving(
        daemon_factory, shared: str) -> None:
    from quiverd.client import Client
    from tests.daemon.helpers import tagged_table

    first = daemon_factory(name="a", in_process=True).start()
    path = first.socket if shared == "ingest" else first.admin_socket
    inode = os.stat(path).st_ino
    second = daemon_factory({f"{shared}.socket_path": str(path)}, name="b")
    second.start(wait=False)
    assert second.wait(30) != 0
    assert f"another process is listening on {path}" in second.log()
    assert f"{shared}.socket_path" in second.log()  # the hint names the key
    assert os.stat(path).st_ino == inode  # not stolen, not deleted on its way out
    assert not second.socket.exists()  # the second one's own ingest socket is cleaned up
    assert not second.data_dir.exists()  # refused before its data directory was made
    with Client.connect(first.socket) as c:
        c.send(tagged_table(1), client="still-here")
    assert first.status()["stopping"] is False
    assert first.stop() == 0


RECOVERY_EVENTS = ("wal_created", "wal_replayed", "shard_recovered")  # what recovery logs


@pytest.mark.parametrize("data_dirs", ["one", "two"])
def test_two_daemons_started_together_on_one_socket_one_runs_the_other_recovers_nothing(
        daemon_factory, data_dirs: str) -> None:
    """Started at the same instant on one socket path (and one data directory, or two
    new ones): exactly one serves; the other exits 2, refused before any recovery work,
    and leaves no data directory of its own."""
    from quiverd.net.admin import request

    a = daemon_factory(name="a")
    b = daemon_factory({"ingest.socket_path": str(a.socket),
                        "admin.socket_path": str(a.admin_socket)}, name="b")
    configs = [a.config_path, a.config_path if data_dirs == "one" else b.config_path]
    for round_ in range(3):
        _listening(a.socket).close()  # a file left by a killed daemon: both may replace it
        logs = [a.root / f"together-{round_}-{i}.log" for i in range(2)]
        procs = []
        for config, log in zip(configs, logs, strict=True):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "quiverd", "serve", "--config", str(config)],
                    stdout=out, stderr=subprocess.STDOUT))
        try:
            deadline = time.monotonic() + 60
            while all(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, "both daemons run: " + " / ".join(
                    log.read_text()[-1500:] for log in logs)
                time.sleep(0.05)
            [lost] = [i for i, p in enumerate(procs) if p.poll() is not None]
            winner = procs[1 - lost]
            assert procs[lost].returncode == 2, logs[lost].read_text()
            text = logs[lost].read_text()
            assert (f"another process is listening on {a.socket}" in text
                    or f"in use by another quiverd (pid {winner.pid})" in text), text
            assert not [e for e in RECOVERY_EVENTS if f'"{e}"' in text], text
            if data_dirs == "two":
                assert not [a, b][lost].data_dir.exists()
            _wait_ready_pid(winner, a.admin_socket)
            assert request(a.admin_socket, "status")["pid"] == winner.pid
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            assert [p.wait(30) for p in procs].count(0) == 1
        if data_dirs == "two":  # next round: both data directories new again
            for d in (a, b):
                shutil.rmtree(d.data_dir, ignore_errors=True)  # the loser made none


def _wait_ready_pid(proc: subprocess.Popen[bytes], admin_socket: Path) -> None:
    from quiverd.net.admin import request

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None
        try:
            request(admin_socket, "status", timeout_s=1)
            return
        except Exception:
            time.sleep(0.02)
    raise AssertionError("the daemon left running is not ready")


def test_daemon_replaces_the_sockets_a_killed_daemon_left(daemon_factory) -> None:
    from quiverd.client import Client
    from tests.daemon.helpers import tagged_table

    first = daemon_factory(name="a").start()
    first.kill()
    assert first.socket.exists() and first.admin_socket.exists()  # left behind by kill -9
    second = daemon_factory({"ingest.socket_path": str(first.socket),
                             "admin.socket_path": str(first.admin_socket)}, name="b")
    second.start(wait=False)
    _wait_ready(second, first.admin_socket)
    with Client.connect(first.socket) as c:
        c.send(tagged_table(1), client="x")
    assert second.stop() == 0
    assert not first.socket.exists() and not first.admin_socket.exists()


def test_stopping_daemon_leaves_alone_a_socket_that_replaced_its_own(
        daemon_factory, short_dir: Path) -> None:
    d = daemon_factory(in_process=True).start()
    newer = {}
    for name, path in (("ingest", d.socket), ("admin", d.admin_socket)):
        newer[name] = _listening(short_dir / f"{name}.new")
        os.rename(short_dir / f"{name}.new", path)  # someone took the path over
    assert d.stop() == 0
    for name, path in (("ingest", d.socket), ("admin", d.admin_socket)):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(path))  # still there, still the newcomer's
        probe.close()
        newer[name].close()


def _wait_ready(d, admin_socket: Path) -> None:
    """Like DaemonProcess.wait_ready, for a daemon whose admin socket is elsewhere."""
    from quiverd.net.admin import request

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert d.running, d.log()[-3000:]
        try:
            request(admin_socket, "status", timeout_s=1)
            return
        except Exception:
            time.sleep(0.02)
    raise AssertionError(f"daemon not ready:\n{d.log()[-3000:]}")
