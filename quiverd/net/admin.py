"""The admin socket (mode 0600): one JSON request line in, one JSON reply line out.

    → {"cmd": "status"}                      ← {"ok": true, "result": {...}}
    → {"cmd": "segments"}                    ← {"ok": true, "result": [...]}
    → {"cmd": "subscribers.add", "args": {"name": "x", "start": "latest"}}
    → {"cmd": "<unknown>"}                   ← {"ok": false, "error": "...", "hint": "..."}

    → {"cmd": "jobs.list"}                   ← {"ok": true, "result": [undecided jobs]}
    → {"cmd": "jobs.abort", "args": {"job_id": "j", "reason": "..."}}

Used by ``quiverd status``, ``quiverd segments list``, ``quiverd subscribers`` and
``quiverd jobs`` (served by the daemon's staging, ``runtime.staging``).
Each command is a typed request (``AdminRequest``, a tagged msgspec union decoded
from ``cmd`` + ``args``) served by one method of ``AdminTarget``.

Bounded: a request line of at most 64 KiB must arrive within
``admin.request_timeout_ms`` (a client that connects and sends nothing, or half a
line, is closed); at most ``admin.max_connections`` are served at once, one more
gets ``{"ok": false, "error": "too many admin connections"}`` and is closed.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
import msgspec

from quiverd.kernel.config import AdminConfig
from quiverd.kernel.errors import DaemonUnreachable, QuiverError
from quiverd.kernel.jobs import check_job_id
from quiverd.kernel.logs import Logger
from quiverd.net.rawsock import BoundSocket, bind_unix, unlink_if_ours

ADMIN_SOCKET_MODE = 0o600
MAX_REQUEST_BYTES = 64 * 1024


class Envelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The wire shape: a command name and its arguments."""

    cmd: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class _Cmd(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
           tag_field="cmd"):
    pass


class Status(_Cmd, tag="status", frozen=True):
    pass


class Segments(_Cmd, tag="segments", frozen=True):
    pass


class SubscribersList(_Cmd, tag="subscribers.list", frozen=True):
    pass


class SubscribersAdd(_Cmd, tag="subscribers.add", frozen=True):
    name: str
    start: Literal["earliest", "latest"] = "earliest"


class SubscribersRemove(_Cmd, tag="subscribers.remove", frozen=True):
    name: str


class JobsList(_Cmd, tag="jobs.list", frozen=True):
    pass


class JobsAbort(_Cmd, tag="jobs.abort", frozen=True):
    job_id: str
    reason: str = ""


AdminRequest = (Status | Segments | SubscribersList | SubscribersAdd | SubscribersRemove
                | JobsList | JobsAbort)
COMMANDS = sorted(str(t.__struct_config__.tag) for t in AdminRequest.__args__)


class AdminTarget(Protocol):
    """What the admin socket serves, one method per command; the runtime's Daemon is one."""

    def status(self) -> dict[str, Any]: ...
    def segments(self) -> list[dict[str, Any]]: ...
    def subscribers(self) -> list[dict[str, Any]]: ...
    async def subscriber_op(self, op: str, name: str, start: str = "earliest"
                            ) -> dict[str, Any]: ...


class JobAdmin(Protocol):
    """What ``jobs.*`` commands need (``runtime.staging.Staging``)."""

    def undecided(self) -> list[dict[str, Any]]: ...
    async def abort(self, job_id: str, reason: str = "") -> tuple[Any, bool]: ...


class AdminServer:
    def __init__(self, path: Path, target: AdminTarget, cfg: AdminConfig | None = None, *,
                 log: Logger, bound: BoundSocket | None = None) -> None:
        """``bound``: the socket claimed before the daemon recovered (else bound in serve)."""
        cfg = cfg or AdminConfig()
        self.path, self.target, self.log, self.bound = path, target, log, bound
        self.timeout_s = cfg.request_timeout_ms / 1000
        self.max_connections = cfg.max_connections
        self.connections = 0
        self.decoder = msgspec.json.Decoder(Envelope)
        self.jobs: JobAdmin | None = None  # the daemon's staging, once it runs

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
            if self.connections >= self.max_connections:
                self.log.warning("admin_connection_refused", connections=self.connections,
                                 max_connections=self.max_connections)
                await _reply(stream, {"ok": False, "error": "too many admin connections "
                                      f"(admin.max_connections = {self.max_connections})",
                                      "hint": "retry in a moment; raise admin.max_connections "
                                      "if many monitors poll at once"})
                return
            self.connections += 1
            try:
                await self._serve_one(stream)
            finally:
                self.connections -= 1

    async def _serve_one(self, stream: anyio.abc.ByteStream) -> None:
        try:
            with anyio.fail_after(self.timeout_s):
                line = await _read_line(stream)
        except TimeoutError:
            await _reply(stream, {"ok": False, "error": "no complete request line within "
                                  f"admin.request_timeout_ms ({round(self.timeout_s * 1000)})",
                                  "hint": "send one JSON line ending in a newline"})
            return
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            return
        await _reply(stream, await self.dispatch(line))

    async def dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            env = self.decoder.decode(line)
            if env.cmd not in COMMANDS:
                return {"ok": False, "error": f"unknown command {env.cmd!r}",
                        "hint": f"known: {', '.join(COMMANDS)}"}
            req = msgspec.convert({**env.args, "cmd": env.cmd}, AdminRequest)
            return {"ok": True, "result": await self._run(req)}
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return {"ok": False, "error": f"bad request: {exc}", "hint": ""}
        except QuiverError as exc:
            return {"ok": False, "error": str(exc), "hint": exc.hint}

    async def _run(self, req: AdminRequest) -> Any:
        t = self.target
        match req:
            case Status():
                return t.status()
            case Segments():
                return t.segments()
            case SubscribersList():
                return t.subscribers()
            case SubscribersAdd(name=name, start=start):
                return await t.subscriber_op("add", name, start)
            case SubscribersRemove(name=name):
                return await t.subscriber_op("remove", name)
            case JobsList() | JobsAbort():
                return await self._jobs(req)

    async def _jobs(self, req: JobsList | JobsAbort) -> Any:
        if self.jobs is None:
            raise QuiverError("quiverd is still starting: jobs are not served yet",
                              hint="retry in a moment")
        if isinstance(req, JobsList):
            return self.jobs.undecided()
        try:
            reason = f"aborted by an operator: {req.reason or 'quiverd jobs abort'}"
            decision, already = await self.jobs.abort(check_job_id(req.job_id), reason)
        except ValueError as exc:
            raise QuiverError(str(exc), hint="pass the job id `quiverd jobs list` shows") from None
        return {**msgspec.to_builtins(decision), "already": already}


async def _reply(stream: anyio.abc.ByteStream, reply: dict[str, Any]) -> None:
    try:
        await stream.send(msgspec.json.encode(reply) + b"\n")
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
        pass  # the client hung up


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
