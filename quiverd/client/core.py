"""What quiverd's two producer clients share: request bookkeeping and encoding.

``Requests`` is sans-IO: it hands out request ids, consumes ACK/JOB_OK/ERROR
messages and records one outcome per request (a BUNDLE expects an ACK, a JOB a
JOB_OK: one id space, one window), so ``client.AsyncClient`` and
``client.Client`` differ only in how they wait. Also here: turning tables into
BUNDLE frames and reading Arrow/Parquet files batch by batch for ``quiverd send``.
"""

from __future__ import annotations

import socket
from collections.abc import Collection
from dataclasses import dataclass
from os import PathLike
from typing import TypeAlias

import pyarrow as pa

from quiverd.kernel.bundle import USER_SLOTS, TxnTag, encode_ipc_stream
from quiverd.kernel.errors import DaemonUnreachable, ProtocolError
from quiverd.kernel.names import reserved_column_problem
from quiverd.protocol.codec import (
    CLOSES_CONNECTION,
    REPLY_FRAME_MAX,
    Ack,
    Error,
    ErrorCode,
    FrameDecoder,
    HelloOk,
    JobReply,
    Message,
    Role,
    encode_bundle,
    encode_hello,
    exception_for,
)
from quiverd.protocol.frames import MAX_REQUEST_ID, nbytes

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class IpcPayload:
    """One slot's data already encoded as an Arrow IPC stream: sent byte for byte
    (a producer that checksums what it sends encodes once, here)."""

    ipc: Buffer
    rows: int


Data: TypeAlias = "pa.Table | pa.RecordBatch | IpcPayload"
SendData: TypeAlias = "Data | dict[int, Data]"
# send_many items: data for slot 0 or a slot dict, optionally paired with a txn tag.
SendItem: TypeAlias = "SendData | tuple[SendData, TxnTag | None]"
StrPath: TypeAlias = "str | PathLike[str]"
Reply: TypeAlias = "Ack | JobReply"
Outcome: TypeAlias = "Ack | JobReply | BaseException"

HANDSHAKE_RECV_BYTES = 64 * 1024  # HELLO_OK (and what may follow it) is small
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024  # NOTES: 4 MiB buffers nearly double Unix socket GB/s


class Requests:
    """Request ids in flight and their outcomes (an Ack or the exception to raise)."""

    def __init__(self) -> None:
        self._next_id = 1
        self._inflight: dict[int, type[Ack] | type[JobReply]] = {}  # id -> reply expected
        self._outcomes: dict[int, Outcome] = {}
        self._forgotten: set[int] = set()  # waiter gone: drop the outcome when it comes
        self.broken: BaseException | None = None  # set once the connection is unusable

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken

    def next_id(self) -> int:
        request_id = self._next_id
        self._next_id = request_id % MAX_REQUEST_ID + 1  # 0 is reserved: wrap to 1
        return request_id

    @property
    def inflight(self) -> int:
        """Requests sent and not answered yet (BUNDLE and JOB alike)."""
        return len(self._inflight)

    def inflight_ids(self) -> list[int]:
        return list(self._inflight)

    def start(self, request_id: int, expect: type[Ack] | type[JobReply] = Ack) -> None:
        """``request_id`` is about to be sent; an ``expect`` (or ERROR) will answer it."""
        self.check_usable()
        self._inflight[request_id] = expect

    def is_done(self, request_id: int) -> bool:
        return request_id in self._outcomes

    def failed_since(self, request_ids: Collection[int]) -> bool:
        """Did any of ``request_ids`` fail, or the connection break?"""
        if self.broken is not None:
            return True
        return any(isinstance(self._outcomes.get(r), BaseException) for r in request_ids)

    def take(self, request_id: int) -> Ack:
        """The bundle's Ack, or raise its error (it must be done)."""
        outcome = self._outcomes.pop(request_id)
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, Ack), "take() of a JOB request: use take_reply()"
        return outcome

    def take_reply(self, request_id: int) -> JobReply:
        """The JOB's reply, or raise its error (it must be done)."""
        outcome = self._outcomes.pop(request_id)
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, JobReply), "take_reply() of a BUNDLE: use take()"
        return outcome

    def forget(self, request_id: int) -> None:
        """Nobody will ``take`` this request's outcome."""
        if self._outcomes.pop(request_id, None) is None and request_id in self._inflight:
            self._forgotten.add(request_id)

    def on_message(self, msg: Message) -> list[int]:
        """Record a server frame; returns the request ids it resolved."""
        if isinstance(msg, Ack | JobReply):
            return self._resolve(msg.request_id, msg)
        if isinstance(msg, Error) and msg.request_id == 0:
            return self.fail(exception_for(msg))
        if isinstance(msg, Error):
            if msg.code in CLOSES_CONNECTION:
                # The server hangs up after this one: later sends would only fail.
                self.broken = ConnectionError(f"quiverd closed the connection: {msg.message}")
            return self._resolve(msg.request_id, exception_for(msg))
        bad = ProtocolError(ErrorCode.MALFORMED, f"unexpected {type(msg).__name__} from server")
        return self.fail(bad)

    def fail_some(self, request_ids: Collection[int], exc: BaseException) -> list[int]:
        """These requests in flight fail with ``exc`` (the connection goes on)."""
        failed = [r for r in request_ids if r in self._inflight]
        for request_id in failed:
            del self._inflight[request_id]
            self._store(request_id, exc)
        return failed

    def fail(self, exc: BaseException) -> list[int]:
        """The connection is unusable: every request in flight fails with ``exc``."""
        if self.broken is None:
            self.broken = exc
        resolved = list(self._inflight)
        for request_id in resolved:
            self._store(request_id, exc)
        self._inflight.clear()
        return resolved

    def _resolve(self, request_id: int, outcome: Outcome) -> list[int]:
        expect = self._inflight.get(request_id)
        if expect is None:
            bad = ProtocolError(
                ErrorCode.MALFORMED, f"server answered request {request_id}, which is not in flight"
            )
            return self.fail(bad)
        if not isinstance(outcome, expect | BaseException):
            bad = ProtocolError(ErrorCode.MALFORMED, f"server answered request {request_id} "
                                f"with {type(outcome).__name__}, not {expect.__name__}")
            return self.fail(bad)
        del self._inflight[request_id]
        self._store(request_id, outcome)
        return [request_id]

    def _store(self, request_id: int, outcome: Outcome) -> None:
        if request_id in self._forgotten:
            self._forgotten.discard(request_id)
        else:
            self._outcomes[request_id] = outcome


def encode_request(
    request_id: int, data: SendData, client: str, txn: TxnTag | None, server: HelloOk,
    producer_seq: int = 0,
) -> list[Buffer]:
    """A BUNDLE frame for ``data`` (a table/batch/payload goes to slot 0)."""
    tables = {0: data} if isinstance(data, pa.Table | pa.RecordBatch | IpcPayload) else data
    if not tables:
        raise ValueError("a bundle needs at least one slot")
    for slot in tables:
        if not 0 <= slot < USER_SLOTS:
            raise ValueError(
                f"slot {slot} outside 0..{USER_SLOTS - 1} (slot {USER_SLOTS} holds bundle metadata)"
            )
    for slot, t in tables.items():
        # The daemon refuses these (and closes the connection): cheaper to say so here.
        # An IpcPayload's schema is not decoded for this; the daemon still checks it.
        problem = None if isinstance(t, IpcPayload) else reserved_column_problem(t.schema.names)
        if problem is not None:
            raise ProtocolError(ErrorCode.MALFORMED, f"slot {slot}: {problem}")
    payloads = {slot: t.ipc if isinstance(t, IpcPayload) else encode_ipc_stream(t)
                for slot, t in tables.items()}
    size = sum(nbytes(p) for p in payloads.values())
    if size > server.max_bundle_bytes:
        # Refused here so the server never has to cut the connection over it.
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"bundle of {size} payload bytes exceeds the server's max_bundle_bytes "
            f"{server.max_bundle_bytes}; send smaller batches",
        )
    rows = {slot: t.rows if isinstance(t, IpcPayload) else t.num_rows
            for slot, t in tables.items()}
    return encode_bundle(request_id, client, payloads, rows, txn, producer_seq)


def split_item(item: SendItem) -> tuple[SendData, TxnTag | None]:
    if isinstance(item, tuple):
        return item
    return item, None


def handshake_result(messages: list[Message]) -> HelloOk:
    """The server's first answer: HELLO_OK, or an ERROR raised as its exception."""
    first = messages[0]
    if isinstance(first, Error):
        raise exception_for(first)
    if not isinstance(first, HelloOk) or len(messages) > 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"expected HELLO_OK, got {type(first).__name__}")
    return first


def connect_blocking(path: StrPath, role: Role, *, timeout: float | None,
                     producer: str = "", incarnation: int = 0,
                     ) -> tuple[socket.socket, HelloOk, FrameDecoder]:
    """A blocking connection that said HELLO as ``role`` and got HELLO_OK: the socket,
    the server's HELLO_OK and the decoder that read it (more frames may follow in it).
    Refused or unreachable: the error raised, the socket closed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        tune_socket(sock)
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise DaemonUnreachable.from_os_error(path, exc) from exc
        sock.sendall(encode_hello(role, producer=producer, incarnation=incarnation))
        decoder = FrameDecoder(REPLY_FRAME_MAX, from_client=False)
        while True:
            data = sock.recv(HANDSHAKE_RECV_BYTES)
            if not data:
                raise ConnectionError("quiverd closed the connection during the handshake")
            messages = decoder.feed(data)
            if messages:
                return sock, handshake_result(messages), decoder
    except BaseException:
        sock.close()
        raise


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


