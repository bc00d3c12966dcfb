"""The daemon's HTTP endpoints for operators (JSON bodies but for /metrics):

- ``GET /metrics``: the Prometheus text exposition of the daemon's one registry;
- ``GET /livez``: 200 ``{"status": "alive", "uptime_s", "version", "pid"}`` whenever the
  event loop answers (the liveness probe: never 503, a degraded lake included);
- ``GET /readyz``: 200 ``{"status": "ready", "reasons": []}`` while appends are taken,
  else 503 ``{"status": "not_ready", "reasons": [...]}`` (starting, stopping, a shard
  at its size cap under backpressure, a WAL without disk space: ``runtime.status``);
- ``GET /healthz``: 200 ``{"status": "ok", ...}`` while nothing is degraded, else 503
  ``{"status": "degraded", "degraded": {"lake.store": {"kind", "error", "hint",
  "since_ns", "last_ns", "attempts"}, ...}}`` (parts as in ``quiverd.lake.health``).

A minimal HTTP/1.0 responder on the event loop (``[metrics] listen``, off by
default; loopback is the sensible address): one request per connection, a
bounded request head, a read timeout. Collecting runs on the event loop, where
every value changes, so a scrape never reads a table mid-update. Anything else
gets 404 (``GET /`` a pointer to the four).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quiverd.kernel.config import parse_listen
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics

MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0


class MetricsServer:
    def __init__(self, listen: str, metrics: Metrics, *, log: Logger,
                 health: Callable[[], dict[str, Any]] | None = None,
                 live: Callable[[], dict[str, Any]] | None = None,
                 ready: Callable[[], dict[str, Any]] | None = None) -> None:
        self.host, self.port = parse_listen(listen)
        self.metrics, self.log = metrics, log
        # path -> (its report, the report's status that answers 200; any other: 503)
        self.probes: dict[bytes, tuple[Callable[[], dict[str, Any]], str]] = {
            b"/healthz": (health or (lambda: {"status": "ok", "degraded": {}}), "ok"),
            b"/livez": (live or (lambda: {"status": "alive"}), "alive"),
            b"/readyz": (ready or (lambda: {"status": "ready", "reasons": []}), "ready"),
        }
        self.address = ""

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        try:
            listener = await anyio.create_tcp_listener(local_host=self.host,
                                                       local_port=self.port)
        except OSError as exc:
            raise ConfigError("metrics.listen", f"cannot listen on {self.host}:{self.port}: "
                              f"{exc.strerror or exc}",
                              hint="pick a free port, or set [metrics] listen = \"\" to turn "
                              "the endpoint off") from exc
        async with listener:
            bound = listener.extra(anyio.abc.SocketAttribute.local_address)
            self.address = f"{bound[0]}:{bound[1]}" if isinstance(bound, tuple) else str(bound)
            self.log.info("metrics_listening", address=self.address, path="/metrics")
            task_status.started()
            await listener.serve(self._handle)

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(READ_TIMEOUT_S):
                    head = await _read_head(stream)
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, ValueError):
                return
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
            if method == b"GET" and path == b"/metrics":
                body = generate_latest(self.metrics.registry)
                await _respond(stream, b"200 OK", CONTENT_TYPE_LATEST.encode(), body)
            elif method == b"GET" and path in self.probes:
                report, good = self.probes[path]
                answer = report()
                status = (b"200 OK" if answer.get("status") == good
                          else b"503 Service Unavailable")
                await _respond(stream, status, b"application/json",
                               msgspec.json.encode(answer) + b"\n")
            elif method == b"GET" and path == b"/":
                await _respond(stream, b"200 OK", b"text/plain",
                               b"quiverd: see /metrics, /livez, /readyz and /healthz\n")
            else:
                await _respond(stream, b"404 Not Found", b"text/plain", b"not found\n")


async def _read_head(stream: anyio.abc.ByteStream) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        buf += await stream.receive(4096)
        if len(buf) > MAX_HEAD_BYTES:
            raise ValueError("request head too long")
    return buf


async def _respond(stream: anyio.abc.ByteStream, status: bytes, content_type: bytes,
                   body: bytes) -> None:
    head = (b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
    try:
        await stream.send(head + body)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the scraper hung up
