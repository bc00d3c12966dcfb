"""A subscriber connection: SUBSCRIBE, then DELIVERY frames out, ACK/NACK_BUNDLE in.

Runs on the ingest socket after a HELLO with role SUBSCRIBER (docs/protocol.md).
One ``Session`` is attached to every shard's dispatcher; the window (bundles
delivered but not yet acked or nacked) is shared across shards. When the
connection ends, every unacknowledged delivery goes back to pending and is
delivered again to the next session of that subscriber.

The acks and nacks of one read batch go to each shard's dispatcher as one
``Feedback`` message; the dispatcher applies them in its own task.
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from quiverd.acks import format as fmt
from quiverd.kernel.errors import ProtocolError
from quiverd.kernel.logs import Logger
from quiverd.net.rawsock import RawStream
from quiverd.net.reader import FrameReader
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode
from quiverd_actors.dispatcher import Dispatcher, OutgoingDelivery, Session
from quiverd_actors.messages import Feedback

MAX_WINDOW = 4096


class SubscriberHub:
    """What subscriber connections need from the daemon: the shards' dispatchers."""

    def __init__(self) -> None:
        self.dispatchers: list[Dispatcher] = []  # one per shard, set once they run

    def known(self, name: str) -> bool:
        return bool(self.dispatchers) and all(name in d.state.registry
                                              for d in self.dispatchers)


async def serve_subscriber(hub: SubscriberHub, reader: FrameReader,
                           pending: list[protocol.Message], log: Logger) -> None:
    """Handle one subscriber connection until it closes; raises ProtocolError on misuse.

    SUBSCRIBE must arrive within the handshake timeout. Once attached, the
    connection is never closed for being quiet: it waits for data the daemon owes
    it, and the protocol gives a subscriber with nothing unacked nothing to send.
    Only a frame stalled half-way (``ingest.idle_timeout_ms``) or a peer that reads
    nothing of a DELIVERY for that long ends it.
    """
    frames = list(pending)
    while not frames:
        got = await reader.receive("handshake", "SUBSCRIBE")
        if got is None:
            return
        frames = got
    first = frames.pop(0)
    if not isinstance(first, protocol.Subscribe):
        raise ProtocolError(ErrorCode.MALFORMED, "a subscriber must send SUBSCRIBE first")
    if not hub.known(first.name):
        raise ProtocolError(ErrorCode.UNKNOWN_SUBSCRIBER,
                            f"no subscriber named {first.name!r}; register it with "
                            f"`quiverd subscribers add {first.name}`")
    window = max(1, min(first.window or 64, MAX_WINDOW))
    deliveries_tx, deliveries_rx = anyio.create_memory_object_stream[OutgoingDelivery](window)
    session = Session(name=first.name, window=window, deliveries=deliveries_tx)
    await reader.stream.send(protocol.encode_subscribed(True))
    log.info("subscriber_attached", subscriber=first.name, window=window)
    for d in hub.dispatchers:
        d.attach(session)
    error: ProtocolError | None = None
    try:
        async with anyio.create_task_group() as tg:
            session.scope = tg.cancel_scope
            tg.start_soon(_write_deliveries, reader.stream, deliveries_rx)
            try:
                await _read_feedback(hub, reader, session, frames)
            except ProtocolError as exc:
                error = exc  # raised below, not wrapped in the task group's ExceptionGroup
            tg.cancel_scope.cancel()
        if error is not None:
            raise error
        if session.ended:
            raise ProtocolError(ErrorCode.UNKNOWN_SUBSCRIBER, session.ended)
    finally:
        for d in hub.dispatchers:
            d.detach(session)
        deliveries_tx.close()
        log.info("subscriber_detached", subscriber=first.name)


async def _read_feedback(hub: SubscriberHub, reader: FrameReader, session: Session,
                         frames: list[protocol.Message]) -> None:
    while True:
        await _send_feedback(hub, session, frames)
        got = await reader.receive("busy")
        if got is None:
            return
        frames = got


async def _send_feedback(hub: SubscriberHub, session: Session,
                         frames: list[protocol.Message]) -> None:
    """One read batch of ACK_BUNDLE / NACK_BUNDLE frames as one Feedback per shard.

    A frame that is neither, or names no shard, ends the connection (ProtocolError)
    after the outcomes before it are sent: the subscriber did send those."""
    by_shard: dict[int, list[tuple[int, int, int]]] = {}
    error: ProtocolError | None = None
    for frame in frames:
        if not isinstance(frame, protocol.AckBundle | protocol.NackBundle):
            error = ProtocolError(ErrorCode.MALFORMED,
                                  "only ACK_BUNDLE / NACK_BUNDLE may follow SUBSCRIBE")
            break
        if not 0 <= frame.shard < len(hub.dispatchers):
            error = ProtocolError(ErrorCode.MALFORMED, f"no shard {frame.shard}")
            break
        outcome = fmt.ACK if isinstance(frame, protocol.AckBundle) else fmt.NACK
        by_shard.setdefault(frame.shard, []).append(
            (frame.segment_seq, frame.bundle_index, outcome))
    for shard, outcomes in by_shard.items():
        await hub.dispatchers[shard].post(Feedback(session=session, outcomes=tuple(outcomes)))
    if error is not None:
        raise error


async def _write_deliveries(stream: RawStream,
                            deliveries: MemoryObjectReceiveStream[OutgoingDelivery]) -> None:
    # Frames come encoded from the dispatcher's worker hop (CRC included): the event
    # loop only hands their pieces, slices of the segment files, to sendmsg.
    async with deliveries:
        async for d in deliveries:
            await stream.send_parts(list(d.parts))
