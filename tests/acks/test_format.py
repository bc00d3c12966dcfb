"""ack.log byte layout: vectors written by hand with struct.pack, never by the encoder."""

from __future__ import annotations

import struct

import pytest

from quiverd.acks import format as fmt
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord, FormatMismatch


def frame(rtype: int, body: bytes) -> bytes:
    typed = bytes([rtype]) + body
    return struct.pack("<I", len(typed)) + typed + struct.pack("<I", crc32c(typed))


def test_header_bytes_exact() -> None:
    assert fmt.encode_header() == b"QUIVER\x00ACK" + struct.pack("<HH", 1, 0)
    assert fmt.HEADER_LEN == 14
    assert fmt.decode_header(fmt.encode_header(), path="a") == 1


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"QUIVER\x00ACK\x01\x00", CorruptRecord),  # short
        (b"QUIVER\x00WAL\x01\x00\x00\x00", CorruptRecord),  # wrong magic
        (b"QUIVER\x00ACK\x02\x00\x00\x00", FormatMismatch),  # version
        (b"QUIVER\x00ACK\x01\x00\x01\x00", FormatMismatch),  # reserved
    ],
)
def test_header_decode_rejects_bad_header(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        fmt.decode_header(raw, path="ack.log")


def test_outcome_bytes_exact() -> None:
    rec = fmt.Outcome(segment_seq=0x0102030405, bundle_index=7, subscriber_id=3,
                      outcome=fmt.DROPPED)
    want = (struct.pack("<I", 18) + b"\x01" + struct.pack("<QIIB", 0x0102030405, 7, 3, 3))
    want += struct.pack("<I", crc32c(want[4:]))
    assert fmt.encode(rec) == want
    assert len(want) == 4 + 1 + 17 + 4


def test_segment_and_deleted_bytes_exact() -> None:
    assert fmt.encode(fmt.SegmentFinalized(segment_seq=9, bundle_count=100)) == frame(
        2, struct.pack("<QI", 9, 100))
    assert fmt.encode(fmt.SegmentDeleted(segment_seq=2**64 - 1)) == frame(
        3, b"\xff" * 8)


def test_subscriber_bytes_exact() -> None:
    rec = fmt.SubscriberChange(subscriber_id=5, op=fmt.OP_ADD, name="up-load_1",
                               start_segment=42)
    body = struct.pack("<IBQB", 5, 1, 42, 9) + b"up-load_1"
    assert fmt.encode(rec) == frame(4, body)


def test_checkpoint_bytes_exact() -> None:
    cp = fmt.Checkpoint(
        segment_floor=12, next_subscriber_id=3, segments=((10, 2), (11, 4)),
        subscribers=(
            fmt.SubscriberCheckpoint(subscriber_id=1, name="a", start_segment=0,
                                     covered_below=10, entries=((11, 1, 1, 0), (11, 2, 2, 5))),
            fmt.SubscriberCheckpoint(subscriber_id=2, name="bb", start_segment=11,
                                     covered_below=11, entries=()),
        ),
    )
    body = struct.pack("<QI", 12, 3) + struct.pack("<I", 2)
    body += struct.pack("<QI", 10, 2) + struct.pack("<QI", 11, 4) + struct.pack("<I", 2)
    body += struct.pack("<IQQB", 1, 0, 10, 1) + b"a" + struct.pack("<I", 2)
    body += struct.pack("<QIBI", 11, 1, 1, 0) + struct.pack("<QIBI", 11, 2, 2, 5)
    body += struct.pack("<IQQB", 2, 11, 11, 2) + b"bb" + struct.pack("<I", 0)
    assert fmt.encode(cp) == frame(5, body)
    assert fmt.decode_record(5, body) == cp


@pytest.mark.parametrize(
    "record",
    [
        fmt.Outcome(segment_seq=1, bundle_index=2, subscriber_id=3, outcome=fmt.ACK),
        fmt.SegmentFinalized(segment_seq=1, bundle_count=0),
        fmt.SegmentDeleted(segment_seq=1),
        fmt.SubscriberChange(subscriber_id=1, op=fmt.OP_REMOVE, name="x" * 64, start_segment=0),
        fmt.Checkpoint(segment_floor=0, next_subscriber_id=1, segments=(), subscribers=()),
    ],
)
def test_decode_roundtrip_every_type(record: fmt.Record) -> None:
    decoder = fmt.RecordScanner()
    decoder.feed(fmt.encode(record))
    got = decoder.next()
    assert isinstance(got, fmt.Frame) and got.crc_ok
    assert fmt.decode_record(got.record_type, got.body) == record


def test_decoder_incremental_byte_by_byte() -> None:
    data = fmt.encode(fmt.SegmentDeleted(segment_seq=1)) + fmt.encode(
        fmt.SegmentFinalized(segment_seq=2, bundle_count=3))
    decoder = fmt.RecordScanner(offset=14)
    frames = []
    for b in data:
        decoder.feed(bytes([b]))
        item = decoder.next()
        if item is not None:
            assert isinstance(item, fmt.Frame)
            frames.append(item)
    assert [(f.offset, f.end, f.record_type) for f in frames] == [(14, 31, 3), (31, 52, 2)]
    assert decoder.offset == 52 and decoder.buffered == 0


def test_decoder_flags_bad_crc_and_bad_length() -> None:
    good = bytearray(fmt.encode(fmt.SegmentDeleted(segment_seq=1)))
    good[6] ^= 0x01
    decoder = fmt.RecordScanner(max_record_len=100)
    decoder.feed(bytes(good) + struct.pack("<I", 101))
    item = decoder.next()
    assert isinstance(item, fmt.Frame) and not item.crc_ok
    assert decoder.next() == fmt.BadLength(offset=14 + len(good), record_len=101)
    decoder.feed(b"\x00" * 4)
    zero = fmt.RecordScanner()
    zero.feed(b"\x00" * 8)
    assert isinstance(zero.next(), fmt.BadLength)  # a zero-filled tail is never a record


def test_decoder_checks_length_before_waiting_for_body() -> None:
    decoder = fmt.RecordScanner(max_record_len=1024)
    decoder.feed(struct.pack("<I", 0xFFFF_FFFF))
    assert isinstance(decoder.next(), fmt.BadLength)


def test_decode_unknown_type_skipped() -> None:
    decoder = fmt.RecordScanner()
    decoder.feed(frame(200, b"future") + fmt.encode(fmt.SegmentDeleted(segment_seq=4)))
    first, second = decoder.next(), decoder.next()
    assert isinstance(first, fmt.Frame) and fmt.decode_record(first.record_type, first.body) is None
    assert isinstance(second, fmt.Frame)
    assert fmt.decode_record(second.record_type, second.body) == fmt.SegmentDeleted(segment_seq=4)


@pytest.mark.parametrize(
    ("rtype", "body"),
    [
        (1, struct.pack("<QIIB", 1, 2, 3, 9)),  # unknown outcome
        (1, struct.pack("<QII", 1, 2, 3)),  # short
        (2, struct.pack("<QIB", 1, 2, 0)),  # long
        (4, struct.pack("<IBQB", 1, 7, 0, 1) + b"a"),  # unknown op
        (4, struct.pack("<IBQB", 1, 1, 0, 5) + b"a"),  # name_len beyond body
        (4, struct.pack("<IBQB", 1, 1, 0, 1) + b"\xff"),  # not ascii
        (5, struct.pack("<QII", 0, 1, 1_000_000)),  # segment count beyond body
        (5, struct.pack("<QIII", 0, 1, 0, 0) + b"x"),  # trailing bytes
    ],
)
def test_decode_malformed_body_rejected(rtype: int, body: bytes) -> None:
    with pytest.raises(fmt.MalformedRecord):
        fmt.decode_record(rtype, body)


def test_encode_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="outcome"):
        fmt.encode(fmt.Outcome(segment_seq=1, bundle_index=0, subscriber_id=1, outcome=5))
    with pytest.raises(ValueError, match="name"):
        fmt.encode(fmt.SubscriberChange(subscriber_id=1, op=1, name="x" * 65, start_segment=0))
