"""Socket protocol v2 (v1: the same without REJECT_BUNDLE), sans-IO: frames in, messages
out (no sockets here).

All integers little-endian. Every frame::

    u32 frame_len        bytes after this field (type + body); checked before allocation
    u8  frame_type       FrameType
    body

    HELLO       0x01  c->s  magic "QVR" | u16 min_version | u16 max_version
                            | u8 role (1 producer, 2 subscriber)
    HELLO_OK    0x02  s->c  u16 version | u32 max_bundle_bytes | u16 max_inflight
    BUNDLE      0x03  c->s  u32 request_id (>0) | client | txn | slots | end check
    ACK         0x04  s->c  u32 request_id | u16 shard | u64 sequence
    ERROR       0x05  s->c  u32 request_id (0 = connection) | u16 code | u16 len | utf8 message
    JOB         0x06  c->s  u32 request_id (>0) | u32 len | utf8 JSON object (the request)
    JOB_OK      0x07  s->c  u32 request_id | u32 len | utf8 JSON object (the reply)
    SUBSCRIBE   0x10  c->s  u8 len | name [a-z0-9_-]{1,64} | u16 window
    SUBSCRIBED  0x11  s->c  u8 ok (1)
    DELIVERY    0x12  s->c  u16 shard | u64 segment_seq | u32 bundle_index | client | txn
                            | i64 ingestion_ts_ns | slots | end check
    ACK_BUNDLE  0x13  c->s  u16 shard | u64 segment_seq | u32 bundle_index
    NACK_BUNDLE 0x14  c->s  u16 shard | u64 segment_seq | u32 bundle_index
    STREAM      0x15  c->s  u32 request_id (>0) | u32 len | utf8 JSON object (the request)
    STREAM_OK   0x16  s->c  u32 request_id | u32 len | utf8 JSON object (the reply)
    REJECT_BUNDLE 0x17 c->s u16 shard | u64 segment_seq | u32 bundle_index (version 2)

    client     u8 len | ascii [A-Za-z0-9._-]{1,255}
    txn        u8 flag (0 none, 1 tag) [| u16 len | utf8 job_id | u32 partition
               | u32 attempt | u64 row_offset]
    slots      u64 slot_bitmap | per set bit, ascending: u32 row_count | u32 payload_len
               | payload (one Arrow IPC stream)
    end check  u64 total_rows | u32 crc32c over every body byte before this crc

JOB carries the transactional-write requests of SPEC §7 (``op``: end_partition,
commit, abort, status; docs/protocol.md lists their fields), producers only, in the
same request-id space and window as BUNDLE. Its JSON is at most MAX_JOB_BODY_BYTES
(1 MiB) and must be an object. The answer is JOB_OK or an ERROR (JOB_CONFLICT when
the job was decided otherwise).

STREAM carries a subscriber's ranged reads (``op``: open, latest, fetch, ack_through;
docs/protocol.md "Ranged reads"), laid out like JOB but at most SMALL_FRAME_MAX long:
a ``fetch`` is answered by the DELIVERY frames of its range, then STREAM_OK.

The end check exists because an Arrow IPC stream cut at a message boundary reads
back as complete: the declared row counts and the CRC are what catch a cut or
damaged bundle. Error codes and which of them close the connection: see
``ErrorCode`` / ``CLOSES_CONNECTION`` and docs/protocol.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Protocol

import pyarrow as pa

from quiverd.kernel.errors import (
    AtCapacity,
    CatalogUnavailable,
    JobConflict,
    ProtocolError,
    QuiverError,
    SchemaConflict,
    ShuttingDown,
    Unauthorized,
)
from quiverd.protocol.decode import PAYLOAD_FRAMES, decode_body, validate_bundle
from quiverd.protocol.frames import (
    CLOSES_CONNECTION,
    ERROR_HEAD,
    FRAME_HEADER,
    JOB_FRAME_MAX,
    MAX_FRAME_OVERHEAD,
    MAX_JOB_BODY_BYTES,
    MAX_MESSAGE_LEN,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    U32,
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
    encode_ack,
    encode_ack_bundle,
    encode_bundle,
    encode_delivery,
    encode_error,
    encode_hello,
    encode_hello_ok,
    encode_job_reply,
    encode_job_request,
    encode_nack_bundle,
    encode_reject_bundle,
    encode_stream_reply,
    encode_stream_request,
    encode_subscribe,
    encode_subscribed,
    max_frame_bytes,
)

# Callers import everything protocol-related from here; protocol_frames is an
# implementation split, not a second API.
__all__ = [
    "CLOSES_CONNECTION", "JOB_FRAME_MAX", "MAX_FRAME_OVERHEAD", "MAX_JOB_BODY_BYTES",
    "PROTOCOL_VERSION", "REPLY_FRAME_MAX", "SMALL_FRAME_MAX", "Ack", "AckBundle",
    "BundleFrame", "Delivery", "Error", "ErrorCode", "FrameDecoder", "FrameType", "Hello",
    "HelloOk", "JobReply", "JobRequest", "MIN_PROTOCOL_VERSION", "Message", "NackBundle",
    "RejectBundle", "Role", "StreamReply",
    "StreamRequest", "Subscribe",
    "Subscribed", "decode_body", "encode_ack", "encode_ack_bundle", "encode_bundle",
    "encode_delivery", "encode_error", "encode_hello", "encode_hello_ok", "encode_job_reply",
    "encode_job_request", "encode_nack_bundle", "encode_reject_bundle", "encode_stream_reply",
    "encode_stream_request", "encode_subscribe", "encode_subscribed",
    "error_code_for", "exception_for", "hello_reply", "max_frame_bytes", "negotiate",
    "validate_bundle",
]

Buffer = bytes | bytearray | memoryview

# Frames without Arrow payloads are never longer than an ERROR with the longest message,
# except JOB/JOB_OK, whose JSON may reach MAX_JOB_BODY_BYTES.
SMALL_FRAME_MAX = 1 + ERROR_HEAD.size + MAX_MESSAGE_LEN
# STREAM/STREAM_OK bodies are small JSON objects: SMALL_FRAME_MAX bounds them, and the
# server reserves no budget for them (they are answered before the next one is read).
JOB_FRAMES = frozenset({FrameType.JOB, FrameType.JOB_OK})
# Frames whose body is reserved (``reserve``) before it is allocated: every kind that
# may be longer than SMALL_FRAME_MAX (a JOB's JSON reaches 1 MiB).
RESERVED_FRAMES = PAYLOAD_FRAMES | JOB_FRAMES
# The decoder limit of a producer client: the longest frame a server sends it.
REPLY_FRAME_MAX = max(SMALL_FRAME_MAX, JOB_FRAME_MAX)
SERVER_FRAMES = frozenset(
    {FrameType.HELLO_OK, FrameType.ACK, FrameType.ERROR, FrameType.JOB_OK,
     FrameType.SUBSCRIBED, FrameType.DELIVERY, FrameType.STREAM_OK}
)
ROLE_FRAMES = MappingProxyType(
    {
        Role.PRODUCER: frozenset({FrameType.BUNDLE, FrameType.JOB}),
        Role.SUBSCRIBER: frozenset(
            {FrameType.SUBSCRIBE, FrameType.ACK_BUNDLE, FrameType.NACK_BUNDLE,
             FrameType.REJECT_BUNDLE, FrameType.STREAM}
        ),
    }
)
# Frames a later protocol version added: refused on a connection that agreed an earlier one.
FRAME_SINCE = MappingProxyType({FrameType.REJECT_BUNDLE: 2})
# recv_into straight into a frame buffer only pays off for big remainders; smaller
# reads go through the scratch buffer so one recv can hold many small frames.
SCRATCH_BYTES = 256 * 1024
RECV_DIRECT_MIN = 64 * 1024


class FrameDecoder:
    """Incremental decoder: bytes in any split -> complete messages.

    ``from_client=True`` (the server's decoder) also enforces the handshake: the
    first frame must be HELLO, then only the frames of the HELLO's role. Each frame
    gets its own buffer, never reused, so decoded payloads are zero-copy read-only
    memoryviews into it. After a ProtocolError the decoder is spent: the caller
    answers with an ERROR frame and closes (frames decoded earlier in the same
    ``feed`` call are dropped with it, as the connection is closing anyway).

    Two ways in: ``feed(data)``, or asyncio's BufferedProtocol pair
    ``get_buffer``/``buffer_updated`` which lets large payloads be received
    straight into their frame buffer.

    With ``reserve`` (the server), a BUNDLE or JOB header's body length is reserved
    before its buffer is allocated; a refused reservation pauses the decoder
    (``awaiting`` says how many bytes), holding the rest of the input, until the
    caller got the bytes and calls ``resume()``.
    """

    def __init__(self, max_frame_bytes: int, *, from_client: bool = True,
                 reserve: Callable[[int], bool] | None = None,
                 pool: BufferSource | None = None) -> None:
        self._max_frame_bytes = max_frame_bytes
        # Payload frame buffers come from ``pool`` (the server's receive-buffer pool);
        # ``taken`` lists the pooled buffer of each payload frame decoded, in order, so
        # the caller can give it back once nothing reads the frame any more.
        self._pool = pool
        self._pooled: Any = None
        self.taken: deque[Any] = deque()
        self._from_client = from_client
        # Called with a BUNDLE/DELIVERY/JOB body length before its buffer is allocated;
        # False pauses the decoder until ``resume()`` (the server's pending-bytes budget).
        self._reserve = reserve
        self.role: Role | None = None  # set by the client's HELLO (server side)
        self.version = 0  # the version the client's HELLO agrees with this build (0: none)
        self._allowed: frozenset[FrameType] = frozenset()  # the role's frames at that version
        self._head = bytearray(FRAME_HEADER.size)
        self._head_filled = 0
        self._frame_type = FrameType.HELLO
        self._body: memoryview | None = None
        self._body_filled = 0
        self._scratch: bytearray | None = None
        self._direct = False
        self._failed: ProtocolError | None = None
        self._awaiting: int | None = None  # body bytes a paused frame waits to reserve
        self._held: memoryview | None = None  # input after the paused frame's header

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished frame held (non-zero at EOF means a cut frame)."""
        if self._awaiting is not None:
            return FRAME_HEADER.size + (len(self._held) if self._held is not None else 0)
        if self._body is None:
            return self._head_filled
        return FRAME_HEADER.size + self._body_filled

    @property
    def awaiting(self) -> int | None:
        """Body bytes the next frame waits to reserve (``reserve`` said no), else None."""
        return self._awaiting

    @property
    def expected(self) -> int:
        """Length of the frame being received (header included), 0 between frames."""
        if self._body is not None:
            return FRAME_HEADER.size + len(self._body)
        return FRAME_HEADER.size + self._awaiting if self._awaiting is not None else 0

    def feed(self, data: Buffer) -> list[Message]:
        """Decode ``data``; stops early, holding the rest, when a frame must wait for
        its reservation (``awaiting``); then ``resume()`` goes on."""
        if self._failed is not None:
            raise self._failed
        assert self._awaiting is None, "feed() while a frame awaits its reservation"
        return self._consume(memoryview(data).cast("B"))

    def resume(self) -> list[Message]:
        """The paused frame's bytes were reserved: allocate it and decode the held input."""
        assert self._awaiting is not None, "resume() without a paused frame"
        empty = self._awaiting == 0
        self._allocate(self._awaiting)
        held, self._held = self._held, None
        out: list[Message] = []
        try:
            if empty:  # a zero-length body is complete at once (and fails to decode)
                out.append(self._finish_frame())
        except ProtocolError as exc:
            self._failed = exc
            raise
        if held is not None:
            out += self._consume(held)
        return out

    def _consume(self, view: memoryview) -> list[Message]:
        out: list[Message] = []
        pos, end = 0, len(view)
        try:
            while pos < end:
                if self._body is None:
                    take = min(FRAME_HEADER.size - self._head_filled, end - pos)
                    filled = self._head_filled
                    self._head[filled : filled + take] = view[pos : pos + take]
                    self._head_filled += take
                    pos += take
                    self._on_header_bytes()
                    if self._awaiting is not None:
                        # Nothing is allocated until the reservation is granted; the
                        # rest of the input waits (a view, not a copy).
                        self._held = view[pos:] if pos < end else None
                        break
                else:
                    body = self._body
                    take = min(len(body) - self._body_filled, end - pos)
                    body[self._body_filled : self._body_filled + take] = view[pos : pos + take]
                    self._body_filled += take
                    pos += take
                if self._body is not None and self._body_filled == len(self._body):
                    out.append(self._finish_frame())
        except ProtocolError as exc:
            self._failed = exc
            raise
        return out

    def close(self) -> None:
        """Drop every buffer held (the connection is closing); the decoder is spent."""
        self._failed = self._failed or ProtocolError(ErrorCode.MALFORMED, "decoder closed")
        self._body = self._held = self._scratch = None
        self._awaiting = None

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next recv_into should write (asyncio.BufferedProtocol)."""
        assert self._awaiting is None, "get_buffer() while a frame awaits its reservation"
        body = self._body
        if body is not None and len(body) - self._body_filled >= RECV_DIRECT_MIN:
            self._direct = True
            return memoryview(body)[self._body_filled :]
        self._direct = False
        if self._scratch is None:
            self._scratch = bytearray(SCRATCH_BYTES)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """``nbytes`` were written into the last ``get_buffer`` view."""
        if not self._direct:
            assert self._scratch is not None
            return self.feed(memoryview(self._scratch)[:nbytes])
        assert self._body is not None
        self._body_filled += nbytes
        if self._body_filled < len(self._body):
            return []
        try:
            return [self._finish_frame()]
        except ProtocolError as exc:
            self._failed = exc
            raise

    def _on_header_bytes(self) -> None:
        # The length is judged as soon as its 4 bytes are in, before the type byte
        # arrives and long before anything is allocated.
        if self._head_filled < U32.size:
            return
        (frame_len,) = U32.unpack_from(self._head)
        if frame_len > self._max_frame_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"frame of {frame_len} bytes exceeds the maximum frame size "
                f"{self._max_frame_bytes} (max_bundle_bytes + overhead)",
            )
        if frame_len == 0:
            raise ProtocolError(ErrorCode.MALFORMED, "frame_len 0: a frame holds at least its type")
        if self._head_filled < FRAME_HEADER.size:
            return
        frame_type = self._check_type(self._head[4])
        longest = JOB_FRAME_MAX if frame_type in JOB_FRAMES else SMALL_FRAME_MAX
        if frame_type not in PAYLOAD_FRAMES and frame_len > longest:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"{frame_type.name} frame of {frame_len} bytes is longer than any valid one",
            )
        self._frame_type = frame_type
        body_len = frame_len - 1
        if (frame_type in RESERVED_FRAMES and self._reserve is not None
                and not self._reserve(body_len)):
            self._awaiting = body_len
            return
        self._allocate(body_len)

    def _allocate(self, body_len: int) -> None:
        self._awaiting = None
        if self._pool is not None and self._frame_type in PAYLOAD_FRAMES:
            self._body, self._pooled = self._pool.take(body_len)
        else:
            self._body = _frame_buffer(body_len)
        self._body_filled = 0
        self._head_filled = 0

    def _check_type(self, raw: int) -> FrameType:
        try:
            frame_type = FrameType(raw)
        except ValueError:
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown frame type 0x{raw:02x}") from None
        if not self._from_client:
            if frame_type not in SERVER_FRAMES:
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"{frame_type.name} frames are not sent by servers"
                )
            return frame_type
        if self.role is None:
            if frame_type is not FrameType.HELLO:
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"expected HELLO as the first frame, got {frame_type.name}"
                )
        elif frame_type not in self._allowed:  # one set lookup per frame, as before
            if frame_type in ROLE_FRAMES[self.role]:
                raise ProtocolError(
                    ErrorCode.MALFORMED,
                    f"{frame_type.name} needs protocol version {FRAME_SINCE[frame_type]}; this "
                    f"connection agreed version {self.version} (upgrade the client library)",
                )
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"{frame_type.name} frame not allowed on a {self.role.name.lower()} connection",
            )
        return frame_type

    def _finish_frame(self) -> Message:
        assert self._body is not None
        body = memoryview(self._body).toreadonly()
        self._body = None
        self._body_filled = 0
        if self._pool is not None and self._frame_type in PAYLOAD_FRAMES:
            self.taken.append(self._pooled)
            self._pooled = None
        msg = decode_body(self._frame_type, body)
        if isinstance(msg, Hello) and self._from_client:
            self.role = msg.role
            try:
                self.version = negotiate(msg)  # the server answers the same (HELLO_OK)
            except ProtocolError:
                self.version = 0  # the server refuses it (UNSUPPORTED_VERSION)
            self._allowed = frozenset(f for f in ROLE_FRAMES[msg.role]
                                      if FRAME_SINCE.get(f, 1) <= self.version)
        return msg


class BufferSource(Protocol):
    def take(self, nbytes: int) -> tuple[memoryview, Any]: ...


def _frame_buffer(nbytes: int) -> memoryview:
    """A writable, uninitialized frame buffer from Arrow's memory pool.

    Frames end up as zero-copy Arrow buffers held by the open segment; the pool
    (jemalloc/mimalloc) hands back recently freed, already-faulted memory, where a
    zero-filled bytearray would touch fresh pages (slow on these machines, NOTES.md).
    """
    return memoryview(pa.allocate_buffer(nbytes)).cast("B")


def negotiate(hello: Hello, *, min_version: int = MIN_PROTOCOL_VERSION,
              max_version: int = PROTOCOL_VERSION) -> int:
    """Highest version both sides speak, or ProtocolError(UNSUPPORTED_VERSION)."""
    lo, hi = max(hello.min_version, min_version), min(hello.max_version, max_version)
    if lo > hi:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"client speaks protocol versions {hello.min_version}..{hello.max_version}, "
            f"this server {min_version}..{max_version}",
        )
    return hi


def hello_reply(hello: Hello, *, max_bundle_bytes: int, max_inflight: int) -> bytes:
    """The server's HELLO_OK for ``hello`` (raises like ``negotiate``)."""
    version = negotiate(hello)
    return encode_hello_ok(
        version=version, max_bundle_bytes=max_bundle_bytes, max_inflight=max_inflight
    )


UNAVAILABLE_HINT = ("the daemon cannot reach its catalog (catalog.dsn) now; retry the request "
                    "in a moment: nothing was decided, staged rows stay held")


def exception_for(err: Error) -> QuiverError:
    """The quiverd.kernel.errors exception a client raises for an ERROR frame."""
    match err.code:
        case ErrorCode.AT_CAPACITY:
            return AtCapacity(err.message)
        case ErrorCode.SHUTTING_DOWN:
            return ShuttingDown(err.message)
        case ErrorCode.UNAUTHORIZED:
            return Unauthorized(err.message)
        case ErrorCode.JOB_CONFLICT:
            return JobConflict(err.message)
        case ErrorCode.UNAVAILABLE:
            return CatalogUnavailable(err.message, hint=UNAVAILABLE_HINT)
        case ErrorCode.SCHEMA_CONFLICT:
            return SchemaConflict(err.message)
    return ProtocolError(err.code, err.message)


def error_code_for(exc: BaseException) -> ErrorCode:
    """The wire code a server sends for ``exc`` (INTERNAL for anything unexpected)."""
    if isinstance(exc, ProtocolError) and exc.code in ErrorCode._value2member_map_:
        return ErrorCode(exc.code)
    for cls, code in (
        (AtCapacity, ErrorCode.AT_CAPACITY),
        (ShuttingDown, ErrorCode.SHUTTING_DOWN),
        (Unauthorized, ErrorCode.UNAUTHORIZED),
        (JobConflict, ErrorCode.JOB_CONFLICT),
        (CatalogUnavailable, ErrorCode.UNAVAILABLE),
        (SchemaConflict, ErrorCode.SCHEMA_CONFLICT),
    ):
        if isinstance(exc, cls):
            return code
    return ErrorCode.INTERNAL


