"""Messages that travel between actors: frozen, keyword-only msgspec Structs.

Replies to producers travel on a per-connection memory stream whose buffer is
the connection's in-flight bound, so an actor's ``send_nowait`` never blocks.
"""

from __future__ import annotations

from typing import Any

import msgspec

from quiverd.kernel.bundle import Bundle


class AckReply(msgspec.Struct, frozen=True, kw_only=True):
    request_id: int
    shard: int
    sequence: int


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    request_id: int
    code: int
    message: str


Reply = AckReply | ErrorReply


class AppendRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated bundle on its way into a shard's WAL."""

    request_id: int
    bundle: Bundle
    reply: Any  # MemoryObjectSendStream[Reply] of the producer's connection


class DurableBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Bundles whose covering fdatasync returned, in sequence order."""

    bundles: tuple[Bundle, ...]


class WalReleased(msgspec.Struct, frozen=True, kw_only=True):
    """Every WAL entry with sequence <= ``upto_sequence`` is in a durable segment."""

    upto_sequence: int


class SealedSegment(msgspec.Struct, frozen=True, kw_only=True):
    """An open segment handed from the builder to the finalizer (ownership moves)."""

    segment_seq: int
    segment: Any  # segment.OpenSegment
    reason: str  # size | age | streams | shutdown | pressure


class FinalizedSegment(msgspec.Struct, frozen=True, kw_only=True):
    """A durable, read-only segment file."""

    segment_seq: int
    path: str
    bundle_count: int
    size_bytes: int
    first_sequence: int
    last_sequence: int
    min_ts_ns: int
    max_ts_ns: int


class OutcomeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer's ack/nack (or nothing else) for the ack_logger to make durable."""

    subscriber: str
    segment_seq: int
    bundle_index: int
    outcome: int  # ackformat.ACK | NACK
    on_done: Any = None  # callable(result | exception), called on the event loop


class SubscriberRequest(msgspec.Struct, frozen=True, kw_only=True):
    op: str  # "add" | "remove"
    name: str
    start: str = "earliest"
    on_done: Any = None


class DropRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Retention: record `dropped` for every subscriber lacking the segment's bundles."""

    segment_seq: int
    on_done: Any = None  # called with {subscriber: count}


class SegmentGone(msgspec.Struct, frozen=True, kw_only=True):
    """The gc unlinked a segment file (durably); record SEGMENT_DELETED."""

    segment_seq: int
    reason: str


AckLogMessage = FinalizedSegment | OutcomeRequest | SubscriberRequest | DropRequest | SegmentGone
