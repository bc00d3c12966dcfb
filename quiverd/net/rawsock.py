"""A non-blocking Unix socket driven by anyio's readiness waits, with no transport.

asyncio transports read into their own buffers; the ingest path instead wants
``recv_into`` straight into each frame's buffer (one copy, kernel → frame), so
connections are plain sockets: ``wait_readable`` + ``recv_into`` and
``wait_writable`` + ``send``.

Socket paths are never stolen: ``bind_unix`` unlinks an existing socket file
only when nothing answers on it (a daemon that died left it), and refuses when
another process listens there; ``unlink_if_ours`` removes the path at stop only
while it is still the file we bound, so a socket that replaced ours survives.
Probe, bind and listen run under an flock of the socket's directory: two daemons
starting at the same instant cannot both find the path free, nor can one take the
other's socket, bound but not yet listening, for a dead one and unlink it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.lowlevel

from quiverd.kernel.errors import AlreadyRunning, QuiverError

BACKLOG = 128
IOV_MAX = 512
CLAIM_WAIT_S = 5.0  # another process's probe-and-bind takes microseconds

SocketId = tuple[int, int]  # (st_dev, st_ino) of the socket file we bound


class BoundSocket(NamedTuple):
    """A listening socket and the identity of the file it is bound to."""

    sock: socket.socket
    identity: SocketId


def nbytes(data: bytes | bytearray | memoryview) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


class RawStream:
    """Just what a connection needs: receive, receive_into, send, aclose."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        # A peer that reads nothing of what we send for this long is gone: sending
        # raises BrokenResourceError (set from ingest.idle_timeout_ms; inf = wait).
        self.send_stall_s = math.inf
        # A send cut short (cancelled, stalled) left half a frame on the wire: nothing
        # more may be sent, not even an ERROR, as the peer could not parse it.
        self.torn = False

    async def receive(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes``; raises anyio.EndOfStream at EOF."""
        while True:
            try:
                data = self.sock.recv(max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            except ConnectionError as exc:
                raise anyio.BrokenResourceError(str(exc)) from exc
            if not data:
                raise anyio.EndOfStream
            return data

    async def receive_into(self, buffer: memoryview) -> int:
        """recv_into ``buffer``; 0 at EOF.

        Reads first and waits only when nothing is there: under load the data is
        usually already queued, and a readiness wait costs a loop round trip.
        """
        await anyio.lowlevel.checkpoint()  # stay cancellable and fair when data never runs out
        while True:
            try:
                return self.sock.recv_into(buffer)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
            except ConnectionError as exc:
                raise anyio.BrokenResourceError(str(exc)) from exc

    def try_receive_into(self, buffer: memoryview) -> int | None:
        """recv_into ``buffer`` if bytes are waiting (0 at EOF); None if none are."""
        try:
            return self.sock.recv_into(buffer)
        except BlockingIOError:
            return None
        except ConnectionError as exc:
            raise anyio.BrokenResourceError(str(exc)) from exc

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                try:
                    n = self.sock.send(view)
                except BlockingIOError:
                    await self._wait_writable()
                    continue
                except (ConnectionError, OSError) as exc:
                    raise anyio.BrokenResourceError(str(exc)) from exc
                view = view[n:]
        except BaseException:
            self.torn = self.torn or len(view) < nbytes(data)
            raise
        await anyio.lowlevel.checkpoint()

    async def send_parts(self, parts: list[bytes | bytearray | memoryview]) -> None:
        """Send a frame given as pieces with sendmsg: payloads are never joined (copied)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        started = False
        try:
            while views:
                try:
                    n = self.sock.sendmsg(views[:IOV_MAX])
                except BlockingIOError:
                    await self._wait_writable()
                    continue
                except (ConnectionError, OSError) as exc:
                    raise anyio.BrokenResourceError(str(exc)) from exc
                started = started or n > 0
                while n:
                    if n >= len(views[0]):
                        n -= len(views.pop(0))
                    else:
                        views[0], n = views[0][n:], 0
        except BaseException:
            self.torn = self.torn or (started and bool(views))
            raise
        await anyio.lowlevel.checkpoint()

    async def _wait_writable(self) -> None:
        with anyio.move_on_after(self.send_stall_s) as scope:
            await anyio.wait_writable(self.sock)
        if scope.cancelled_caught:
            raise anyio.BrokenResourceError(
                f"the peer read nothing for {self.send_stall_s * 1000:.0f} ms "
                "(ingest.idle_timeout_ms)")

    def shutdown(self) -> None:
        """End both directions now (the peer sees end of stream); close comes later."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone

    async def aclose(self) -> None:
        self.sock.close()

    async def __aenter__(self) -> RawStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RawListener:
    def __init__(self, path: Path, mode: int, *, key: str = "ingest.socket_path",
                 bound: BoundSocket | None = None) -> None:
        """Listen on ``bound`` (claimed before the daemon recovered) or bind ``path`` now."""
        self.path = path
        self.sock, self.identity = bound or bind_unix(path, mode, key=key)

    async def accept(self) -> RawStream:
        while True:
            await anyio.wait_readable(self.sock)
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, ConnectionAbortedError):
                continue
            return RawStream(conn)

    def close(self) -> None:
        """Close the listener and remove its path, if the path is still ours."""
        self.sock.close()
        unlink_if_ours(self.path, self.identity)


def bind_unix(path: Path, mode: int, *, key: str) -> BoundSocket:
    """A listening, non-blocking Unix socket at ``path`` born with ``mode``.

    A socket file left by a dead process is replaced; a live one is refused with
    AlreadyRunning (``key`` names the config key in the hint). Connections made before
    the owner accepts wait in the backlog.
    """
    with _claiming(path, key):
        clear_stale_socket(path, key=key)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o777 & ~mode)  # born with the configured mode: no open window
            try:
                sock.bind(str(path))
            finally:
                os.umask(old)
            st = os.lstat(path)
            os.chmod(path, mode)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:  # another process bound it since we looked
                raise _live(path, key) from exc
            raise QuiverError(f"cannot listen on {path}: {exc.strerror}",
                              hint=f"check that the directory of {key} exists and is "
                              "writable by quiverd's user") from exc
    return BoundSocket(sock, (st.st_dev, st.st_ino))


@contextlib.contextmanager
def _claiming(path: Path, key: str) -> Iterator[None]:
    """Hold an exclusive flock on the directory of ``path`` (bounded wait)."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd < 0:
        yield  # missing or unreadable: bind reports what matters about it
        return
    try:
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise QuiverError(f"cannot claim {path}: another process keeps "
                                      f"{path.parent} locked", hint=f"give this daemon its "
                                      f"own {key} in a directory of its own") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock


def clear_stale_socket(path: Path, *, key: str) -> None:
    """Unlink ``path`` if it is a socket nobody listens on; refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise QuiverError(f"{path} exists and is not a socket",
                          hint=f"move the file away or set {key} to another path; "
                          "quiverd only replaces socket files nobody listens on")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.setblocking(False)  # a listener with a full backlog answers EAGAIN, not a wait
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # left by a process that is gone
        return
    except FileNotFoundError:
        return
    except BlockingIOError:
        pass  # listening, backlog full: alive
    except OSError as exc:
        raise QuiverError(f"cannot tell whether another process listens on {path}: "
                          f"{exc.strerror}", hint=f"remove {path} if no quiverd uses it, "
                          f"or set {key} to another path") from exc
    finally:
        probe.close()
    raise _live(path, key)


def unlink_if_ours(path: Path, identity: SocketId) -> None:
    """Remove the socket file at ``path`` only if it is still the one we bound."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        path.unlink(missing_ok=True)


def _live(path: Path, key: str) -> AlreadyRunning:
    return AlreadyRunning(f"another process is listening on {path}",
                          hint=f"another quiverd (or another program) serves this socket; "
                          f"stop it, or give this daemon its own {key}")
