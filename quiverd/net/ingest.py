"""The ingest listener: producers' Unix socket, one task per connection.

Per connection: check peer credentials (SO_PEERCRED) against the allowlist,
handshake, then read BUNDLE frames, validate them (end check, Arrow IPC, row
counts) in one worker-thread hop per read, route each to its shard by a stable
hash of the client name (one client's order is kept) and write each ack back
as the shard's WAL writer reports durability. At most
``max_inflight_per_connection`` bundles are unacknowledged per connection: a
full window stops reading, which is the producer's backpressure.

A protocol error gets an ERROR frame with a stable code and the connection is
closed; the daemon and other connections carry on.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectSendStream

from actors.messages import AppendRequest, ProducerReply
from quiverd.kernel.bundle import Bundle, Slot
from quiverd.kernel.config import IngestConfig
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import ProtocolError
from quiverd.kernel.logs import Logger
from quiverd.net.consumers import SubscriberHub, serve_subscriber
from quiverd.net.rawsock import RawListener, RawStream
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode

RECV_BYTES = 4 * 1024 * 1024
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
_UCRED = struct.Struct("3i")  # pid, uid, gid


def shard_of(client: str, shards: int) -> int:
    """Stable across restarts and Python versions (unlike hash())."""
    return crc32c(client.encode()) % shards


@dataclass
class IngestStats:
    connections: int = 0
    connections_total: int = 0
    bundles: int = 0
    errors: int = 0
    unauthorized: int = 0


class IngestServer:
    """Owns the shards' inbox send ends; closes them when the last connection ends."""

    def __init__(self, cfg: IngestConfig, socket_path: Path,
                 inboxes: list[MemoryObjectSendStream[AppendRequest]], *,
                 limiter: CapacityLimiter, log: Logger) -> None:
        self.cfg, self.path, self.inboxes = cfg, socket_path, inboxes
        self.limiter, self.log = limiter, log
        self.stats = IngestStats()
        self.max_frame = protocol.max_frame_bytes(cfg.max_bundle_bytes)
        self.accepting = anyio.CancelScope()  # cancelled to stop accepting and reading
        self.own_uid, self.own_gid = os.getuid(), os.getgid()
        self.conn_slots = anyio.Semaphore(cfg.max_connections)
        self.read_scopes: set[anyio.CancelScope] = set()
        self.hub = SubscriberHub()
        self.stopping = False

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        """Accept until ``stop()``; then drain connections and close the inboxes."""
        listener = RawListener(self.path, self.cfg.socket_mode)
        try:
            async with anyio.create_task_group() as conns:
                with self.accepting:
                    task_status.started()
                    try:
                        while True:
                            await self.conn_slots.acquire()
                            stream = await listener.accept()
                            conns.start_soon(self._connection, stream)
                    finally:
                        listener.close()
        finally:
            with anyio.CancelScope(shield=True):
                for inbox in self.inboxes:
                    await inbox.aclose()
            self.path.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop accepting and reading; connections still deliver their pending acks."""
        self.stopping = True
        self.accepting.cancel()
        for scope in self.read_scopes:
            scope.cancel()

    async def _connection(self, stream: RawStream) -> None:
        self.stats.connections += 1
        self.stats.connections_total += 1
        try:
            async with stream:
                await _Connection(self, stream).run()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            pass  # peer went away; its acked data is durable, the rest was never acked
        except BaseExceptionGroup as group:
            # The connection's task group wraps a peer hanging up; anything else in
            # it is logged, and cancellation is re-raised untouched.
            _, rest = group.split((anyio.BrokenResourceError, anyio.ClosedResourceError,
                                   ConnectionError))
            if rest is not None:
                bugs, cancels = rest.split(Exception)
                if cancels is not None:
                    raise
                self.stats.errors += 1
                self.log.error("ingest_connection_failed", error=repr(bugs))
        except Exception:
            # A bug in one connection's handling must not take the daemon down;
            # nothing unacked was promised, so closing this connection is safe.
            self.stats.errors += 1
            self.log.exception("ingest_connection_failed")
        finally:
            self.stats.connections -= 1
            self.conn_slots.release()

    def authorized(self, sock: socket.socket) -> tuple[bool, str]:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _UCRED.size))
        uids = set(self.cfg.allowed_uids)
        if not uids and not self.cfg.allowed_gids:
            uids = {self.own_uid}  # nothing configured: only our own user may produce
        ok = uid == 0 or uid in uids or gid in set(self.cfg.allowed_gids)
        return ok, f"pid {pid} uid {uid} gid {gid}"


class _Connection:
    def __init__(self, server: IngestServer, stream: RawStream) -> None:
        self.server, self.stream = server, stream
        self.decoder = protocol.FrameDecoder(server.max_frame)
        window = server.cfg.max_inflight_per_connection
        self.window = anyio.Semaphore(window)
        self.replies, self.reply_rx = anyio.create_memory_object_stream[ProducerReply](window)

    async def run(self) -> None:
        sock = self.stream.sock
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        ok, who = self.server.authorized(sock)
        if not ok:
            self.server.stats.unauthorized += 1
            self.server.log.warning("ingest_unauthorized", peer=who)
            # Read the client's HELLO first so it is waiting for our answer and sees
            # the error, rather than a reset while it is still writing.
            with anyio.move_on_after(1):
                await self.stream.receive(protocol.SMALL_FRAME_MAX)
            await self._fatal(ProtocolError(ErrorCode.UNAUTHORIZED,
                                            f"{who} is not in ingest.allowed_uids/allowed_gids"))
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_replies)
            async with self.replies:
                try:
                    with anyio.CancelScope() as scope:
                        self.server.read_scopes.add(scope)
                        if self.server.stopping:
                            scope.cancel()
                        try:
                            await self._read_loop()
                        finally:
                            self.server.read_scopes.discard(scope)
                except ProtocolError as exc:
                    self.server.stats.errors += 1
                    self.server.log.info("ingest_protocol_error", code=int(exc.code),
                                         error=str(exc))
                    await self._send_error(0, exc)
                    tg.cancel_scope.cancel()
                    return
                # Wait for every in-flight bundle's ack before closing our end.
                for _ in range(self.server.cfg.max_inflight_per_connection):
                    await self.window.acquire()
                if self.server.stopping:
                    text = ("quiverd is shutting down; unacknowledged deliveries are "
                            "delivered again after the restart"
                            if self.decoder.role == protocol.Role.SUBSCRIBER else
                            "quiverd is shutting down; every bundle acked on this connection "
                            "is durable, resend the rest after restart")
                    await self._send_error(0, ProtocolError(ErrorCode.SHUTTING_DOWN, text))

    async def _receive_frames(self) -> list[protocol.Message] | None:
        """recv_into the decoder's own buffer: large payloads land in their frame
        buffer directly, with no intermediate copy. None at end of stream."""
        n = await self.stream.receive_into(self.decoder.get_buffer())
        if n == 0:
            if self.decoder.buffered:
                raise ProtocolError(ErrorCode.MALFORMED, "connection ended inside a frame")
            return None
        return self.decoder.buffer_updated(n)

    async def _read_loop(self) -> None:
        hello_done = False
        while True:
            frames = await self._receive_frames()
            if frames is None:
                return
            if not frames:
                continue
            if not hello_done:
                hello_done = await self._handshake(frames.pop(0))
                if self.decoder.role == protocol.Role.SUBSCRIBER:
                    await serve_subscriber(self.server.hub, self.stream, self.decoder, frames,
                                           self.server.log)
                    return
            bundles = [f for f in frames if isinstance(f, protocol.BundleFrame)]
            if len(bundles) != len(frames):
                raise ProtocolError(ErrorCode.MALFORMED, "only BUNDLE frames may follow HELLO on "
                                    "a producer connection")
            if bundles:
                await self._submit(bundles)

    async def _handshake(self, frame: protocol.Message) -> bool:
        if not isinstance(frame, protocol.Hello):
            raise ProtocolError(ErrorCode.MALFORMED, "the first frame must be HELLO")
        version = protocol.negotiate(frame)  # raises UNSUPPORTED_VERSION
        await self.stream.send(protocol.encode_hello_ok(
            version=version, max_bundle_bytes=self.server.cfg.max_bundle_bytes,
            max_inflight=self.server.cfg.max_inflight_per_connection))
        return True

    async def _submit(self, frames: list[protocol.BundleFrame]) -> None:
        validated = await anyio.to_thread.run_sync(_validate_all, frames,
                                                   self.server.cfg.max_bundle_bytes,
                                                   limiter=self.server.limiter)
        shards = len(self.server.inboxes)
        for frame, slots in validated:
            await self.window.acquire()
            if isinstance(slots, ProtocolError):
                self.window.release()
                raise slots
            bundle = Bundle(client=frame.client, slots=slots, txn=frame.txn)
            req = AppendRequest(request_id=frame.request_id, bundle=bundle, reply=self.replies)
            self.server.stats.bundles += 1
            await self.server.inboxes[shard_of(frame.client, shards)].send(req)

    async def _write_replies(self) -> None:
        """One socket write per group of replies (a group commit acks many at once)."""
        async with self.reply_rx:
            async for reply in self.reply_rx:
                replies = [reply]
                while True:
                    try:
                        replies.append(self.reply_rx.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                frames = b"".join(_encode_reply(r) for r in replies)
                for _ in replies:
                    self.window.release()
                await self.stream.send(frames)

    async def _send_error(self, request_id: int, exc: ProtocolError) -> None:
        with anyio.move_on_after(1, shield=True):
            await self.stream.send(protocol.encode_error(request_id, int(exc.code), str(exc)))

    async def _fatal(self, exc: ProtocolError) -> None:
        await self._send_error(0, exc)


def _encode_reply(reply: ProducerReply) -> bytes:
    if isinstance(reply, protocol.Ack):
        return protocol.encode_ack(reply.request_id, reply.shard, reply.sequence)
    return protocol.encode_error(reply.request_id, reply.code, reply.message)


def _validate_all(frames: list[protocol.BundleFrame], max_bundle_bytes: int
                  ) -> list[tuple[protocol.BundleFrame, tuple[Slot, ...] | ProtocolError]]:
    out: list[tuple[protocol.BundleFrame, tuple[Slot, ...] | ProtocolError]] = []
    for frame in frames:
        try:
            out.append((frame, protocol.validate_bundle(frame, max_bundle_bytes=max_bundle_bytes)))
        except ProtocolError as exc:
            out.append((frame, exc))
            break
    return out


__all__ = ["IngestServer", "shard_of"]
