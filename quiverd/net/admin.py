"""The admin socket (mode 0600): one JSON request line in, one JSON reply line out.

    → {"cmd": "status"}                      ← {"ok": true, "result": {...}}
    → {"cmd": "segments"}                    ← {"ok": true, "result": [...]}
    → {"cmd": "<unknown>"}                   ← {"ok": false, "error": "...", "hint": "..."}

Used by ``quiverd status``, ``quiverd segments list`` and ``quiverd subscribers``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec

from quiverd.kernel.errors import DaemonUnreachable, QuiverError
from quiverd.kernel.logs import Logger
from quiverd.net.rawsock import BoundSocket, bind_unix, unlink_if_ours

ADMIN_SOCKET_MODE = 0o600
MAX_REQUEST_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 10.0  # to send the request line, after connecting


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cmd: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)


Handler = Callable[[dict[str, Any]], Any]  # args -> JSON-able result (or an awaitable of one)


class AdminTarget(Protocol):
    """What the admin socket serves; the runtime's Daemon is one."""

    def status(self) -> dict[str, Any]: ...
    def segments(self) -> list[dict[str, Any]]: ...
    def admin_handlers(self) -> dict[str, Handler]: ...


class AdminServer:
    def __init__(self, path: Path, daemon: AdminTarget, *, log: Logger,
                 bound: BoundSocket | None = None) -> None:
        """``bound``: the socket claimed before the daemon recovered (else bound in serve)."""
        self.path, self.daemon, self.log, self.bound = path, daemon, log, bound
        self.handlers: dict[str, Handler] = {
            "status": lambda args: daemon.status(),
            "segments": lambda args: daemon.segments(),
            **daemon.admin_handlers(),
        }
        self.decoder = msgspec.json.Decoder(Request)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        # Born 0600 (no window where others may connect); a live socket at the path
        # (another daemon's) is refused, never unlinked.
        sock, identity = self.bound or bind_unix(self.path, ADMIN_SOCKET_MODE,
                                                 key="admin.socket_path")
        try:
            listener = await anyio.abc.SocketListener.from_socket(sock)
            async with listener:
                task_status.started()
                await listener.serve(self._handle)
        finally:
            unlink_if_ours(self.path, identity)  # never a socket that replaced ours

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(REQUEST_TIMEOUT_S):  # a peer that sends no line
                    line = await _read_line(stream)
                reply = await self._dispatch(line)
                await stream.send(msgspec.json.encode(reply) + b"\n")
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError,
                    TimeoutError):
                return  # the peer left (or never asked): nothing to answer, nobody to tell

    async def _dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            req = self.decoder.decode(line)
            handler = self.handlers.get(req.cmd)
            if handler is None:
                return {"ok": False, "error": f"unknown command {req.cmd!r}",
                        "hint": f"known: {', '.join(sorted(self.handlers))}"}
            result = handler(req.args)
            if hasattr(result, "__await__"):
                result = await result
            return {"ok": True, "result": result}
        except msgspec.DecodeError as exc:
            return {"ok": False, "error": f"bad request: {exc}", "hint": ""}
        except QuiverError as exc:
            return {"ok": False, "error": str(exc), "hint": exc.hint}


async def _read_line(stream: anyio.abc.ByteStream) -> bytes:
    buf = b""
    while b"\n" not in buf:
        buf += await stream.receive(4096)
        if len(buf) > MAX_REQUEST_BYTES:
            raise anyio.BrokenResourceError("admin request too long")
    return buf.split(b"\n", 1)[0]


def request(path: Path | str, cmd: str, args: dict[str, Any] | None = None,
            *, timeout_s: float = 10.0) -> Any:
    """Blocking client for the CLI: send one request, return ``result`` or raise."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise DaemonUnreachable.from_os_error(
                path, exc, what="quiverd admin socket",
                hint="is quiverd running (`systemctl status quiverd`)? The admin socket is "
                "admin.socket_path, by default <data_dir>/admin.sock: pass the daemon's "
                "--config or --socket") from exc
        try:
            sock.sendall(msgspec.json.encode({"cmd": cmd, "args": args or {}}) + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise DaemonUnreachable(
                f"no answer on {path} within {timeout_s:g} s",
                hint="a daemon answers once its shards are recovered (a long WAL replay takes "
                "a while); check `systemctl status quiverd` and its log") from None
    try:
        reply = msgspec.json.decode(buf)
    except msgspec.DecodeError:
        reply = None
    if not isinstance(reply, dict):
        raise DaemonUnreachable(
            f"{path} did not answer as a quiverd admin socket"
            + ("" if buf else " (it closed the connection)"),
            hint="pass the admin socket (admin.socket_path, by default "
            "<data_dir>/admin.sock), not the ingest socket; or see the daemon's log")
    if not reply.get("ok"):
        raise QuiverError(reply.get("error", "admin request failed"), hint=reply.get("hint", ""))
    return reply["result"]
