"""The admin socket on real Unix sockets: typed requests, a request timeout, a
connection limit."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from quiverd.kernel.config import AdminConfig
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.logs import get as get_logger
from quiverd.net.admin import AdminServer, request


class Target:
    def __init__(self) -> None:
        self.ops: list[tuple[str, str, str]] = []

    def status(self) -> dict[str, Any]:
        return {"pid": 1}

    def segments(self) -> list[dict[str, Any]]:
        return [{"shard": 0}]

    def subscribers(self) -> list[dict[str, Any]]:
        return [{"name": "a"}]

    async def subscriber_op(self, op: str, name: str, start: str = "earliest"
                            ) -> dict[str, Any]:
        if name == "bad!":
            raise ConfigError("name", "not a subscriber name")
        self.ops.append((op, name, start))
        return {"name": name, "op": op}


@asynccontextmanager
async def serving(path: Path, cfg: AdminConfig) -> AsyncIterator[Target]:
    target = Target()
    server = AdminServer(path, target, cfg, log=get_logger("test"))
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        try:
            yield target
        finally:
            tg.cancel_scope.cancel()


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def read_reply(s: socket.socket) -> dict[str, Any] | None:
    """The reply line, or None when the server closed without one."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return msgspec.json.decode(buf) if buf else None


async def in_thread(fn: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(fn, *args)


@pytest.mark.asyncio
async def test_admin_typed_requests_answered_and_bad_ones_explained(short_dir: Path) -> None:
    path = short_dir / "a.sock"
    async with serving(path, AdminConfig()) as target:
        assert await in_thread(request, path, "status") == {"pid": 1}
        assert await in_thread(request, path, "segments") == [{"shard": 0}]
        assert await in_thread(request, path, "subscribers.list") == [{"name": "a"}]
        got = await in_thread(lambda: request(path, "subscribers.add",
                                              {"name": "x", "start": "latest"}))
        assert got == {"name": "x", "op": "add"}
        await in_thread(lambda: request(path, "subscribers.remove", {"name": "x"}))
        assert target.ops == [("add", "x", "latest"), ("remove", "x", "earliest")]
        for cmd, args, text in (("nope", {}, "unknown command 'nope'"),
                                ("subscribers.add", {}, "bad request"),
                                ("subscribers.add", {"name": "x", "start": "middle"},
                                 "bad request"),
                                ("status", {"extra": 1}, "bad request"),
                                ("subscribers.add", {"name": "bad!"}, "not a subscriber")):
            with pytest.raises(Exception, match=text):
                await in_thread(lambda c=cmd, a=args: request(path, c, a))


@pytest.mark.asyncio
async def test_admin_silent_or_half_line_client_closed_after_timeout(short_dir: Path) -> None:
    path = short_dir / "a.sock"
    async with serving(path, AdminConfig(request_timeout_ms=300)):
        silent, half = connect(path), connect(path)
        half.sendall(b'{"cmd": "sta')
        started = time.monotonic()
        for s in (silent, half):
            reply = await in_thread(read_reply, s)
            assert reply is not None and reply["ok"] is False
            assert "admin.request_timeout_ms" in reply["error"], reply
            assert await in_thread(s.recv, 1) == b""  # closed
            s.close()
        assert time.monotonic() - started < 5
        assert await in_thread(request, path, "status") == {"pid": 1}  # still serving


@pytest.mark.asyncio
async def test_admin_connections_beyond_limit_refused_with_error(short_dir: Path) -> None:
    path = short_dir / "a.sock"
    async with serving(path, AdminConfig(max_connections=2, request_timeout_ms=5000)):
        held = [connect(path), connect(path)]
        await anyio.sleep(0.2)  # both accepted and waiting for their request line
        extra = connect(path)
        reply = await in_thread(read_reply, extra)
        assert reply is not None and not reply["ok"]
        assert "too many admin connections" in reply["error"], reply
        extra.close()
        held[0].sendall(b'{"cmd": "status"}\n')
        assert (await in_thread(read_reply, held[0]))["result"] == {"pid": 1}  # type: ignore[index]
        for s in held:
            s.close()
        await anyio.sleep(0.2)
        assert await in_thread(request, path, "status") == {"pid": 1}  # slots freed
