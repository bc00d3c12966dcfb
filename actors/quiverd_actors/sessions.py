"""A subscriber's session and the ready frames it is sent: shared by the dispatcher, the
in-process uploader, the consumer connections and the messages that name a session.

    connection, uploader ──attach(Session)──▶ dispatcher[n] ──▶ Session.deliveries
                          OutgoingDelivery frames (LocalDelivery tables for ``local``)

Plain data and the session's window arithmetic only: no actor's code, so any module
may import it (actors do not import each other: tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from quiverd.kernel.bundle import Buffer
from quiverd.kernel.changes import Changes
from quiverd_actors.messages import LocalDelivery


class OutgoingDelivery(msgspec.Struct, frozen=True, kw_only=True):
    """One DELIVERY frame ready for a subscriber's socket: ``parts`` go out in order
    with sendmsg; large payload pieces are views of the mapped segment file (the
    mapping stays alive as long as they do, even after the reader is closed)."""

    shard: int
    segment_seq: int
    bundle_index: int
    parts: tuple[Buffer, ...]


@dataclass(eq=False)
class Session:
    """One consumer connection attached as subscriber ``name`` (shared by all shards)."""

    name: str
    window: int
    # buffer == window: send_nowait never blocks. A socket session gets encoded
    # DELIVERY frames; an in-process one (``local``, the uploader) LocalDelivery tables.
    deliveries: (MemoryObjectSendStream[OutgoingDelivery]
                 | MemoryObjectSendStream[LocalDelivery])
    local: bool = False
    unacked: int = 0
    closed: bool = False
    ended: str = ""  # why the daemon ended this session (e.g. the subscriber was removed)
    scope: anyio.CancelScope | None = None  # the connection's, cancelled by ``end``
    # Every attached shard's Changes: the window is shared, so room freed by an ack
    # on one shard must wake the dispatchers of all shards.
    wakers: list[Changes] = field(default_factory=list)

    def room_freed(self) -> None:
        for changes in self.wakers:
            changes.notify()

    def end(self, reason: str) -> None:
        if not self.ended:
            self.ended = reason
            if self.scope is not None:
                self.scope.cancel()

    @property
    def room(self) -> int:
        return 0 if self.closed else self.window - self.unacked


__all__ = ["OutgoingDelivery", "Session"]
