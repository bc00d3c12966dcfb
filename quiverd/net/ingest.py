"""The ingest listener: producers' and subscribers' Unix socket, one task per connection.

Each accepted connection is judged before it gets a task of its own:

    peer credentials (SO_PEERCRED) not in the allowlist   → ERROR(0, UNAUTHORIZED)
    ingest.max_connections reached                        → ERROR(0, AT_CAPACITY)
    the peer's uid holds max_connections_per_uid already  → ERROR(0, AT_CAPACITY)

and is closed; one peer cannot take every slot and lock the others out. A
refused peer still gets its answer (its HELLO is read first, so it sees the
ERROR rather than a reset), with at most ``max_connections`` refusals in
progress; past that, refused sockets are closed at once.

Admitted connections (``quiverd.net.connection``) share one pending-bytes
budget (``quiverd.net.budget``), each peer uid at most its share of it
(``ingest.max_pending_bytes_per_uid``), and run under the handshake and idle timeouts
(``quiverd.net.reader``). A protocol error gets an ERROR frame with a stable code
and the connection is closed; the daemon and other connections carry on.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
from anyio import CapacityLimiter
from anyio.streams.memory import MemoryObjectSendStream

from quiverd.kernel.config import IngestConfig
from quiverd.kernel.errors import ProtocolError
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import IngestMetrics, Metrics
from quiverd.kernel.schema_cache import SchemaCache
from quiverd.net.budget import ByteBudget
from quiverd.net.buffers import BufferPool
from quiverd.net.connection import Connection, shard_of
from quiverd.net.consumers import SubscriberHub
from quiverd.net.established import EstablishedSchemas
from quiverd.net.jobs import JobService
from quiverd.net.rawsock import BoundSocket, RawListener, RawStream
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode
from quiverd_actors.inbox import Inbox, as_inbox
from quiverd_actors.messages import AppendRequest

_UCRED = struct.Struct("3i")  # pid, uid, gid
# Kernel memory (not our RSS): lets a big frame stream in while we validate the last.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
PEER_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream,
             ConnectionError)
POOL_IDLE_MAX_BYTES = 64 * 1024 * 1024  # 64 bundles of 1 MiB: 4 producers' windows
REFUSAL_READ_S = 1.0  # how long a refused peer gets to send its HELLO before our ERROR
ACCEPT_RETRY_S = 0.1  # out of file descriptors: accept again after this
LOG_REFUSALS_EVERY_S = 1.0  # a flood of refused connections logs one line per second


class IngestServer:
    """Owns the shards' inbox send ends; closes them when the last connection ends."""

    def __init__(self, cfg: IngestConfig, socket_path: Path,
                 inboxes: Sequence[Inbox | MemoryObjectSendStream[AppendRequest]], *,
                 limiter: CapacityLimiter, log: Logger,
                 metrics: IngestMetrics | None = None, bound: BoundSocket | None = None) -> None:
        """``bound``: the socket claimed before the daemon recovered (else bound in serve)."""
        self.cfg, self.path, self.bound = cfg, socket_path, bound
        self.inboxes: list[Inbox] = [as_inbox(i) for i in inboxes]
        self.limiter, self.log = limiter, log
        self.stats = metrics if metrics is not None else IngestMetrics(Metrics())
        self.max_frame = protocol.max_frame_bytes(cfg.max_bundle_bytes)
        # At least one largest frame must fit, in the whole and in each uid's share, or
        # it could never be received. Half by default: see quiverd/net/budget.py.
        total = max(cfg.max_pending_bytes, self.max_frame)
        per_uid = cfg.max_pending_bytes_per_uid or total // 2
        self.budget = ByteBudget(total, min(total, max(per_uid, self.max_frame)))
        # Receive buffers reused after their bundle is answered. Idle and in-flight ones
        # together stay within the pending-bytes budget (the documented RSS bound), and
        # idle ones within POOL_IDLE_MAX_BYTES: a past burst does not pin its peak.
        self.buffers = BufferPool(self.budget.total_bytes, busy=lambda: self.budget.held,
                                  max_idle_bytes=POOL_IDLE_MAX_BYTES)
        self.accepting = anyio.CancelScope()  # cancelled to stop accepting
        self.own_uid, self.own_gid = os.getuid(), os.getgid()
        self.connections: set[Connection] = set()
        self.per_uid: dict[int, int] = {}
        self.conn_uid: dict[Connection, int] = {}  # holds a slot until release_slot
        self.refusing = 0
        self.last_refusal_log = -LOG_REFUSALS_EVERY_S
        self.last_share_log = -LOG_REFUSALS_EVERY_S
        self.hub = SubscriberHub()
        self.schemas = SchemaCache()  # schema-only checks, once per schema (all connections)
        self.jobs: JobService | None = None  # the daemon's staging (commit, abort, status)
        self.lake: dict[str, Any] | None = None  # JOB lake's answer (net/whereabouts.py)
        # lake.schema_mode = "strict" (set by the daemon); None: "evolve", no check at all
        self.established: EstablishedSchemas | None = None
        self.stopping = False

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        """Accept until ``stop()``; then drain connections and close the inboxes."""
        listener = RawListener(self.path, self.cfg.socket_mode, bound=self.bound)
        try:
            async with anyio.create_task_group() as conns:
                with self.accepting:
                    task_status.started()
                    try:
                        while True:
                            stream = await self._accept(listener)
                            if stream is not None:
                                self._admit(stream, conns)
                    finally:
                        listener.close()
        finally:
            with anyio.CancelScope(shield=True):
                for inbox in self.inboxes:
                    await inbox.aclose()

    def stop(self) -> None:
        """Stop accepting and reading; connections still deliver their pending acks."""
        self.stopping = True
        self.accepting.cancel()
        for conn in self.connections:
            conn.reader.stop()

    def authorized(self, uid: int, gid: int) -> bool:
        uids = set(self.cfg.allowed_uids)
        if not uids and not self.cfg.allowed_gids:
            uids = {self.own_uid}  # nothing configured: only our own user may produce
        return uid == 0 or uid in uids or gid in set(self.cfg.allowed_gids)

    async def _accept(self, listener: RawListener) -> RawStream | None:
        try:
            return await listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            # Out of descriptors or memory: connections ending will free some.
            self.log.warning("ingest_accept_failed", error=exc.strerror)
            await anyio.sleep(ACCEPT_RETRY_S)
            return None

    def _admit(self, stream: RawStream, conns: anyio.abc.TaskGroup) -> None:
        """Start the connection's task, or refuse it (synchronously: counts stay exact)."""
        try:
            pid, uid, gid = _UCRED.unpack(stream.sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            stream.sock.close()  # gone before we looked
            return
        refusal = self._refusal(pid, uid, gid)
        if refusal is None:
            self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
            self.stats.connections.inc()
            self.stats.connections_total.inc()
            conns.start_soon(self._connection, stream, uid)
        elif self.refusing < self.cfg.max_connections:
            self.refusing += 1
            conns.start_soon(self._refuse, stream, refusal)
        else:
            stream.sock.close()  # a flood: no answer rather than unbounded work

    def _refusal(self, pid: int, uid: int, gid: int) -> ProtocolError | None:
        who = f"pid {pid} uid {uid} gid {gid}"
        cfg = self.cfg
        if not self.authorized(uid, gid):
            self.stats.unauthorized.inc()
            refusal = ProtocolError(ErrorCode.UNAUTHORIZED,
                                    f"{who} is not in ingest.allowed_uids/allowed_gids")
            self._log_refusal("ingest_unauthorized", who, refusal)
            return refusal
        if self.stats.connections.value >= cfg.max_connections:
            text = (f"quiverd has {int(self.stats.connections.value)} connections, its maximum "
                    "(ingest.max_connections); retry later")
        elif self.per_uid.get(uid, 0) >= cfg.max_connections_per_uid:
            text = (f"uid {uid} already has {self.per_uid[uid]} connections, the maximum per "
                    "peer uid (ingest.max_connections_per_uid); close some or retry later")
        else:
            return None
        self.stats.refused.inc()
        refusal = ProtocolError(ErrorCode.AT_CAPACITY, text)
        self._log_refusal("ingest_connection_refused", who, refusal)
        return refusal

    def _log_refusal(self, event: str, who: str, refusal: ProtocolError) -> None:
        """One line per second at most: a flood of refused peers must not flood the log."""
        now = anyio.current_time()
        if now - self.last_refusal_log >= LOG_REFUSALS_EVERY_S:
            self.last_refusal_log = now
            self.log.warning(event, peer=who, reason=str(refusal),
                             refused_total=int(self.stats.refused.value),
                             unauthorized_total=int(self.stats.unauthorized.value))

    def log_share_full(self, uid: int) -> None:
        """A connection of ``uid`` waits because its uid holds its whole share of the
        pending-bytes budget (stalled or slow frames): once a second at most."""
        now = anyio.current_time()
        if now - self.last_share_log >= LOG_REFUSALS_EVERY_S:
            self.last_share_log = now
            self.log.warning("ingest_uid_share_full", uid=uid,
                             held_bytes=self.budget.by_uid.get(uid, 0),
                             share_bytes=self.budget.per_uid_bytes,
                             pending_bytes=self.budget.held,
                             hint="this peer's frames wait for its own earlier ones; other "
                             "uids are not held up (ingest.max_pending_bytes_per_uid)")

    def budget_contended(self) -> None:
        """A frame started waiting for budget: stalled frames holding what it needs get
        the shorter stall limit (``quiverd.net.reader``). O(connections), once a wait."""
        for conn in self.connections:
            conn.reader.contended()

    async def _refuse(self, stream: RawStream, exc: ProtocolError) -> None:
        try:
            async with stream:
                # Read the client's HELLO first so it is waiting for our answer and sees
                # the error, rather than a reset while it is still writing.
                read_s = min(REFUSAL_READ_S, self.cfg.handshake_timeout_ms / 1000)
                with anyio.move_on_after(read_s), suppress(anyio.EndOfStream):
                    await stream.receive(protocol.SMALL_FRAME_MAX)
                with anyio.move_on_after(REFUSAL_READ_S):
                    await stream.send(protocol.encode_error(0, int(exc.code), str(exc)))
        except PEER_GONE:
            pass
        finally:
            self.refusing -= 1

    async def _connection(self, stream: RawStream, uid: int) -> None:
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            stream.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        conn = Connection(self, stream, uid)
        self.connections.add(conn)
        self.conn_uid[conn] = uid
        if self.stopping:
            conn.reader.stop()
        async with stream:
            try:
                await conn.run()
            except Exception as exc:
                if _peer_gone(exc):
                    return  # its acked data is durable, the rest was never acked
                # A bug in one connection's handling must not take the daemon down;
                # nothing unacked was promised, so closing this connection is safe.
                self.stats.errors.inc()
                self.log.exception("ingest_connection_failed")
                await conn.send_error(0, ProtocolError(
                    ErrorCode.INTERNAL, "internal error on this connection (the daemon "
                    "log has it); resend what was not acked"))
            finally:
                self.release_slot(conn)

    def release_slot(self, conn: Connection) -> None:
        """Give back a connection's slot (once): before its socket closes or shuts down,
        so a peer that sees the close may connect again at once and find room."""
        uid = self.conn_uid.pop(conn, None)
        if uid is None:
            return
        self.connections.discard(conn)
        self.stats.connections.inc(-1)
        left = self.per_uid[uid] - 1
        if left:
            self.per_uid[uid] = left
        else:
            del self.per_uid[uid]


def _peer_gone(exc: BaseException) -> bool:
    """The peer hung up (possibly wrapped in a task group's ExceptionGroup)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_peer_gone(e) for e in exc.exceptions)
    return isinstance(exc, PEER_GONE)


__all__ = ["IngestServer", "shard_of"]
