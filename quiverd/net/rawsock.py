"""A non-blocking Unix socket driven by anyio's readiness waits, with no transport.

asyncio transports read into their own buffers; the ingest path instead wants
``recv_into`` straight into each frame's buffer (one copy, kernel → frame), so
connections are plain sockets: ``wait_readable`` + ``recv_into`` and
``wait_writable`` + ``send``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import anyio
import anyio.lowlevel

BACKLOG = 128
IOV_MAX = 512


class RawStream:
    """Just what a connection needs: receive, receive_into, send, aclose."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

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

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                n = self.sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            except (ConnectionError, OSError) as exc:
                raise anyio.BrokenResourceError(str(exc)) from exc
            view = view[n:]
        await anyio.lowlevel.checkpoint()

    async def send_parts(self, parts: list[bytes | bytearray | memoryview]) -> None:
        """Send a frame given as pieces with sendmsg: payloads are never joined (copied)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            try:
                n = self.sock.sendmsg(views[:IOV_MAX])
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            except (ConnectionError, OSError) as exc:
                raise anyio.BrokenResourceError(str(exc)) from exc
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self.sock.close()

    async def __aenter__(self) -> RawStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RawListener:
    def __init__(self, path: Path, mode: int) -> None:
        if path.exists() or path.is_symlink():
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o777 & ~mode)  # born with the configured mode: no open window
        try:
            self.sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, mode)
        self.sock.listen(BACKLOG)
        self.sock.setblocking(False)

    async def accept(self) -> RawStream:
        while True:
            await anyio.wait_readable(self.sock)
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                continue
            return RawStream(conn)

    def close(self) -> None:
        self.sock.close()
