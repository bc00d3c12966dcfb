"""Socket paths are never stolen: live sockets refused, stale ones replaced, ours removed."""

from __future__ import annotations

import os
import socket
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

    first = daemon_factory(name="a").start()
    path = first.socket if shared == "ingest" else first.admin_socket
    inode = os.stat(path).st_ino
    second = daemon_factory({f"{shared}.socket_path": str(path)}, name="b")
    second.start(wait=False)
    assert second.wait(30) != 0
    assert f"another process is listening on {path}" in second.log()
    assert f"{shared}.socket_path" in second.log()  # the hint names the key
    assert os.stat(path).st_ino == inode  # not stolen, not deleted on its way out
    assert not second.socket.exists()  # the second one's own ingest socket is cleaned up
    with Client.connect(first.socket) as c:
        c.send(tagged_table(1), client="still-here")
    assert first.status()["stopping"] is False
    assert first.stop() == 0


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
    d = daemon_factory().start()
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
        assert d.proc.poll() is None, d.log()[-3000:]
        try:
            request(admin_socket, "status", timeout_s=1)
            return
        except Exception:
            time.sleep(0.02)
    raise AssertionError(f"daemon not ready:\n{d.log()[-3000:]}")
