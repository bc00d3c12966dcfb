"""A misbehaving HTTP hop on loopback, in front of a real server (moto's S3).

    client ──TCP──▶ FaultProxy(127.0.0.1:port) ──TCP──▶ upstream (one connection per request)

Each request head and body (Content-Length or chunked) is read whole, then the current
fault decides: forward the raw bytes and relay the answer, answer itself with an error
status, wait first, or reset the connection (RST, no answer). A fault applies to the next
``count`` requests whose request line contains ``match`` (all of them when ``count`` is
None), then the proxy passes everything through again. Real sockets, one thread per
client connection: the client sees exactly what a flaky S3 endpoint would send.
"""

from __future__ import annotations

import collections
import io
import socket
import struct
import threading
from dataclasses import dataclass

HEAD_LIMIT_BYTES = 64 * 1024  # a request or response head larger than this is a bug
IO_TIMEOUT_S = 30.0

_REASONS = {403: "Forbidden", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}
_S3_CODES = {403: "AccessDenied", 429: "SlowDown", 500: "InternalError", 503: "SlowDown"}


@dataclass
class _Fault:
    action: str  # "status" | "delay" | "reset" | "corrupt"
    count: int | None  # requests left to spoil; None = every matching request
    match: str  # substring of the request line ("" = any)
    status: int = 0
    delay_s: float = 0.0


class FaultProxy:
    """Started on construction; ``stop()`` closes the listener and wakes delayed requests."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests: collections.deque[str] = collections.deque(maxlen=10_000)
        self.spoiled = 0  # requests a fault was applied to
        self._lock = threading.Lock()
        self._fault: _Fault | None = None
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()  # open client connections, closed by stop()
        self._accept_thread = threading.Thread(target=self._accept, daemon=True)
        self._accept_thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- modes -------------------------------------------------------------------------------
    def pass_through(self) -> None:
        self._set(None)

    def fail(self, status: int, *, count: int | None = None, match: str = "") -> None:
        """Answer with ``status`` and an S3 error document, not forwarding the request."""
        self._set(_Fault("status", count, match, status=status))

    def throttle(self, *, count: int | None = None, match: str = "") -> None:
        self.fail(503, count=count, match=match)

    def deny(self, *, count: int | None = None, match: str = "") -> None:
        self.fail(403, count=count, match=match)

    def delay(self, ms: int, *, count: int | None = None, match: str = "") -> None:
        self._set(_Fault("delay", count, match, delay_s=ms / 1000))

    def reset(self, *, count: int | None = None, match: str = "") -> None:
        """Read the request, then close the connection with an RST and no answer."""
        self._set(_Fault("reset", count, match))

    def corrupt(self, *, count: int | None = None, match: str = "") -> None:
        """Forward, then flip the last byte of the response body (length unchanged)."""
        self._set(_Fault("corrupt", count, match))

    def stop(self) -> None:
        self._stopping.set()
        # close() alone does not wake a thread blocked in accept(); shutdown() does (Linux).
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._accept_thread.join(5)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # wakes threads waiting for a pooled connection's next request
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(5)

    # -- machinery ---------------------------------------------------------------------------
    def _set(self, fault: _Fault | None) -> None:
        with self._lock:
            self._fault = fault

    def _take(self, request_line: str) -> _Fault | None:
        """The fault for this request, if any, counting it down."""
        with self._lock:
            self.requests.append(request_line)
            fault = self._fault
            if fault is None or fault.match not in request_line:
                return None
            if fault.count is not None:
                fault.count -= 1
                if fault.count <= 0:
                    self._fault = None
            self.spoiled += 1
            return fault

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        conn.settimeout(IO_TIMEOUT_S)
        reader = conn.makefile("rb")
        try:
            while not self._stopping.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                body = _read_body(reader, head, request=True)
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                if not self._handle(conn, request_line, head + body):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            reader.close()
            conn.close()

    def _handle(self, conn: socket.socket, request_line: str, raw: bytes) -> bool:
        """Answer one request; False when the client connection must close."""
        fault = self._take(request_line)
        if fault is not None and fault.action == "reset":
            # SO_LINGER with a zero timeout turns close() into an RST.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if fault is not None and fault.action == "status":
            conn.sendall(_error_response(fault.status, head_only=request_line.startswith("HEAD")))
            return False
        if fault is not None and fault.action == "delay" and self._stopping.wait(fault.delay_s):
            return False
        response, keep_alive = self._forward(raw, head_request=request_line.startswith("HEAD"))
        if fault is not None and fault.action == "corrupt" and not response.endswith(b"\r\n\r\n"):
            response = response[:-1] + bytes([response[-1] ^ 0xFF])
        conn.sendall(response)
        return keep_alive

    def _forward(self, raw: bytes, *, head_request: bool) -> tuple[bytes, bool]:
        with socket.create_connection(self.upstream, timeout=IO_TIMEOUT_S) as up:
            up.sendall(raw)
            with up.makefile("rb") as reader:
                head = _read_head(reader)
                if head is None:
                    raise ConnectionError("upstream closed without answering")
                status = int(head.split(b" ", 2)[1])
                no_body = head_request or status in (204, 304) or 100 <= status < 200
                body = b"" if no_body else _read_body(reader, head, request=False)
        keep_alive = b"connection: close" not in head.lower()
        return head + body, keep_alive


def _read_head(reader: io.BufferedReader) -> bytes | None:
    """Bytes up to and including the blank line; None at a clean end of stream."""
    lines: list[bytes] = []
    total = 0
    while True:
        line = reader.readline(HEAD_LIMIT_BYTES)
        if not line:
            if lines:
                raise ConnectionError("stream ended inside an HTTP head")
            return None
        lines.append(line)
        total += len(line)
        if total > HEAD_LIMIT_BYTES:
            raise ConnectionError("HTTP head too large")
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def _read_body(reader: io.BufferedReader, head: bytes, *, request: bool) -> bytes:
    """The raw body bytes as sent (chunk framing kept), delimited like HTTP/1.1 does."""
    readline = reader.readline
    encoding = _header(head, b"transfer-encoding")
    if encoding is not None and b"chunked" in encoding.lower():
        parts: list[bytes] = []
        while True:
            size_line = readline(HEAD_LIMIT_BYTES)
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers up to the blank line
                    trailer = readline(HEAD_LIMIT_BYTES)
                    parts.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(parts)
            parts.append(_read_exact(reader, size + 2))
    length = _header(head, b"content-length")
    if length is not None:
        return _read_exact(reader, int(length))
    return b"" if request else reader.read()  # a response without a length ends at EOF


def _read_exact(reader: io.BufferedReader, n: int) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise ConnectionError(f"stream ended {n - len(data)} bytes short of a body")
    return data


def _error_response(status: int, *, head_only: bool) -> bytes:
    code = _S3_CODES.get(status, "InternalError")
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>fault proxy: {status}</Message><RequestId>fault</RequestId></Error>")
    payload = b"" if head_only else body.encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: application/xml\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + payload
