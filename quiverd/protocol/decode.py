"""Socket protocol v1: frame bodies -> message Structs (layouts in protocol.py).

Every function here works on one complete frame body (the bytes after the type
byte) and raises ``ProtocolError`` naming what is wrong; framing, size limits and
the handshake order are ``protocol.FrameDecoder``'s job. ``validate_bundle`` then
judges a decoded bundle's Arrow payloads (server side, in a worker thread).
"""

from __future__ import annotations

import codecs
import math
import re
import struct
from decimal import Decimal
from typing import Any

import msgspec
import pyarrow as pa

from quiverd.kernel.bundle import (
    META_SLOT,
    ReservedColumnName,
    Slot,
    TxnTag,
    inspect_ipc_stream,
)
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import ProtocolError
from quiverd.kernel.names import CLIENT_NAME_BYTES, SUBSCRIBER_NAME_BYTES
from quiverd.kernel.schema_cache import SchemaCache
from quiverd.protocol.frames import (
    ACK_BODY,
    BUNDLE_ID,
    END_CHECK,
    ERROR_HEAD,
    HELLO_BODY,
    HELLO_OK_BODY,
    I64,
    JOB_HEAD,
    MAGIC,
    MAX_JOB_BODY_BYTES,
    PRODUCER_SINCE,
    SLOT_HEAD,
    TAG_PRODUCER,
    TXN_FIXED,
    U8,
    U16,
    U32,
    U64,
    Ack,
    AckBundle,
    BundleFrame,
    Delivery,
    Error,
    ErrorCode,
    FrameType,
    Hello,
    HelloOk,
    JobReply,
    JobRequest,
    Message,
    NackBundle,
    RejectBundle,
    Role,
    StreamReply,
    StreamRequest,
    Subscribe,
    Subscribed,
    nbytes,
)

PAYLOAD_FRAMES = frozenset({FrameType.BUNDLE, FrameType.DELIVERY})


def decode_body(frame_type: FrameType, body: memoryview) -> Message:
    """Decode one frame body (everything after the type byte)."""
    if frame_type in PAYLOAD_FRAMES:
        return _decode_payload_frame(frame_type, body)
    r = _Reader(body, frame_type.name)
    msg: Message
    match frame_type:
        case FrameType.HELLO:
            magic, lo, hi, role = r.unpack(HELLO_BODY)
            msg = _hello(magic, lo, hi, role)
            if r.left:  # a named producer (version 3)
                msg = _producer_hello(r, msg)
        case FrameType.HELLO_OK:
            version, max_bundle_bytes, max_inflight = r.unpack(HELLO_OK_BODY)
            if max_inflight == 0:
                raise ProtocolError(ErrorCode.MALFORMED, "HELLO_OK: max_inflight is 0")
            msg = HelloOk(
                version=version, max_bundle_bytes=max_bundle_bytes, max_inflight=max_inflight
            )
        case FrameType.ACK:
            request_id, shard, sequence = r.unpack(ACK_BODY)
            msg = Ack(request_id=request_id, shard=shard, sequence=sequence)
        case FrameType.ERROR:
            request_id, code, length = r.unpack(ERROR_HEAD)
            # A garbled message must not hide the error code behind a decode failure.
            text = bytes(r.take(length)).decode("utf-8", "replace")
            msg = Error(request_id=request_id, code=code, message=text)
        case FrameType.JOB | FrameType.JOB_OK | FrameType.STREAM | FrameType.STREAM_OK:
            msg = _job(r, frame_type)
        case FrameType.SUBSCRIBE:
            name = _ascii(r, SUBSCRIBER_NAME_BYTES, "subscriber name")
            (window,) = r.unpack(U16)
            if window == 0:
                raise ProtocolError(ErrorCode.MALFORMED, "SUBSCRIBE: window is 0")
            msg = Subscribe(name=name, window=window)
        case FrameType.SUBSCRIBED:
            (ok,) = r.unpack(U8)
            if ok > 1:
                raise ProtocolError(ErrorCode.MALFORMED, f"SUBSCRIBED: ok flag {ok} not 0 or 1")
            msg = Subscribed(ok=bool(ok))
        case FrameType.ACK_BUNDLE | FrameType.NACK_BUNDLE | FrameType.REJECT_BUNDLE:
            shard, seq, index = r.unpack(BUNDLE_ID)
            if frame_type is FrameType.ACK_BUNDLE:
                msg = AckBundle(shard=shard, segment_seq=seq, bundle_index=index)
            elif frame_type is FrameType.NACK_BUNDLE:
                msg = NackBundle(shard=shard, segment_seq=seq, bundle_index=index)
            else:
                msg = RejectBundle(shard=shard, segment_seq=seq, bundle_index=index)
        case _:  # pragma: no cover - FrameType is exhaustive above
            raise AssertionError(frame_type)
    r.finish()
    return msg


class _Reader:
    """Bounds-checked cursor over one frame body."""

    __slots__ = ("_view", "_pos", "_what")

    def __init__(self, view: memoryview, what: str) -> None:
        self._view = view
        self._pos = 0
        self._what = what

    def take(self, n: int) -> memoryview:
        start, end = self._pos, self._pos + n
        if end > len(self._view):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"{self._what} frame truncated: needs {n} bytes at body offset {start}, "
                f"only {len(self._view) - start} left",
            )
        self._pos = end
        return self._view[start:end]

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size))

    @property
    def left(self) -> int:
        return len(self._view) - self._pos

    def finish(self) -> None:
        if self._pos != len(self._view):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"{self._what} frame has {len(self._view) - self._pos} unexpected trailing bytes",
            )


def _hello(magic: bytes, lo: int, hi: int, role: int) -> Hello:
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.MALFORMED, f"HELLO: bad magic {magic!r}, expected {MAGIC!r}")
    if lo > hi:
        raise ProtocolError(ErrorCode.MALFORMED, f"HELLO: min_version {lo} > max_version {hi}")
    if role not in Role._value2member_map_:
        raise ProtocolError(ErrorCode.MALFORMED, f"HELLO: unknown role {role}")
    return Hello(min_version=lo, max_version=hi, role=Role(role))


def _producer_hello(r: _Reader, hello: Hello) -> Hello:
    if hello.role is not Role.PRODUCER or hello.max_version < PRODUCER_SINCE:
        raise ProtocolError(ErrorCode.MALFORMED, f"HELLO: a producer id needs a producer "
                            f"HELLO offering protocol version {PRODUCER_SINCE}")
    producer = _ascii(r, CLIENT_NAME_BYTES, "producer id")
    (incarnation,) = r.unpack(U64)
    if incarnation == 0:
        raise ProtocolError(ErrorCode.MALFORMED, "HELLO: incarnation 0 is reserved")
    return msgspec.structs.replace(hello, producer=producer, incarnation=incarnation)


_JOB_BODY = msgspec.json.Decoder(dict[str, Any])
# Only to explain a body _JOB_BODY refused: any JSON, floats kept exact (1e400 included).
_ANY_JSON = msgspec.json.Decoder(Any, float_hook=Decimal)


def _job(r: _Reader, frame_type: FrameType
         ) -> JobRequest | JobReply | StreamRequest | StreamReply:
    """JOB, JOB_OK, STREAM and STREAM_OK: one layout (request id, JSON object)."""
    what = frame_type.name
    request_id, length = r.unpack(JOB_HEAD)
    if frame_type in (FrameType.JOB, FrameType.STREAM) and request_id == 0:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: request_id 0 is reserved")
    if length > MAX_JOB_BODY_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: body of {length} bytes exceeds "
                            f"{MAX_JOB_BODY_BYTES}")
    raw = r.take(length)
    r.finish()  # framing before content: a wrong length is not reported as bad JSON
    # UTF-8 is checked here, not left to msgspec: its wording (and even its exception
    # type) for invalid UTF-8 changed between releases, and the answer a client gets must
    # not depend on which msgspec a machine installed. JOB bodies are small (bounded above).
    try:
        codecs.utf_8_decode(raw, "strict", True)
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: body is not UTF-8 (invalid byte "
                            f"at offset {exc.start})") from None
    try:
        body = _JOB_BODY.decode(raw)
    except msgspec.ValidationError:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: {_json_problem(raw)}") from None
    except RecursionError:  # thousands of nested arrays: no request is shaped so
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: body is JSON nested too deeply "
                            "for a request") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what}: body is not JSON: {exc}") from None
    match frame_type:
        case FrameType.JOB:
            return JobRequest(request_id=request_id, body=body)
        case FrameType.STREAM:
            return StreamRequest(request_id=request_id, body=body)
        case FrameType.STREAM_OK:
            return StreamReply(request_id=request_id, body=body)
    return JobReply(request_id=request_id, body=body)


def _json_problem(raw: memoryview | bytes) -> str:
    """Why well-formed JSON is not a JOB/STREAM body, in our words (not msgspec's)."""
    generic = "body is JSON but not an object with string keys"
    try:
        value = _ANY_JSON.decode(raw)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return generic
        path = _out_of_range(value, "")
    except (msgspec.DecodeError, RecursionError):  # nested deeper than we explain
        return generic
    return (f"body holds a number out of the 64-bit float range at {path or '$'}"
            if path is not None else generic)


def _out_of_range(value: Any, path: str) -> str | None:
    """The path of the first number a double cannot hold, if any (depth is bounded by
    the body's 1 MiB)."""
    if isinstance(value, Decimal):
        return path if not math.isfinite(float(value)) else None
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        if (found := _out_of_range(item, f"{path}.{key}" if isinstance(key, str)
                                   else f"{path}[{key}]")) is not None:
            return found
    return None


def _decode_payload_frame(frame_type: FrameType, body: memoryview) -> BundleFrame | Delivery:
    what = frame_type.name
    if len(body) < END_CHECK.size:
        raise ProtocolError(ErrorCode.MALFORMED, f"{what} frame truncated: no end check")
    total_rows, crc = END_CHECK.unpack_from(body, len(body) - END_CHECK.size)
    # The CRC is checked before any field is trusted, so a damaged length field
    # reports as damage rather than as a confusing parse error.
    actual = crc32c(body[:-4])
    if actual != crc:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"{what} end check failed: crc 0x{actual:08x} != 0x{crc:08x} (frame damaged or cut)",
        )
    r = _Reader(body[: -END_CHECK.size], what)
    if frame_type is FrameType.BUNDLE:
        (request_id,) = r.unpack(U32)
        if request_id == 0:
            raise ProtocolError(ErrorCode.MALFORMED, "BUNDLE: request_id 0 is reserved")
        client = _ascii(r, CLIENT_NAME_BYTES, "client name")
        txn, producer_seq = _txn(r, numbered=True)
        slots = _slots(r, total_rows)
        return BundleFrame(request_id=request_id, client=client, txn=txn, slots=slots,
                           producer_seq=producer_seq)
    shard, seq, index = r.unpack(BUNDLE_ID)
    client, (txn, _) = _ascii(r, CLIENT_NAME_BYTES, "client name"), _txn(r)
    (ts,) = r.unpack(I64)
    slots = _slots(r, total_rows)
    return Delivery(
        shard=shard, segment_seq=seq, bundle_index=index, client=client, txn=txn,
        ingestion_ts_ns=ts, slots=slots,
    )


def _ascii(r: _Reader, pattern: re.Pattern[bytes], what: str) -> str:
    (length,) = r.unpack(U8)
    raw = bytes(r.take(length))
    if pattern.fullmatch(raw) is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"invalid {what} {raw!r}")
    return raw.decode("ascii")


def _txn(r: _Reader, *, numbered: bool = False) -> tuple[TxnTag | None, int]:
    """The tag after a client name: (txn tag, 0), or on a BUNDLE (None, producer_seq)."""
    (flag,) = r.unpack(U8)
    if flag == 0:
        return None, 0
    if flag == TAG_PRODUCER and numbered:
        (producer_seq,) = r.unpack(U64)
        if producer_seq == 0:
            raise ProtocolError(ErrorCode.MALFORMED, "BUNDLE: producer_seq 0 is reserved")
        return None, producer_seq
    if flag != 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"transactional tag flag {flag} not "
                            f"{'0, 1 or 2' if numbered else '0 or 1'}")
    (length,) = r.unpack(U16)
    try:
        job_id = bytes(r.take(length)).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(ErrorCode.MALFORMED, "transactional tag: job_id is not utf-8") from None
    partition, attempt, row_offset = r.unpack(TXN_FIXED)
    return TxnTag(job_id=job_id, partition=partition, attempt=attempt,
                  row_offset=row_offset), 0


def _slots(r: _Reader, total_rows: int) -> tuple[Slot, ...]:
    (bitmap,) = r.unpack(U64)
    slots = []
    while bitmap:  # set bits only, lowest first (most bundles use one slot of 64)
        low = bitmap & -bitmap
        bitmap ^= low
        rows, length = r.unpack(SLOT_HEAD)
        slots.append(Slot(slot=low.bit_length() - 1, fingerprint=b"", row_count=rows,
                          ipc=r.take(length)))
    r.finish()
    declared = sum(s.row_count for s in slots)
    if declared != total_rows:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"end check failed: total_rows {total_rows} != sum of slot row counts {declared}",
        )
    return tuple(slots)


# What pyarrow raises on bad bytes: ArrowException subclasses, but also plain OSError
# from its IO layer ("negative continuation token", "Expected to be able to read N
# bytes for message body"), ValueError (UnicodeDecodeError, ...), TypeError, and
# IndexError/KeyError/OverflowError from the Python side of decoding.
PEER_BYTES_ERRORS = (
    pa.ArrowException, OSError, ValueError, TypeError, IndexError, KeyError, OverflowError,
)


def validate_bundle(
    frame: BundleFrame | Delivery, *, max_bundle_bytes: int | None = None,
    schemas: SchemaCache | None = None,
) -> tuple[Slot, ...]:
    """Server-side semantic check; returns the slots with fingerprints filled.

    Decodes and fully validates every IPC stream (``validate(full=True)`` at ~9 GB/s)
    and checks the declared row counts against it. ``schemas`` (the ingest server's)
    runs the checks that depend only on a schema once per schema.
    """
    inspect = schemas.inspect if schemas is not None else inspect_ipc_stream
    if not frame.slots:
        raise ProtocolError(ErrorCode.MALFORMED, "bundle has no slots")
    payload_bytes = sum(nbytes(s.ipc) for s in frame.slots)
    if max_bundle_bytes is not None and payload_bytes > max_bundle_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"bundle of {payload_bytes} payload bytes exceeds max_bundle_bytes {max_bundle_bytes}",
        )
    out: list[Slot] = []
    for s in frame.slots:
        if s.slot == META_SLOT:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"slot {META_SLOT} is reserved for bundle metadata"
            )
        try:
            facts = inspect(s.ipc)
        except ReservedColumnName as exc:
            raise ProtocolError(ErrorCode.MALFORMED, f"slot {s.slot}: {exc}") from None
        except PEER_BYTES_ERRORS as exc:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"slot {s.slot}: payload is not a valid Arrow IPC stream: {exc}",
            ) from None
        if facts.rows != s.row_count:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"slot {s.slot}: frame declares {s.row_count} rows but its IPC stream holds "
                f"{facts.rows} (stream cut short?)",
            )
        out.append(Slot(slot=s.slot, fingerprint=facts.fingerprint, row_count=facts.rows,
                        ipc=s.ipc, schema=facts.schema, batches=facts.batches))
    return tuple(out)
