"""A subscriber connection: SUBSCRIBE, then DELIVERY frames out, ACK/NACK/REJECT_BUNDLE in;
or STREAM requests, each answered in turn (ranged reads, ``serve_stream``).

Runs on the ingest socket after a HELLO with role SUBSCRIBER (docs/protocol.md).
One ``Session`` is attached to every shard's dispatcher; the window (bundles
delivered but not yet acked or nacked) is shared across shards. When the
connection ends, every unacknowledged delivery goes back to pending and is
delivered again to the next session of that subscriber.

The acks and nacks of one read batch go to each shard's dispatcher as one
``Feedback`` message; the dispatcher applies them in its own task.

A connection whose first frame is STREAM is a ranged reader (Spark's streaming
source): it asks for the bundles of a position range, ``(after, through]`` per
shard, and acks a prefix when done (``quiverd_actors.ranges``). Nothing is pushed
and nothing is in flight: the subscriber's unacked bundles simply stay pending, so
a range can be read again after a crash and holds the same bundles. Parts of a range
retention deleted are named in the answers (``lost``), and one reader (one query's
driver) holds a subscriber at a time (``quiverd.net.stream_leases``).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any, Literal

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream

from quiverd.acks import format as fmt
from quiverd.acks.registry import SubscriberExists
from quiverd.kernel.errors import ProtocolError, QuiverError, ShuttingDown
from quiverd.kernel.logs import Logger
from quiverd.kernel.names import validate_subscriber_name
from quiverd.net.jobs import held_at
from quiverd.net.rawsock import RawStream
from quiverd.net.reader import FrameReader
from quiverd.net.stream_checks import check as check_numbers
from quiverd.net.stream_leases import DEFAULT_LEASE_S, StreamLeases, holder_text
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode
from quiverd_actors import ranges
from quiverd_actors.dispatcher import Dispatcher, OutgoingDelivery, Session
from quiverd_actors.messages import Feedback

MAX_WINDOW = 4096
_UCRED = struct.Struct("3i")  # pid, uid, gid (SO_PEERCRED)


class SubscriberHub:
    """What subscriber connections need from the daemon: the shards' dispatchers."""

    def __init__(self) -> None:
        self.dispatchers: list[Dispatcher] = []  # one per shard, set once they run
        self.leases = StreamLeases()  # which query reads each subscriber (STREAM)
        # Why a subscriber is gone if it was retired (runtime.retirement), else None.
        self.refusal: Callable[[str], str | None] = lambda name: None

    def known(self, name: str) -> bool:
        return bool(self.dispatchers) and all(name in d.state.registry
                                              for d in self.dispatchers)

    def unknown(self, name: str) -> ProtocolError:
        """The error for a name not registered: the retirement's reason if it was retired."""
        text = self.refusal(name) or (f"no subscriber named {name!r}; register it with "
                                      f"`quiverd subscribers add {name}`")
        return ProtocolError(ErrorCode.UNKNOWN_SUBSCRIBER, text)


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
    if isinstance(first, protocol.StreamRequest):
        await serve_stream(hub, reader, [first, *frames], log)
        return
    if not isinstance(first, protocol.Subscribe):
        raise ProtocolError(ErrorCode.MALFORMED, "a subscriber must send SUBSCRIBE first")
    if not hub.known(first.name):
        raise hub.unknown(first.name)
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
            raise ProtocolError(ErrorCode.UNKNOWN_SUBSCRIBER,
                                hub.refusal(first.name) or session.ended)
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


_OUTCOME_OF: dict[type, int] = {protocol.AckBundle: fmt.ACK, protocol.NackBundle: fmt.NACK,
                                protocol.RejectBundle: fmt.REJECTED}


async def _send_feedback(hub: SubscriberHub, session: Session,
                         frames: list[protocol.Message]) -> None:
    """One read batch of ACK_BUNDLE / NACK_BUNDLE / REJECT_BUNDLE frames as one Feedback
    per shard.

    Any other frame, or one naming no shard, ends the connection (ProtocolError)
    after the outcomes before it are sent: the subscriber did send those."""
    by_shard: dict[int, list[tuple[int, int, int]]] = {}
    error: ProtocolError | None = None
    for frame in frames:
        if not isinstance(frame, protocol.AckBundle | protocol.NackBundle
                          | protocol.RejectBundle):
            error = ProtocolError(ErrorCode.MALFORMED, "only ACK_BUNDLE / NACK_BUNDLE / "
                                  "REJECT_BUNDLE may follow SUBSCRIBE")
            break
        if not 0 <= frame.shard < len(hub.dispatchers):
            error = ProtocolError(ErrorCode.MALFORMED, f"no shard {frame.shard}")
            break
        by_shard.setdefault(frame.shard, []).append(
            (frame.segment_seq, frame.bundle_index, _OUTCOME_OF[type(frame)]))
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


# ---- ranged reads: STREAM requests (docs/protocol.md "Ranged reads") ---------------------

class _Open(msgspec.Struct, tag_field="op", tag="open",
                 forbid_unknown_fields=True):
    subscriber: str
    register: bool = False
    start: Literal["earliest", "latest"] = "earliest"
    holder: str | None = None  # the query taking the subscriber's lease (stream_leases)
    lease_s: float = DEFAULT_LEASE_S


class _Latest(msgspec.Struct, tag_field="op", tag="latest",
                 forbid_unknown_fields=True):
    subscriber: str
    start: dict[str, tuple[int, int]]
    cap: dict[str, tuple[int, int]] | None = None
    max_bundles: int = 0
    holder: str | None = None
    lease_s: float = DEFAULT_LEASE_S


class _Fetch(msgspec.Struct, tag_field="op", tag="fetch",
                 forbid_unknown_fields=True):
    subscriber: str
    shard: int
    after: tuple[int, int]
    through: tuple[int, int]
    client: str | None = None


class _AckThrough(msgspec.Struct, tag_field="op", tag="ack_through",
                 forbid_unknown_fields=True):
    subscriber: str
    through: dict[str, tuple[int, int]]
    holder: str | None = None
    lease_s: float = DEFAULT_LEASE_S


class _Release(msgspec.Struct, tag_field="op", tag="release",
               forbid_unknown_fields=True):
    subscriber: str
    holder: str


_Request = _Open | _Latest | _Fetch | _AckThrough | _Release


async def serve_stream(hub: SubscriberHub, reader: FrameReader,
                       frames: list[protocol.Message], log: Logger) -> None:
    """Answer STREAM requests one at a time until the peer closes (ProtocolError on
    misuse). A request that fails for a reason of its own gets ERROR with its id and
    the connection stays; bad bytes or an unknown subscriber close it."""
    while True:
        for frame in frames:
            if not isinstance(frame, protocol.StreamRequest):
                raise ProtocolError(ErrorCode.MALFORMED,
                                    "only STREAM frames may follow a STREAM request")
            await _answer(hub, reader, frame, log)
        got = await reader.receive("idle")
        if got is None:
            return
        frames = got


async def _answer(hub: SubscriberHub, reader: FrameReader, frame: protocol.StreamRequest,
                  log: Logger) -> None:
    try:
        req = msgspec.convert(frame.body, type=_Request)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"STREAM request: {exc}") from None
    try:
        body = await _run(hub, reader, req, log)
    except ProtocolError:
        raise
    except QuiverError as exc:
        text = f"{exc} ({exc.hint})" if exc.hint else str(exc)
        await reader.stream.send(protocol.encode_error(
            frame.request_id, int(protocol.error_code_for(exc)), text[:4096]))
        return
    await reader.stream.send(protocol.encode_stream_reply(frame.request_id, body))


async def _run(hub: SubscriberHub, reader: FrameReader, req: _Request, log: Logger
               ) -> dict[str, Any]:
    shards = hub.dispatchers
    if not shards:
        raise ShuttingDown("quiverd is starting or stopping: no shard serves yet")
    check_numbers(req, len(shards))  # MALFORMED for a number naming nothing (issue 26)
    registered = False
    if (isinstance(req, _Open) and req.register and not hub.known(req.subscriber)
            and hub.refusal(req.subscriber) is None):  # a retired one is not brought back
        await _register(hub, req.subscriber, req.start)
        registered = True
        log.info("subscriber_added", subscriber=req.subscriber, start=req.start,
                 by="stream")
    if not hub.known(req.subscriber):
        raise hub.unknown(req.subscriber)
    if isinstance(req, _Release):
        return {"released": hub.leases.release(req.subscriber, holder_text(req.holder))}
    _lease(hub, reader, req, log)
    if isinstance(req, _Open):
        return {"shards": len(shards), "registered": registered,
                "start": {str(d.shard): ranges.first_position(d, req.subscriber)
                          for d in shards}}
    if isinstance(req, _Latest):
        return _latest(shards, req)
    if isinstance(req, _AckThrough):
        acked = 0
        for key, through in sorted(req.through.items()):
            acked += await ranges.ack_through(_shard(shards, key), req.subscriber, through)
        return {"acked": acked}
    return await _fetch(_shard(shards, str(req.shard)), reader, req)


def _lease(hub: SubscriberHub, reader: FrameReader, req: _Request, log: Logger) -> None:
    """A request naming a holder takes or renews the subscriber's lease (SubscriberBusy
    if another live query holds it); an ack without one is refused while one is held."""
    if isinstance(req, _Fetch | _Release):
        return  # fetches only read (Spark's executors); release is answered before
    if req.holder is None:
        if isinstance(req, _AckThrough):
            hub.leases.check(req.subscriber)
        return
    holder = holder_text(req.holder)
    new = hub.leases.holder(req.subscriber) != holder
    hub.leases.take(req.subscriber, holder, pid=_peer_pid(reader.stream), lease_s=req.lease_s)
    if new:
        log.info("stream_lease_taken", subscriber=req.subscriber, holder=holder)


def _peer_pid(stream: RawStream) -> int:
    try:
        pid, _, _ = _UCRED.unpack(stream.sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return 0
    return int(pid)


async def _register(hub: SubscriberHub, name: str, start: str) -> None:
    try:
        validate_subscriber_name(name)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, str(exc)) from None
    for d in hub.dispatchers:
        try:
            await ranges.register(d, name, start)
        except SubscriberExists:
            pass  # registered meanwhile (another query, or the admin command)


def _shard(shards: list[Dispatcher], key: str) -> Dispatcher:
    if not key.isdigit() or int(key) >= len(shards):
        raise ProtocolError(ErrorCode.MALFORMED, f"no shard {key}")
    return shards[int(key)]


def _latest(shards: list[Dispatcher], req: _Latest) -> dict[str, Any]:
    """Per shard the end of the next range: all that is finalized after ``start``
    (within ``cap``), or at most ``max_bundles`` bundles shared fairly by the shards."""
    starts = {d.shard: tuple(req.start[str(d.shard)]) if str(d.shard) in req.start
              else ranges.first_position(d, req.subscriber) for d in shards}
    caps = req.cap or {}

    def cap(d: Dispatcher) -> tuple[int, int] | None:
        c = caps.get(str(d.shard))
        return None if c is None else (c[0], c[1])

    limit = max(0, req.max_bundles)
    shares = {d.shard: limit for d in shards}
    if limit:
        ready = {d.shard: ranges.span(d, starts[d.shard], cap=cap(d), limit=limit)[1]  # type: ignore[arg-type]
                 for d in shards}
        shares = _fair_shares(ready, limit)
    ends: dict[str, tuple[int, int]] = {}
    total = 0
    lost: list[dict[str, object]] = []
    for d in shards:
        start: tuple[int, int] = starts[d.shard]  # type: ignore[assignment]
        share = shares[d.shard]
        end, count = start, 0
        if not limit or share:
            end, count = ranges.span(d, start, cap=cap(d), limit=share)
        # Bundles of (start, end] retention deleted are lost to the reader; with nothing
        # live to read, the range passes over deleted segments (no bundle in them), so
        # a reader that goes on (failOnDataLoss=false) is told of them once.
        horizon = end if end != start else ranges.past_deleted(d, start, cap(d))
        dropped = d.stats.dropped_count(req.subscriber)
        runs = ranges.lost(d, start, horizon, dropped=dropped > 0)
        if runs:
            end = max(end, horizon)
            lost += [{"shard": d.shard, **run, "dropped_bundles": dropped} for run in runs]
        ends[str(d.shard)] = end
        total += count
    # A shard whose range stops before an undecided job's bundle names it: the reader
    # says what it waits for (SPEC §7; `quiverd jobs list`, `quiverd jobs abort`).
    waiting = {str(d.shard): w for d in shards
               if (w := held_at(d.segments, d.verdict, ends[str(d.shard)])) is not None}
    return {"end": ends, "bundles": total, "lost": lost, "waiting": waiting}




def _fair_shares(ready: dict[int, int], limit: int) -> dict[int, int]:
    """Split ``limit`` bundles over shards holding ``ready`` each: equal shares, and
    what a shard cannot use goes to the others (water-filling)."""
    shares = {k: 0 for k in ready}
    left = limit
    hungry = sorted((k for k in ready if ready[k] > 0), key=lambda k: ready[k])
    while hungry and left > 0:
        k = hungry.pop(0)
        take = min(ready[k], max(1, left // (len(hungry) + 1)))
        shares[k] = take
        left -= take
    return shares


async def _fetch(d: Dispatcher, reader: FrameReader, req: _Fetch) -> dict[str, Any]:
    """Send the DELIVERY frames of ``(after, through]`` on shard ``d``, one read batch
    (one worker hop) at a time; answers how many were sent and which parts of the range
    were deleted before they could be (``lost``: before the fetch, or while it read)."""
    after, through = (req.after[0], req.after[1]), (req.through[0], req.through[1])
    dropped = d.stats.dropped_count(req.subscriber)
    lost = ranges.lost(d, after, through, dropped=dropped > 0)
    fetch = ranges.RangeFetch(d, req.client)
    sent = 0
    try:
        while after < through:
            wanted, after = ranges.picks(d, after, through)
            if wanted:
                for frame in await fetch.frames(wanted):
                    await reader.stream.send_parts(list(frame.parts))
                    sent += 1
    finally:
        fetch.close()
    for seg, idx in sorted(fetch.gone.items()):
        lost.append({"after": [seg, idx - 1],
                     "through": list(min(through, (seg, ranges.END_OF_SEGMENT))),
                     "segments": [seg, seg]})
    return {"bundles": sent, "lost": [{"shard": d.shard, **run, "dropped_bundles": dropped}
                                      for run in lost]}
