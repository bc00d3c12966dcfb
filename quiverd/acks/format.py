"""Byte layout of ``shard-<n>/ack.log`` (SPEC §5). Sans-IO: pure functions over bytes.

All integers little-endian; every CRC is CRC-32C.

File header, 14 bytes::

    0   magic[10]  b"QUIVER\\0ACK"
    10  u16        version = 1
    12  u16        reserved = 0

Record, repeated to EOF (framed like a WAL entry)::

    0            u32  record_len     bytes from record_type to the end of body
    4            u8   record_type
    5            body (record_len - 1 bytes)
    4+record_len u32  crc32c         over record_type .. end of body

Bodies by record_type::

    1 OUTCOME          u64 segment_seq | u32 bundle_index | u32 subscriber_id
                       | u8 outcome (1 ack, 2 nack, 3 dropped, 4 rejected)      17 bytes
    2 SEGMENT          u64 segment_seq | u32 bundle_count                        12 bytes
    3 SEGMENT_DELETED  u64 segment_seq                                            8 bytes
    4 SUBSCRIBER       u32 subscriber_id | u8 op (1 add, 2 remove)
                       | u64 start_segment | u8 name_len | name (ASCII)
    5 CHECKPOINT       u64 segment_floor | u32 next_subscriber_id
                       | u32 segment_count | segment_count x (u64 seq | u32 bundle_count)
                       | u32 subscriber_count | per subscriber:
                           u32 id | u64 start_segment | u64 covered_below
                           | u8 name_len | name | u32 entry_count
                           | entry_count x (u64 seq | u32 bundle_index | u8 outcome
                                            | u32 nack_count)
    other              skipped by length (written by a newer build)

A CHECKPOINT is the whole subscriber state: applying it replaces everything before it,
so replay from the last checkpoint is enough. ``covered_below`` is the exclusive form of
the high-water mark (every live segment below it is acked or dropped); entries are the
per-bundle outcomes at or above it (the gap set, plus nacked bundles with their counts).
"""

from __future__ import annotations

import struct

import msgspec

from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord, FormatMismatch

Buffer = bytes | bytearray | memoryview

MAGIC = b"QUIVER\0ACK"
VERSION = 1
_HEADER = struct.Struct("<10sHH")
HEADER_LEN = len(MAGIC) + 2 + 2
assert _HEADER.size == HEADER_LEN == 14

LEN_PREFIX_LEN = 4
CRC_LEN = 4
FRAME_OVERHEAD_LEN = LEN_PREFIX_LEN + 1 + CRC_LEN  # length, type, crc
_U32 = struct.Struct("<I")
# A checkpoint holds every live segment and gap entry; 64 MiB is far above what a
# shard's retention cap allows, and far below what would hurt to allocate.
DEFAULT_MAX_RECORD_LEN = 64 * 1024 * 1024

OUTCOME, SEGMENT, SEGMENT_DELETED, SUBSCRIBER, CHECKPOINT = 1, 2, 3, 4, 5
ACK, NACK, DROPPED, REJECTED = 1, 2, 3, 4
OUTCOMES = (ACK, NACK, DROPPED, REJECTED)
OP_ADD, OP_REMOVE = 1, 2
MAX_NAME_LEN = 64

_OUTCOME = struct.Struct("<QIIB")
_SEGMENT = struct.Struct("<QI")
_SEGMENT_DELETED = struct.Struct("<Q")
_SUBSCRIBER = struct.Struct("<IBQB")
_CP_HEAD = struct.Struct("<QI")
_CP_SEGMENT = struct.Struct("<QI")
_CP_SUB = struct.Struct("<IQQB")
_CP_ENTRY = struct.Struct("<QIBI")
assert _OUTCOME.size == 8 + 4 + 4 + 1 and _SUBSCRIBER.size == 4 + 1 + 8 + 1
assert _CP_SUB.size == 4 + 8 + 8 + 1 and _CP_ENTRY.size == 8 + 4 + 1 + 4


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    segment_seq: int
    bundle_index: int
    subscriber_id: int
    outcome: int  # ACK | NACK | DROPPED | REJECTED


class SegmentFinalized(msgspec.Struct, frozen=True, kw_only=True):
    segment_seq: int
    bundle_count: int


class SegmentDeleted(msgspec.Struct, frozen=True, kw_only=True):
    segment_seq: int


class SubscriberChange(msgspec.Struct, frozen=True, kw_only=True):
    subscriber_id: int
    op: int  # OP_ADD | OP_REMOVE
    name: str
    start_segment: int


class SubscriberCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    subscriber_id: int
    name: str
    start_segment: int
    covered_below: int
    # (segment_seq, bundle_index, outcome, nack_count), sorted by (seq, index)
    entries: tuple[tuple[int, int, int, int], ...]


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    segment_floor: int  # one past the highest segment_seq ever finalized
    next_subscriber_id: int
    segments: tuple[tuple[int, int], ...]  # (segment_seq, bundle_count), ascending
    subscribers: tuple[SubscriberCheckpoint, ...]  # ascending id


Record = Outcome | SegmentFinalized | SegmentDeleted | SubscriberChange | Checkpoint


class Frame(msgspec.Struct, frozen=True, kw_only=True):
    """One complete record frame; ``crc_ok`` False means its bytes are damaged."""

    offset: int  # file offset of record_len
    end: int  # file offset just past the crc
    record_type: int
    body: bytes
    crc_ok: bool


class BadLength(msgspec.Struct, frozen=True, kw_only=True):
    """A record_len that no writer produces (0, or above the maximum): stop here."""

    offset: int
    record_len: int


class MalformedRecord(ValueError):
    """A CRC-valid body that does not decode: a writer bug, never a torn write."""


def encode_header() -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0)


def decode_header(buf: Buffer, *, path: str) -> int:
    """Validate the file header; returns the version."""
    if len(buf) < HEADER_LEN:
        raise CorruptRecord(path, 0, f"file is {len(buf)} bytes, shorter than the header")
    magic, version, reserved = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptRecord(path, 0, f"wrong magic {magic!r}, expected {MAGIC!r}: not an ack.log")
    if version != VERSION:
        raise FormatMismatch(path, 10, f"unknown ack.log version {version}, this build reads 1")
    if reserved != 0:
        raise FormatMismatch(path, 12, f"reserved header field is {reserved:#x}, must be 0")
    return int(version)


def encode(record: Record) -> bytes:
    """The framed bytes of one record, ready to append."""
    if isinstance(record, Outcome):
        if record.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {record.outcome}")
        rtype, body = OUTCOME, _OUTCOME.pack(
            record.segment_seq, record.bundle_index, record.subscriber_id, record.outcome
        )
    elif isinstance(record, SegmentFinalized):
        rtype, body = SEGMENT, _SEGMENT.pack(record.segment_seq, record.bundle_count)
    elif isinstance(record, SegmentDeleted):
        rtype, body = SEGMENT_DELETED, _SEGMENT_DELETED.pack(record.segment_seq)
    elif isinstance(record, SubscriberChange):
        name = _name_bytes(record.name)
        rtype = SUBSCRIBER
        body = _SUBSCRIBER.pack(record.subscriber_id, record.op, record.start_segment, len(name))
        body += name
    else:
        rtype, body = CHECKPOINT, _encode_checkpoint(record)
    return encode_frame(rtype, body)


def encode_frame(record_type: int, body: bytes) -> bytes:
    """Frame any body (tests use it to write unknown types)."""
    typed = bytes((record_type,)) + body
    if len(typed) > 0xFFFF_FFFF:
        raise ValueError(f"record of {len(typed)} bytes does not fit a u32 length")
    return _U32.pack(len(typed)) + typed + _U32.pack(crc32c(typed))


def _name_bytes(name: str) -> bytes:
    raw = name.encode("ascii")
    if not 1 <= len(raw) <= MAX_NAME_LEN:
        raise ValueError(f"subscriber name must be 1..{MAX_NAME_LEN} bytes, got {len(raw)}")
    return raw


def _encode_checkpoint(cp: Checkpoint) -> bytes:
    parts = [_CP_HEAD.pack(cp.segment_floor, cp.next_subscriber_id), _U32.pack(len(cp.segments))]
    parts += [_CP_SEGMENT.pack(seq, count) for seq, count in cp.segments]
    parts.append(_U32.pack(len(cp.subscribers)))
    for sub in cp.subscribers:
        name = _name_bytes(sub.name)
        parts.append(_CP_SUB.pack(sub.subscriber_id, sub.start_segment, sub.covered_below,
                                  len(name)))
        parts += [name, _U32.pack(len(sub.entries))]
        parts += [_CP_ENTRY.pack(*entry) for entry in sub.entries]
    return b"".join(parts)


class RecordScanner:
    """Incremental frame splitter: ``feed`` bytes, then call ``next`` until it returns None.

    Lengths are checked against ``max_record_len`` before any body is awaited, so a
    damaged length can never make the reader buffer or allocate more than that. The
    buffer holds at most one record plus one fed chunk.
    """

    def __init__(self, *, offset: int = HEADER_LEN,
                 max_record_len: int = DEFAULT_MAX_RECORD_LEN) -> None:
        self._buf = bytearray()
        self._pos = 0  # consumed bytes at the front of _buf
        self._offset = offset  # file offset of _buf[_pos]
        self._max = max_record_len

    @property
    def offset(self) -> int:
        """File offset of the first byte not yet returned in a frame."""
        return self._offset

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: Buffer) -> None:
        # Drop consumed bytes first so the buffer stays one record + one chunk.
        del self._buf[: self._pos]
        self._pos = 0
        self._buf += data

    def next(self) -> Frame | BadLength | None:
        """The next frame, a BadLength (sticky), or None when more bytes are needed."""
        if self.buffered < LEN_PREFIX_LEN:
            return None
        (record_len,) = _U32.unpack_from(self._buf, self._pos)
        if record_len < 1 or record_len > self._max:
            return BadLength(offset=self._offset, record_len=record_len)
        total = LEN_PREFIX_LEN + record_len + CRC_LEN
        if self.buffered < total:
            return None
        start = self._pos + LEN_PREFIX_LEN
        typed = bytes(self._buf[start : start + record_len])
        (crc,) = _U32.unpack_from(self._buf, start + record_len)
        frame = Frame(offset=self._offset, end=self._offset + total, record_type=typed[0],
                      body=typed[1:], crc_ok=crc32c(typed) == crc)
        self._pos += total
        self._offset += total
        return frame


def decode_record(record_type: int, body: bytes) -> Record | None:
    """Decode a CRC-valid body; None for a record type this build does not know."""
    try:
        if record_type == OUTCOME:
            _exact(body, _OUTCOME.size)
            seq, idx, sub, outcome = _OUTCOME.unpack(body)
            if outcome not in OUTCOMES:
                raise MalformedRecord(f"unknown outcome {outcome}")
            return Outcome(segment_seq=seq, bundle_index=idx, subscriber_id=sub, outcome=outcome)
        if record_type == SEGMENT:
            _exact(body, _SEGMENT.size)
            seq, count = _SEGMENT.unpack(body)
            return SegmentFinalized(segment_seq=seq, bundle_count=count)
        if record_type == SEGMENT_DELETED:
            _exact(body, _SEGMENT_DELETED.size)
            return SegmentDeleted(segment_seq=_SEGMENT_DELETED.unpack(body)[0])
        if record_type == SUBSCRIBER:
            sub, op, start, name_len = _SUBSCRIBER.unpack_from(body, 0)
            _exact(body, _SUBSCRIBER.size + name_len)
            if op not in (OP_ADD, OP_REMOVE):
                raise MalformedRecord(f"unknown subscriber op {op}")
            name = _name(body[_SUBSCRIBER.size :])
            return SubscriberChange(subscriber_id=sub, op=op, name=name, start_segment=start)
        if record_type == CHECKPOINT:
            return _decode_checkpoint(body)
    except struct.error as exc:
        raise MalformedRecord(f"record type {record_type}: {exc}") from exc
    return None


def _exact(body: bytes, size: int) -> None:
    if len(body) != size:
        raise MalformedRecord(f"body is {len(body)} bytes, expected {size}")


def _name(raw: bytes) -> str:
    try:
        name = raw.decode("ascii")
        _name_bytes(name)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedRecord(f"bad subscriber name {raw!r}: {exc}") from exc
    return name


def _take(body: bytes, pos: int, count: int, size: int) -> None:
    # Check a declared count against the bytes left before looping over it.
    if pos + count * size > len(body):
        raise MalformedRecord(f"{count} items of {size} bytes overrun the body at {pos}")


def _decode_checkpoint(body: bytes) -> Checkpoint:
    floor, next_id = _CP_HEAD.unpack_from(body, 0)
    pos = _CP_HEAD.size
    (seg_count,) = _U32.unpack_from(body, pos)
    pos += 4
    _take(body, pos, seg_count, _CP_SEGMENT.size)
    segments = tuple(_CP_SEGMENT.iter_unpack(body[pos : pos + seg_count * _CP_SEGMENT.size]))
    pos += seg_count * _CP_SEGMENT.size
    (sub_count,) = _U32.unpack_from(body, pos)
    pos += 4
    _take(body, pos, sub_count, _CP_SUB.size + 1 + 4)
    subs = []
    for _ in range(sub_count):
        sub_id, start, covered, name_len = _CP_SUB.unpack_from(body, pos)
        pos += _CP_SUB.size
        name = _name(body[pos : pos + name_len])
        pos += name_len
        (n_entries,) = _U32.unpack_from(body, pos)
        pos += 4
        _take(body, pos, n_entries, _CP_ENTRY.size)
        raw = body[pos : pos + n_entries * _CP_ENTRY.size]
        pos += len(raw)
        subs.append(SubscriberCheckpoint(subscriber_id=sub_id, name=name, start_segment=start,
                                         covered_below=covered,
                                         entries=tuple(_CP_ENTRY.iter_unpack(raw))))
    if pos != len(body):
        raise MalformedRecord(f"{len(body) - pos} trailing bytes after the checkpoint")
    return Checkpoint(segment_floor=floor, next_subscriber_id=next_id, segments=segments,
                      subscribers=tuple(subs))
