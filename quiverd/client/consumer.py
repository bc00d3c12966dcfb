"""Consumer side: ``subscribe(path, name)`` yields deliveries to ack or nack.

    async with subscribe(socket_path, "exporter", window=64) as deliveries:
        async for d in deliveries:
            handle(d.id, d.client, d.tables)     # {slot: pyarrow.Table}
            await d.ack()                        # or: await d.nack() → redelivered later
                                                 # or: await d.reject() → never again

Delivery is at least once: ``d.id == (shard, segment_seq, bundle_index)`` lets a
consumer deduplicate. At most ``window`` deliveries are unanswered at a time;
on disconnect the unanswered ones are delivered again on the next subscribe.

``RangedReader`` is the other way to consume (Spark's streaming source uses it): a
blocking client that asks for the bundles of a position range per shard and acks a
prefix when done (STREAM requests, docs/protocol.md "Ranged reads"):

    with RangedReader.connect(socket_path) as r:
        start = r.open("exporter", register=True)["start"]     # {"0": [seg, idx], ...}
        end = r.latest("exporter", start)["end"]
        for shard in end:
            for d in r.fetch("exporter", int(shard), start[shard], end[shard]):
                handle(d)                                      # a protocol Delivery
        r.ack_through("exporter", end)
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Self

import anyio
import anyio.abc
import pyarrow as pa

from quiverd.client.core import StrPath, connect_blocking, tune_socket
from quiverd.kernel.bundle import TxnTag, read_ipc_stream
from quiverd.kernel.errors import DaemonUnreachable, ProtocolError
from quiverd.protocol.codec import (
    Delivery,
    Error,
    ErrorCode,
    FrameDecoder,
    HelloOk,
    Role,
    StreamReply,
    Subscribed,
    encode_ack_bundle,
    encode_hello,
    encode_nack_bundle,
    encode_reject_bundle,
    encode_stream_request,
    encode_subscribe,
    exception_for,
    max_frame_bytes,
)

RECV_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_BUNDLE_BYTES = 64 * 1024 * 1024


class ReceivedBundle:
    """One delivered bundle; answer it exactly once: ``ack()`` (done), ``nack()``
    (deliver again later) or ``reject()`` (done, and never delivered to this subscriber
    again: for a bundle it can never handle; the caller keeps what it needs of it)."""

    def __init__(self, frame: Delivery, conn: _Conn) -> None:
        self._frame, self._conn = frame, conn
        self.answered = False

    @property
    def id(self) -> tuple[int, int, int]:
        f = self._frame
        return (f.shard, f.segment_seq, f.bundle_index)

    @property
    def client(self) -> str:
        return self._frame.client

    @property
    def txn(self) -> TxnTag | None:
        return self._frame.txn

    @property
    def ingestion_ts_ns(self) -> int:
        return self._frame.ingestion_ts_ns

    @property
    def tables(self) -> dict[int, pa.Table]:
        return {s.slot: read_ipc_stream(s.ipc) for s in self._frame.slots}

    async def ack(self) -> None:
        await self._answer(encode_ack_bundle)

    async def nack(self) -> None:
        await self._answer(encode_nack_bundle)

    async def reject(self) -> None:
        if self._conn.version < 2:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"this quiverd speaks protocol version {self._conn.version}, which has no "
                "REJECT_BUNDLE", hint="upgrade the daemon, or nack the bundle")
        await self._answer(encode_reject_bundle)

    async def _answer(self, encode: Any) -> None:
        if self.answered:
            raise RuntimeError(f"bundle {self.id} was already answered (ack, nack or reject)")
        self.answered = True
        await self._conn.send(encode(*self.id))


class _Conn:
    def __init__(self, stream: anyio.abc.SocketStream, decoder: FrameDecoder) -> None:
        self.stream, self.decoder = stream, decoder
        self.lock = anyio.Lock()
        self.version = 1  # agreed in the handshake (HELLO_OK)

    async def send(self, data: bytes) -> None:
        async with self.lock:
            await self.stream.send(data)

    async def frames(self) -> AsyncIterator[Any]:
        while True:
            try:
                data = await self.stream.receive(RECV_BYTES)
            except anyio.EndOfStream:
                return
            for msg in self.decoder.feed(data):
                yield msg


@asynccontextmanager
async def subscribe(path: StrPath, name: str, *, window: int = 64,
                    max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES
                    ) -> AsyncIterator[AsyncIterator[ReceivedBundle]]:
    """Attach as subscriber ``name``; yields an async iterator of deliveries."""
    try:
        stream = await anyio.connect_unix(path)
    except OSError as exc:
        raise DaemonUnreachable.from_os_error(path, exc) from exc
    async with stream:
        tune_socket(stream.extra(anyio.abc.SocketAttribute.raw_socket))
        conn = _Conn(stream, FrameDecoder(max_frame_bytes(max_bundle_bytes), from_client=False))
        await conn.send(encode_hello(Role.SUBSCRIBER))
        frames = conn.frames()
        conn.version = await _expect_handshake(frames)
        await conn.send(encode_subscribe(name, window))
        first = await anext(frames, None)
        if isinstance(first, Error):
            raise exception_for(first)
        if not isinstance(first, Subscribed) or not first.ok:
            raise ConnectionError(f"quiverd did not accept subscriber {name!r}: {first!r}")
        yield _deliveries(frames, conn)


async def _expect_handshake(frames: AsyncIterator[Any]) -> int:
    """The protocol version HELLO_OK agreed."""
    msg = await anext(frames, None)
    if isinstance(msg, Error):
        raise exception_for(msg)
    if msg is None:
        raise ConnectionError("quiverd closed the connection during the handshake")
    if not isinstance(msg, HelloOk):
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"expected HELLO_OK from quiverd, got {type(msg).__name__}")
    return msg.version


async def _deliveries(frames: AsyncIterator[Any], conn: _Conn) -> AsyncIterator[ReceivedBundle]:
    async for msg in frames:
        if isinstance(msg, Delivery):
            yield ReceivedBundle(msg, conn)
        elif isinstance(msg, Error):
            raise exception_for(msg)
        else:
            raise ProtocolError(1, f"unexpected frame from quiverd: {type(msg).__name__}")


PositionJson = Sequence[int]  # [segment_seq, bundle_index]: "after this bundle"


def _leased(body: dict[str, Any], holder: str | None, lease_s: float | None
            ) -> dict[str, Any]:
    if holder is not None:
        body["holder"] = holder
    if lease_s is not None:
        body["lease_s"] = lease_s
    return body


class RangedReader:
    """Blocking STREAM client: one request at a time on one subscriber connection."""

    def __init__(self, sock: socket.socket, decoder: FrameDecoder) -> None:
        self._sock, self._decoder = sock, decoder
        self._next_id = 0
        self._pending: list[Any] = []

    @classmethod
    def connect(cls, path: StrPath, *, timeout: float | None = None) -> RangedReader:
        sock, hello, _ = connect_blocking(path, Role.SUBSCRIBER, timeout=timeout)
        return cls(sock, FrameDecoder(max_frame_bytes(hello.max_bundle_bytes),
                                      from_client=False))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def open(self, subscriber: str, *, register: bool = False, start: str = "earliest",
             holder: str | None = None, lease_s: float | None = None) -> dict[str, Any]:
        """``{"shards", "registered", "start": {shard: position}}``; ``register`` adds an
        unknown subscriber (from ``start``: earliest or latest) instead of refusing it.
        ``holder`` (open, latest, ack_through) takes the subscriber's lease: another
        holder's request is refused (``SubscriberBusy``, an AtCapacity) while it lives."""
        return self._call(_leased({"op": "open", "subscriber": subscriber,
                                   "register": register, "start": start}, holder, lease_s))

    def latest(self, subscriber: str, start: Mapping[str, PositionJson], *,
               cap: Mapping[str, PositionJson] | None = None, max_bundles: int = 0,
               holder: str | None = None, lease_s: float | None = None) -> dict[str, Any]:
        """``{"end": {shard: position}, "bundles": n, "lost": [...]}``: the next range
        after ``start``, and the parts of it retention deleted (docs/protocol.md)."""
        return self._call(_leased({"op": "latest", "subscriber": subscriber,
                                   "start": dict(start),
                                   "cap": None if cap is None else dict(cap),
                                   "max_bundles": max_bundles}, holder, lease_s))

    def ack_through(self, subscriber: str, through: Mapping[str, PositionJson], *,
                    holder: str | None = None, lease_s: float | None = None) -> int:
        """Ack every pending bundle up to ``through`` per shard; returns once durable."""
        reply = self._call(_leased({"op": "ack_through", "subscriber": subscriber,
                                    "through": dict(through)}, holder, lease_s))
        return int(reply["acked"])

    def release(self, subscriber: str, holder: str) -> bool:
        """End ``holder``'s lease of ``subscriber``; False if it held none."""
        reply = self._call({"op": "release", "subscriber": subscriber, "holder": holder})
        return bool(reply["released"])

    def fetch(self, subscriber: str, shard: int, after: PositionJson, through: PositionJson,
              *, client: str | None = None, lost: list[dict[str, Any]] | None = None
              ) -> Iterator[Delivery]:
        """The bundles of ``(after, through]`` on ``shard`` (of ``client`` only, if given),
        oldest first. Consume it to the end before the next request. The parts of the
        range retention deleted are appended to ``lost`` (if given) at the end."""
        request_id = self._send({"op": "fetch", "subscriber": subscriber, "shard": shard,
                                 "after": list(after), "through": list(through),
                                 "client": client})
        while True:
            msg = self._receive()
            if isinstance(msg, Delivery):
                yield msg
                continue
            body = self._check(msg, request_id)
            if lost is not None:
                lost.extend(body.get("lost", ()))
            return

    def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        request_id = self._send(body)
        msg = self._receive()
        return self._check(msg, request_id)

    def _send(self, body: dict[str, Any]) -> int:
        self._next_id = self._next_id % 0xFFFF_FFFF + 1
        self._sock.sendall(encode_stream_request(self._next_id, body))
        return self._next_id

    def _receive(self) -> Any:
        while not self._pending:
            data = self._sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionError("quiverd closed the connection")
            self._pending.extend(self._decoder.feed(data))
        return self._pending.pop(0)

    @staticmethod
    def _check(msg: Any, request_id: int) -> dict[str, Any]:
        if isinstance(msg, Error):
            raise exception_for(msg)
        if not isinstance(msg, StreamReply) or msg.request_id != request_id:
            raise ProtocolError(1, f"unexpected frame from quiverd: {msg!r:.200}")
        return msg.body
