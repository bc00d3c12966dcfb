"""Socket protocol v1: frame types, message Structs and encoders.

The byte layouts are drawn in ``quiverd/protocol/codec.py`` (and docs/protocol.md);
this module builds frames, ``protocol.py`` parses them. Encoders return
``bytes`` for small frames and a list of buffers for frames that carry Arrow
payloads, so a sender can ``writelines``/``sendmsg`` them without copying the
payloads.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any

import msgspec

from quiverd.kernel.bundle import MAX_SLOTS, Slot, TxnTag
from quiverd.kernel.crc import crc32c
from quiverd.kernel.names import client_name_problem, subscriber_name_problem

__all__ = [
    "CLOSES_CONNECTION", "MAX_FRAME_OVERHEAD", "PROTOCOL_VERSION", "Ack", "AckBundle",
    "BundleFrame", "Delivery", "Error", "ErrorCode", "FrameType", "Hello", "HelloOk",
    "JOB_FRAME_MAX", "JobReply", "JobRequest", "MAX_JOB_BODY_BYTES",
    "MIN_PROTOCOL_VERSION", "Message", "NackBundle", "RejectBundle", "Role", "StreamReply",
    "StreamRequest", "Subscribe",
    "Subscribed", "encode_ack",
    "encode_ack_bundle", "encode_bundle", "encode_delivery", "encode_delivery_parts",
    "encode_error", "encode_hello",
    "encode_hello_ok", "encode_job_reply", "encode_job_request", "encode_nack_bundle",
    "encode_reject_bundle",
    "encode_stream_reply", "encode_stream_request", "encode_subscribe", "encode_subscribed",
    "max_frame_bytes", "nbytes",
]

Buffer = bytes | bytearray | memoryview

# 2: REJECT_BUNDLE (a subscriber's permanent outcome); 3: named producers (HELLO's
# producer id and incarnation, BUNDLE's producer_seq: a resend is answered, not stored).
PROTOCOL_VERSION = 3
PRODUCER_SINCE = 3
MIN_PROTOCOL_VERSION = 1  # what servers and clients of this build still speak
MAGIC = b"QVR"

FRAME_HEADER = struct.Struct("<IB")  # frame_len (bytes after this field), frame_type
HELLO_BODY = struct.Struct("<3sHHB")  # magic, min_version, max_version, role
HELLO_OK_BODY = struct.Struct("<HIH")  # version, max_bundle_bytes, max_inflight
ACK_BODY = struct.Struct("<IHQ")  # request_id, shard, sequence
ERROR_HEAD = struct.Struct("<IHH")  # request_id, code, message_len
BUNDLE_ID = struct.Struct("<HQI")  # shard, segment_seq, bundle_index
TXN_FIXED = struct.Struct("<IIQ")  # partition, attempt, row_offset
SLOT_HEAD = struct.Struct("<II")  # row_count, payload_len
END_CHECK = struct.Struct("<QI")  # total_rows, crc32c
JOB_HEAD = struct.Struct("<II")  # request_id, body_len (JOB and JOB_OK)
SMALL_PIECE = 4096  # payload pieces below this are copied into their neighbours
U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")

MAX_CLIENT_LEN = 255  # u8 length prefix
MAX_JOB_ID_LEN = 0xFFFF  # u16 length prefix
MAX_MESSAGE_LEN = 0xFFFF
MAX_ROW_COUNT = 0xFFFF_FFFF  # u32 per slot on the wire
MAX_REQUEST_ID = 0xFFFF_FFFF  # request_id 0 is reserved for connection-level errors
# A JOB/JOB_OK body is one JSON object. A commit names every partition's winner
# (~80 bytes each), so 1 MiB holds a job of ~12 000 partitions.
MAX_JOB_BODY_BYTES = 1024 * 1024
JOB_FRAME_MAX = 1 + JOB_HEAD.size + MAX_JOB_BODY_BYTES  # type byte + head + body
# Largest BUNDLE/DELIVERY frame apart from its payload bytes: the frame_len field is
# outside the limit, everything else (type, ids, longest client and job id, 64 slot
# headers, end check) is counted so a config's max_bundle_bytes always fits.
MAX_FRAME_OVERHEAD = (
    1 + BUNDLE_ID.size + 4 + 1 + MAX_CLIENT_LEN + 1 + 2 + MAX_JOB_ID_LEN + TXN_FIXED.size
    + 8 + 8 + MAX_SLOTS * SLOT_HEAD.size + END_CHECK.size
)



def max_frame_bytes(max_bundle_bytes: int) -> int:
    """The decoder limit for a daemon configured with ``max_bundle_bytes`` of payload."""
    return max_bundle_bytes + MAX_FRAME_OVERHEAD


class FrameType(IntEnum):
    HELLO = 0x01  # client -> server
    HELLO_OK = 0x02  # server -> client
    BUNDLE = 0x03  # producer -> server
    ACK = 0x04  # server -> producer
    ERROR = 0x05  # server -> client
    JOB = 0x06  # producer -> server: a transactional-write request (JSON)
    JOB_OK = 0x07  # server -> producer: its reply (JSON)
    SUBSCRIBE = 0x10  # subscriber -> server
    SUBSCRIBED = 0x11  # server -> subscriber
    DELIVERY = 0x12  # server -> subscriber
    ACK_BUNDLE = 0x13  # subscriber -> server
    NACK_BUNDLE = 0x14  # subscriber -> server
    STREAM = 0x15  # subscriber -> server: a ranged-read request (JSON), docs/protocol.md
    STREAM_OK = 0x16  # server -> subscriber: its reply (JSON), after any DELIVERY it asked for
    REJECT_BUNDLE = 0x17  # subscriber -> server (version 2): never deliver this bundle again


class Role(IntEnum):
    PRODUCER = 1
    SUBSCRIBER = 2


class ErrorCode(IntEnum):
    """Stable wire error codes; never renumber, only add."""

    MALFORMED = 1
    TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    UNAUTHORIZED = 4
    AT_CAPACITY = 5
    SHUTTING_DOWN = 6
    INTERNAL = 7
    UNKNOWN_SUBSCRIBER = 8
    TIMEOUT = 9  # no HELLO in time, idle, or a frame stalled mid-body
    JOB_CONFLICT = 10  # a JOB contradicts the job's recorded decision (SPEC §7)
    UNAVAILABLE = 11  # a JOB needs the catalog, which cannot be reached now: retry
    SCHEMA_CONFLICT = 12  # lake.schema_mode = "strict": the bundle's schema conflicts


# After these the server closes the connection: the byte stream can no longer be
# trusted (malformed, too large: the rest of the frame is never read) or the peer
# may not talk to us at all. The others answer one request and keep the connection.
CLOSES_CONNECTION = frozenset(
    {
        ErrorCode.MALFORMED, ErrorCode.TOO_LARGE, ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.UNAUTHORIZED, ErrorCode.UNKNOWN_SUBSCRIBER, ErrorCode.TIMEOUT,
    }
)


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    min_version: int
    max_version: int
    role: Role
    producer: str = ""  # a named producer (version 3): its id, and
    incarnation: int = 0  # the number its process drew (its streams' numbering)


class HelloOk(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    max_bundle_bytes: int
    max_inflight: int


class BundleFrame(msgspec.Struct, frozen=True, kw_only=True):
    """A producer's bundle as decoded; slots carry fingerprint=b"" until validated."""

    request_id: int
    client: str
    txn: TxnTag | None
    slots: tuple[Slot, ...]
    producer_seq: int = 0  # a named producer's number for it in (producer, client); 0: none

    @property
    def row_count(self) -> int:
        return sum(s.row_count for s in self.slots)

    @property
    def payload_bytes(self) -> int:
        return sum(len(s.ipc) for s in self.slots)


class Ack(msgspec.Struct, frozen=True, kw_only=True):
    """The bundle ``request_id`` is durable as ``sequence`` of ``shard``."""

    request_id: int
    shard: int
    sequence: int


class Error(msgspec.Struct, frozen=True, kw_only=True):
    request_id: int  # 0: about the connection, not one request
    code: int  # an ErrorCode, kept as int so a newer server's codes still decode
    message: str


class JobRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A producer's transactional-write request (``op`` and its fields, SPEC §7)."""

    request_id: int
    body: dict[str, Any]


class JobReply(msgspec.Struct, frozen=True, kw_only=True):
    """The server's answer to the JOB ``request_id`` (a refusal is an ERROR instead)."""

    request_id: int
    body: dict[str, Any]


class StreamRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A ranged reader's request (``op`` and its fields, docs/protocol.md "Ranged reads")."""

    request_id: int
    body: dict[str, Any]


class StreamReply(msgspec.Struct, frozen=True, kw_only=True):
    """The server's answer to the STREAM ``request_id`` (a refusal is an ERROR instead)."""

    request_id: int
    body: dict[str, Any]


class Subscribe(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    window: int  # deliveries the server may have unacknowledged at once


class Subscribed(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    shard: int
    segment_seq: int
    bundle_index: int
    client: str
    txn: TxnTag | None
    ingestion_ts_ns: int
    slots: tuple[Slot, ...]


class AckBundle(msgspec.Struct, frozen=True, kw_only=True):
    shard: int
    segment_seq: int
    bundle_index: int


class NackBundle(msgspec.Struct, frozen=True, kw_only=True):
    shard: int
    segment_seq: int
    bundle_index: int


class RejectBundle(msgspec.Struct, frozen=True, kw_only=True):
    shard: int
    segment_seq: int
    bundle_index: int


Message = (
    Hello | HelloOk | BundleFrame | Ack | Error | JobRequest | JobReply | Subscribe
    | Subscribed | Delivery | AckBundle | NackBundle | RejectBundle | StreamRequest | StreamReply
)


def encode_hello(
    role: Role, *, min_version: int = MIN_PROTOCOL_VERSION,
    max_version: int = PROTOCOL_VERSION, producer: str = "", incarnation: int = 0,
) -> bytes:
    """HELLO; a named producer's (``producer``, ``incarnation``) needs version 3."""
    body = HELLO_BODY.pack(MAGIC, min_version, max_version, role)
    if producer:
        if role is not Role.PRODUCER or max_version < PRODUCER_SINCE or min_version > \
                max_version:
            raise ValueError(f"a producer id needs a producer HELLO offering version "
                             f"{PRODUCER_SINCE}")
        if not 0 < incarnation < 1 << 64:
            raise ValueError(f"incarnation {incarnation} outside 1..2**64-1")
        body += encode_client(producer) + U64.pack(incarnation)
    return _frame(FrameType.HELLO, body)


def encode_hello_ok(*, version: int, max_bundle_bytes: int, max_inflight: int) -> bytes:
    return _frame(
        FrameType.HELLO_OK, HELLO_OK_BODY.pack(version, max_bundle_bytes, max_inflight)
    )


def encode_ack(request_id: int, shard: int, sequence: int) -> bytes:
    return _frame(FrameType.ACK, ACK_BODY.pack(request_id, shard, sequence))


def encode_error(request_id: int, code: int, message: str) -> bytes:
    # Cut overlong messages on a character boundary rather than fail to report an error.
    text = message.encode("utf-8")[:MAX_MESSAGE_LEN].decode("utf-8", "ignore").encode()
    return _frame(FrameType.ERROR, ERROR_HEAD.pack(request_id, code, len(text)) + text)


def encode_job_request(request_id: int, body: Mapping[str, Any]) -> bytes:
    if not 1 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id {request_id} outside 1..{MAX_REQUEST_ID}")
    return _job_frame(FrameType.JOB, request_id, body)


def encode_job_reply(request_id: int, body: Mapping[str, Any]) -> bytes:
    return _job_frame(FrameType.JOB_OK, request_id, body)


def encode_stream_request(request_id: int, body: Mapping[str, Any]) -> bytes:
    if not 1 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id {request_id} outside 1..{MAX_REQUEST_ID}")
    return _job_frame(FrameType.STREAM, request_id, body)


def encode_stream_reply(request_id: int, body: Mapping[str, Any]) -> bytes:
    return _job_frame(FrameType.STREAM_OK, request_id, body)


def _job_frame(frame_type: FrameType, request_id: int, body: Mapping[str, Any]) -> bytes:
    if not isinstance(body, Mapping):
        raise TypeError(f"a {frame_type.name} body is a JSON object, not {type(body).__name__}")
    raw = msgspec.json.encode(body)
    if len(raw) > MAX_JOB_BODY_BYTES:
        raise ValueError(f"{frame_type.name} body of {len(raw)} bytes of JSON exceeds "
                         f"{MAX_JOB_BODY_BYTES}")
    return _frame(frame_type, JOB_HEAD.pack(request_id, len(raw)) + raw)


def encode_subscribe(name: str, window: int) -> bytes:
    problem = subscriber_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    raw = name.encode("ascii")
    return _frame(FrameType.SUBSCRIBE, U8.pack(len(raw)) + raw + U16.pack(window))


def encode_subscribed(ok: bool) -> bytes:
    return _frame(FrameType.SUBSCRIBED, U8.pack(1 if ok else 0))


def encode_ack_bundle(shard: int, segment_seq: int, bundle_index: int) -> bytes:
    return _frame(FrameType.ACK_BUNDLE, BUNDLE_ID.pack(shard, segment_seq, bundle_index))


def encode_nack_bundle(shard: int, segment_seq: int, bundle_index: int) -> bytes:
    return _frame(FrameType.NACK_BUNDLE, BUNDLE_ID.pack(shard, segment_seq, bundle_index))


def encode_reject_bundle(shard: int, segment_seq: int, bundle_index: int) -> bytes:
    return _frame(FrameType.REJECT_BUNDLE, BUNDLE_ID.pack(shard, segment_seq, bundle_index))


def encode_bundle(
    request_id: int,
    client: str,
    slots: Mapping[int, Buffer],
    row_counts: Mapping[int, int],
    txn: TxnTag | None = None,
    producer_seq: int = 0,
) -> list[Buffer]:
    """BUNDLE frame as buffers for ``writelines``; payloads are passed through uncopied.
    ``producer_seq`` (a named producer's, version 3) takes the place of a txn tag."""
    if not 1 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id {request_id} outside 1..{MAX_REQUEST_ID}")
    if set(slots) != set(row_counts):
        raise ValueError("slots and row_counts must name the same slot ids")
    if producer_seq:
        if txn is not None:
            raise ValueError("a bundle has a txn tag or a producer_seq, not both")
        if not 0 < producer_seq < 1 << 64:
            raise ValueError(f"producer_seq {producer_seq} outside 1..2**64-1")
        tag = U8.pack(TAG_PRODUCER) + U64.pack(producer_seq)
    else:
        tag = encode_txn(txn)
    head = U32.pack(request_id) + encode_client(client) + tag
    items = ((n, row_counts[n], (slots[n],)) for n in sorted(slots))
    return _with_slots(FrameType.BUNDLE, head, items)


def encode_delivery(
    *,
    shard: int,
    segment_seq: int,
    bundle_index: int,
    client: str,
    txn: TxnTag | None,
    ingestion_ts_ns: int,
    slots: Iterable[Slot],
) -> list[Buffer]:
    """DELIVERY frame as buffers for ``writelines``; payloads are passed through uncopied."""
    items = sorted((s.slot, s.row_count, s.ipc) for s in slots)
    return encode_delivery_parts(
        shard=shard, segment_seq=segment_seq, bundle_index=bundle_index, client=client,
        txn=txn, ingestion_ts_ns=ingestion_ts_ns,
        slots=[(slot, rows, (payload,)) for slot, rows, payload in items])


def encode_delivery_parts(
    *,
    shard: int,
    segment_seq: int,
    bundle_index: int,
    client: str,
    txn: TxnTag | None,
    ingestion_ts_ns: int,
    slots: Iterable[tuple[int, int, Sequence[Buffer]]],
) -> list[Buffer]:
    """DELIVERY frame whose slot payloads each come as pieces (``(slot, rows, pieces)``
    in ascending slot order): an IPC stream cut from a segment file is sent as its
    slices, never joined. Same bytes on the wire as ``encode_delivery``."""
    head = (
        BUNDLE_ID.pack(shard, segment_seq, bundle_index) + encode_client(client)
        + encode_txn(txn) + I64.pack(ingestion_ts_ns)
    )
    return _with_slots(FrameType.DELIVERY, head, slots, small=SMALL_PIECE)


def encode_client(client: str) -> bytes:
    problem = client_name_problem(client)
    if problem is not None:
        raise ValueError(problem)
    raw = client.encode("ascii")
    return U8.pack(len(raw)) + raw


TAG_PRODUCER = 2  # the txn flag's value for a named producer's u64 producer_seq


def encode_txn(txn: TxnTag | None) -> bytes:
    if txn is None:
        return U8.pack(0)
    job = txn.job_id.encode("utf-8")
    if len(job) > MAX_JOB_ID_LEN:
        raise ValueError(f"job_id of {len(job)} bytes exceeds {MAX_JOB_ID_LEN}")
    fixed = TXN_FIXED.pack(txn.partition, txn.attempt, txn.row_offset)
    return U8.pack(1) + U16.pack(len(job)) + job + fixed


def _with_slots(
    frame_type: FrameType, head: bytes, items: Iterable[tuple[int, int, Sequence[Buffer]]],
    *, small: int = 0,
) -> list[Buffer]:
    """Append bitmap, slots and end check to ``head``; prepend the frame header.

    Header bytes are merged with their neighbours, and so are payload pieces under
    ``small`` bytes (a DELIVERY's schema messages and EOS markers): a one-slot frame
    is a handful of buffers, and larger payload pieces pass through uncopied.
    """
    bitmap = 0
    total_rows = 0
    pieces: list[tuple[Buffer, bool]] = [(head, True)]  # (piece, may be merged)
    for slot, rows, payload in items:
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot {slot} outside 0..{MAX_SLOTS - 1}")
        if not 0 <= rows <= MAX_ROW_COUNT:
            raise ValueError(f"slot {slot}: row count {rows} does not fit u32")
        bitmap |= 1 << slot
        total_rows += rows
        pieces.append((SLOT_HEAD.pack(rows, sum(nbytes(p) for p in payload)), True))
        pieces.extend((p, nbytes(p) < small) for p in payload)
    pieces.insert(1, (U64.pack(bitmap), True))
    parts = _coalesce(pieces)
    # The CRC covers total_rows too: every body byte before the CRC itself.
    crc = 0
    for part in parts:
        crc = crc32c(part, crc)
    rows_field = U64.pack(total_rows)
    parts.append(rows_field + U32.pack(crc32c(rows_field, crc)))
    body_len = sum(nbytes(p) for p in parts)
    parts[0] = FRAME_HEADER.pack(1 + body_len, frame_type) + bytes(parts[0])
    return parts


def _coalesce(pieces: list[tuple[Buffer, bool]]) -> list[Buffer]:
    """Join each run of mergeable pieces into one ``bytes``; the others stay as given."""
    out: list[Buffer] = []
    run: list[Buffer] = []
    for piece, mergeable in pieces:
        if mergeable:
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run))
    return out


def nbytes(buf: Buffer) -> int:
    """Length in bytes (``len`` of a memoryview counts items, not bytes)."""
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _frame(frame_type: FrameType, body: bytes) -> bytes:
    return FRAME_HEADER.pack(1 + len(body), frame_type) + body
