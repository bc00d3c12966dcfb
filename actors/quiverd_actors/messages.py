"""What crosses an actor boundary: frozen, keyword-only msgspec Structs.

    ingest ──AppendRequest──▶ wal_writer ──DurableBatch──▶ segment_builder ──SealedSegment──▶
    finalizer ──WalReleased──▶ wal_writer
    finalizer ──SegmentWritten──────────────┐
    dispatcher ──RecordOutcome(s)───────────┤
    admin ──ChangeSubscriber────────────────┼──▶ ack_logger (one inbox: AckLogRequest)
    gc_sweeper ──RetireSegments, SegmentsDeleted┘
    dispatcher ──LocalDelivery──▶ uploader (in process; sockets get protocol Delivery;
                                  staged ones too, once, before their job is decided)
    subscriber connection, uploader ──Feedback──▶ dispatcher (its inbox, drained per pass)

Requests that need an answer carry a ``Reply`` (``quiverd.kernel.reply``), given
once by the actor that handles them; nothing inside a message is code to run.
Producers' answers are protocol ``Ack``/``Error`` values given to the
connection's ``ReplySink`` (``send_nowait``, which never blocks: what it holds is
bounded by the connection's in-flight window).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import msgspec
import pyarrow as pa

from quiverd.kernel.bundle import Bundle, TxnTag
from quiverd.kernel.reply import Reply
from quiverd.protocol.frames import Ack, Error
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.table import SegmentInfo

if TYPE_CHECKING:
    from quiverd_actors.sessions import Session

ProducerReply = Ack | Error


class ReplySink(Protocol):
    """Where a producer's answers go: its connection (or, in tests, a memory stream).

    ``send_nowait`` never blocks; it raises anyio.BrokenResourceError or
    ClosedResourceError once the producer is gone (its data is durable all the same).
    """

    def send_nowait(self, item: ProducerReply, /) -> None: ...

SealReason = Literal["size", "age", "streams", "shutdown", "pressure", "commit"]
RetireReason = Literal["acked", "max_age", "size_cap", "corrupt"]


class AppendRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated bundle on its way into a shard's WAL."""

    request_id: int
    bundle: Bundle
    reply: ReplySink  # the producer's connection


class DurableBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Bundles whose covering fdatasync returned, in sequence order."""

    bundles: tuple[Bundle, ...]


class WalReleased(msgspec.Struct, frozen=True, kw_only=True):
    """Every WAL entry with sequence <= ``upto_sequence`` is in a durable segment."""

    upto_sequence: int


class SealedSegment(msgspec.Struct, frozen=True, kw_only=True):
    """An open segment handed from the builder to the finalizer (ownership moves)."""

    segment_seq: int
    segment: OpenSegment
    reason: SealReason


class SegmentWritten(msgspec.Struct, frozen=True, kw_only=True):
    """The finalizer wrote a segment file durably; the ack_logger records and lists it."""

    info: SegmentInfo


class RecordOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer's ack or nack, to be made durable in ack.log.

    ``reply`` is given once the record is durable and applied (``None``), or
    fails with why it changed nothing (unknown bundle, gap set full, ...).
    """

    subscriber: str
    segment_seq: int
    bundle_index: int
    outcome: int  # acks.format.ACK | NACK
    reply: Reply[None]


class RecordOutcomes(msgspec.Struct, frozen=True, kw_only=True):
    """Many consumers' acks and nacks, made durable by one ack.log append.

    ``reply`` is given once the batch is durable and applied: per outcome, in order,
    ``None`` or why that outcome changed nothing (unknown bundle, gap set full, ...).
    """

    # (subscriber, segment_seq, bundle_index, outcome)
    outcomes: tuple[tuple[str, int, int, int], ...]
    reply: Reply[tuple[Exception | None, ...]]


class Feedback(msgspec.Struct, frozen=True, kw_only=True):
    """A subscriber session's acks and nacks for one shard, in the order they came
    (one read batch of ACK_BUNDLE / NACK_BUNDLE frames, or the uploader's ack of a
    bundle). Only the shard's dispatcher applies it, in its own task."""

    session: Session
    outcomes: tuple[tuple[int, int, int], ...]  # (segment_seq, bundle_index, outcome)


class ChangeSubscriber(msgspec.Struct, frozen=True, kw_only=True):
    """Register (``add``) or unregister (``remove``) a subscriber on one shard."""

    op: Literal["add", "remove"]
    name: str
    start: Literal["earliest", "latest"] = "earliest"
    reply: Reply[None]


class Retired(msgspec.Struct, frozen=True, kw_only=True):
    """Segments out of the table (no longer delivered): the gc may unlink them now."""

    segments: tuple[SegmentInfo, ...]
    dropped_by_subscriber: dict[str, int]  # bundles each subscriber never got
    segments_with_drops: int
    dropped_bytes: int = 0  # file bytes of those segments (quiver_lost_bytes_total)


class RetireSegments(msgspec.Struct, frozen=True, kw_only=True):
    """The gc's sweep: take these segments out of the table, in one durable batch.

    For retention reasons (``max_age``, ``size_cap``) the ack_logger first makes
    ``dropped`` outcomes durable for every subscriber that lacked their bundles.
    """

    segment_seqs: tuple[int, ...]
    reason: RetireReason
    reply: Reply[Retired]


class SegmentsDeleted(msgspec.Struct, frozen=True, kw_only=True):
    """The gc unlinked these segment files (durably); record SEGMENT_DELETED."""

    segment_seqs: tuple[int, ...]
    reason: RetireReason


class LocalDelivery(msgspec.Struct, frozen=True, kw_only=True):
    """A bundle handed to an in-process subscriber (the uploader) as the tables the
    segment holds: no IPC encode for a socket it never crosses, no decode on arrival."""

    shard: int
    segment_seq: int
    bundle_index: int
    client: str
    txn: TxnTag | None
    ingestion_ts_ns: int
    tables: dict[int, pa.Table]  # slot -> table
    # A bundle of an undecided job, handed over early so its rows become Parquet while
    # the job still writes (uploader/staged.py): not in flight, never acked or nacked.
    staged: bool = False


AckLogRequest = (SegmentWritten | RecordOutcome | RecordOutcomes | ChangeSubscriber
                 | RetireSegments | SegmentsDeleted)
