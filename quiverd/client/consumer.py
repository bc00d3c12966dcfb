"""Consumer side: ``subscribe(path, name)`` yields deliveries to ack or nack.

    async with subscribe(socket_path, "exporter", window=64) as deliveries:
        async for d in deliveries:
            handle(d.id, d.client, d.tables)     # {slot: pyarrow.Table}
            await d.ack()                        # or: await d.nack() → redelivered later

Delivery is at least once: ``d.id == (shard, segment_seq, bundle_index)`` lets a
consumer deduplicate. At most ``window`` deliveries are unanswered at a time;
on disconnect the unanswered ones are delivered again on the next subscribe.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pyarrow as pa

from quiverd.client.core import StrPath, tune_socket
from quiverd.kernel.bundle import TxnTag, read_ipc_stream
from quiverd.kernel.errors import DaemonUnreachable, ProtocolError
from quiverd.protocol.codec import (
    Delivery,
    Error,
    FrameDecoder,
    Role,
    Subscribed,
    encode_ack_bundle,
    encode_hello,
    encode_nack_bundle,
    encode_subscribe,
    exception_for,
    max_frame_bytes,
)

RECV_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_BUNDLE_BYTES = 64 * 1024 * 1024


class ReceivedBundle:
    """One delivered bundle; answer it exactly once with ``ack()`` or ``nack()``."""

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

    async def _answer(self, encode: Any) -> None:
        if self.answered:
            raise RuntimeError(f"bundle {self.id} was already acked or nacked")
        self.answered = True
        await self._conn.send(encode(*self.id))


class _Conn:
    def __init__(self, stream: anyio.abc.SocketStream, decoder: FrameDecoder) -> None:
        self.stream, self.decoder = stream, decoder
        self.lock = anyio.Lock()

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
        await _expect_handshake(frames)
        await conn.send(encode_subscribe(name, window))
        first = await anext(frames, None)
        if isinstance(first, Error):
            raise exception_for(first)
        if not isinstance(first, Subscribed) or not first.ok:
            raise ConnectionError(f"quiverd did not accept subscriber {name!r}: {first!r}")
        yield _deliveries(frames, conn)


async def _expect_handshake(frames: AsyncIterator[Any]) -> None:
    msg = await anext(frames, None)
    if isinstance(msg, Error):
        raise exception_for(msg)
    if msg is None:
        raise ConnectionError("quiverd closed the connection during the handshake")


async def _deliveries(frames: AsyncIterator[Any], conn: _Conn) -> AsyncIterator[ReceivedBundle]:
    async for msg in frames:
        if isinstance(msg, Delivery):
            yield ReceivedBundle(msg, conn)
        elif isinstance(msg, Error):
            raise exception_for(msg)
        else:
            raise ProtocolError(1, f"unexpected frame from quiverd: {type(msg).__name__}")
