"""Socket protocol v1: byte-exact vectors, round trips, splits, limits, fuzzing."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quiverd.kernel.bundle import Slot, TxnTag, encode_ipc_stream, read_ipc_stream
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import AtCapacity, JobConflict, ProtocolError, ShuttingDown, Unauthorized
from quiverd.protocol import codec as p
from tests.tiers import size

MAX_FRAME = p.max_frame_bytes(1 << 20)
TXN = TxnTag(job_id="job-é", partition=3, attempt=1, row_offset=1000)


def server_decoder() -> p.FrameDecoder:
    return p.FrameDecoder(MAX_FRAME)


def client_decoder() -> p.FrameDecoder:
    return p.FrameDecoder(MAX_FRAME, from_client=False)


def hello_wire(role: p.Role = p.Role.PRODUCER) -> bytes:
    return struct.pack("<IB3sHHB", 9, 0x01, b"QVR", 1, 1, role)


def table(n: int = 3, batches: int = 1) -> pa.Table:
    col = pa.array(range(n * batches), pa.int64())
    batches_ = [pa.record_batch([col.slice(i * n, n)], ["x"]) for i in range(batches)]
    return pa.Table.from_batches(batches_)


def bundle_wire(request_id: int, payloads: dict[int, bytes], rows: dict[int, int]) -> bytes:
    return b"".join(p.encode_bundle(request_id, "web", payloads, rows))


def decode_one(wire: bytes, decoder: p.FrameDecoder) -> p.Message:
    (msg,) = decoder.feed(wire)
    return msg


# --- byte-exact vectors (expected bytes written by hand) -----------------------------


def test_encode_hello_matches_vector() -> None:
    assert p.encode_hello(p.Role.SUBSCRIBER) == struct.pack("<IB3sHHB", 9, 1, b"QVR", 1, 3, 2)
    assert p.encode_hello(p.Role.PRODUCER, min_version=1, max_version=3) == bytes.fromhex(
        "09000000" "01" "515652" "0100" "0300" "01"
    )


def test_encode_small_frames_match_vectors() -> None:
    assert p.encode_hello_ok(version=1, max_bundle_bytes=64 << 20, max_inflight=64) == (
        struct.pack("<IBHIH", 9, 0x02, 1, 64 << 20, 64)
    )
    assert p.encode_ack(7, 2, 12345) == struct.pack("<IBIHQ", 15, 0x04, 7, 2, 12345)
    msg = "wal full ✓".encode()
    assert p.encode_error(7, p.ErrorCode.AT_CAPACITY, "wal full ✓") == (
        struct.pack("<IBIHH", 1 + 8 + len(msg), 0x05, 7, 5, len(msg)) + msg
    )
    assert p.encode_subscribe("uploader", 16) == (
        struct.pack("<IBB", 1 + 1 + 8 + 2, 0x10, 8) + b"uploader" + struct.pack("<H", 16)
    )
    assert p.encode_subscribed(True) == struct.pack("<IBB", 2, 0x11, 1)
    assert p.encode_ack_bundle(1, 5, 9) == struct.pack("<IBHQI", 15, 0x13, 1, 5, 9)
    assert p.encode_nack_bundle(1, 5, 9) == struct.pack("<IBHQI", 15, 0x14, 1, 5, 9)


def test_encode_bundle_matches_vector() -> None:
    body = (
        struct.pack("<I", 42) + struct.pack("<B", 3) + b"web" + b"\x00"
        + struct.pack("<Q", 1 << 0 | 1 << 5)
        + struct.pack("<II", 10, 4) + b"AAAA"
        + struct.pack("<II", 20, 2) + b"BB"
        + struct.pack("<Q", 30)
    )
    expected = struct.pack("<IB", 1 + len(body) + 4, 0x03) + body + struct.pack("<I", crc32c(body))
    payload = b"AAAA"
    parts = p.encode_bundle(42, "web", {5: b"BB", 0: payload}, {0: 10, 5: 20})
    assert b"".join(parts) == expected
    assert any(part is payload for part in parts)  # payloads are passed through, not copied


def test_encode_bundle_with_txn_matches_vector() -> None:
    job = "job-é".encode()
    body = (
        struct.pack("<IB", 1, 1) + b"c" + b"\x01" + struct.pack("<H", len(job)) + job
        + struct.pack("<IIQ", 3, 1, 1000) + struct.pack("<Q", 1) + struct.pack("<II", 2, 3) + b"xyz"
        + struct.pack("<Q", 2)
    )
    expected = struct.pack("<IB", 1 + len(body) + 4, 0x03) + body + struct.pack("<I", crc32c(body))
    assert b"".join(p.encode_bundle(1, "c", {0: b"xyz"}, {0: 2}, TXN)) == expected


def test_encode_delivery_matches_vector() -> None:
    body = (
        struct.pack("<HQI", 1, 77, 4) + struct.pack("<B", 2) + b"ab" + b"\x00"
        + struct.pack("<q", -5) + struct.pack("<Q", 1 << 62) + struct.pack("<II", 9, 1) + b"Z"
        + struct.pack("<Q", 9)
    )
    expected = struct.pack("<IB", 1 + len(body) + 4, 0x12) + body + struct.pack("<I", crc32c(body))
    slot = Slot(slot=62, fingerprint=b"", row_count=9, ipc=b"Z")
    wire = p.encode_delivery(
        shard=1, segment_seq=77, bundle_index=4, client="ab", txn=None, ingestion_ts_ns=-5,
        slots=[slot],
    )
    assert b"".join(wire) == expected


# --- round trips ------------------------------------------------------------------------

SERVER_FRAMES: list[tuple[bytes, p.Message]] = [
    (
        p.encode_hello_ok(version=1, max_bundle_bytes=1 << 20, max_inflight=8),
        p.HelloOk(version=1, max_bundle_bytes=1 << 20, max_inflight=8),
    ),
    (p.encode_ack(1, 2, 3), p.Ack(request_id=1, shard=2, sequence=3)),
    (p.encode_error(0, 6, "bye"), p.Error(request_id=0, code=6, message="bye")),
    (p.encode_subscribed(True), p.Subscribed(ok=True)),
]


@pytest.mark.parametrize(("wire", "expected"), SERVER_FRAMES)
def test_decoder_server_frame_round_trips(wire: bytes, expected: p.Message) -> None:
    assert decode_one(wire, client_decoder()) == expected


def test_decoder_subscriber_frames_round_trip() -> None:
    d = server_decoder()
    wire = (
        hello_wire(p.Role.SUBSCRIBER) + p.encode_subscribe("up-1", 4)
        + p.encode_ack_bundle(1, 2, 3) + p.encode_nack_bundle(4, 5, 6)
    )
    assert d.feed(wire) == [
        p.Hello(min_version=1, max_version=1, role=p.Role.SUBSCRIBER),
        p.Subscribe(name="up-1", window=4),
        p.AckBundle(shard=1, segment_seq=2, bundle_index=3),
        p.NackBundle(shard=4, segment_seq=5, bundle_index=6),
    ]


def test_decoder_bundle_round_trips_with_txn_and_slots() -> None:
    t0, t7 = table(3), table(5)
    payloads = {0: encode_ipc_stream(t0), 7: encode_ipc_stream(t7)}
    wire = b"".join(p.encode_bundle(9, "web.a_b-1", payloads, {0: 3, 7: 5}, TXN))
    d = server_decoder()
    d.feed(hello_wire())
    frame = decode_one(wire, d)
    assert isinstance(frame, p.BundleFrame)
    assert (frame.request_id, frame.client, frame.txn) == (9, "web.a_b-1", TXN)
    assert [(s.slot, s.row_count, bytes(s.ipc), s.fingerprint) for s in frame.slots] == [
        (0, 3, payloads[0], b""), (7, 5, payloads[7], b""),
    ]
    assert isinstance(frame.slots[0].ipc, memoryview) and frame.slots[0].ipc.readonly
    validated = p.validate_bundle(frame)
    assert [s.row_count for s in validated] == [3, 5]
    assert all(len(s.fingerprint) == 32 for s in validated)


def test_decoder_delivery_round_trips() -> None:
    slot = Slot(slot=2, fingerprint=b"", row_count=3, ipc=encode_ipc_stream(table(3)))
    wire = b"".join(p.encode_delivery(
        shard=3, segment_seq=1 << 40, bundle_index=7, client="c", txn=TXN,
        ingestion_ts_ns=1_700_000_000_000_000_000, slots=[slot],
    ))
    msg = decode_one(wire, client_decoder())
    assert isinstance(msg, p.Delivery)
    assert (msg.shard, msg.segment_seq, msg.bundle_index, msg.client, msg.txn) == (
        3, 1 << 40, 7, "c", TXN,
    )
    assert msg.ingestion_ts_ns == 1_700_000_000_000_000_000
    assert bytes(msg.slots[0].ipc) == slot.ipc
    assert p.validate_bundle(msg)[0].row_count == 3


# --- incremental decoding ---------------------------------------------------------------


def producer_stream() -> tuple[bytes, int]:
    payload = encode_ipc_stream(table(4))
    bundles = bundle_wire(1, {0: payload}, {0: 4}) + bundle_wire(2, {3: payload}, {3: 4})
    return hello_wire() + bundles, 3


def test_decoder_frames_split_at_every_byte_boundary() -> None:
    wire, count = producer_stream()
    whole = server_decoder().feed(wire)
    assert len(whole) == count
    for cut in range(len(wire) + 1):
        d = server_decoder()
        assert d.feed(wire[:cut]) + d.feed(wire[cut:]) == whole
    d = server_decoder()
    one_by_one = [m for i in range(len(wire)) for m in d.feed(wire[i : i + 1])]
    assert one_by_one == whole and d.buffered == 0


def test_decoder_server_frames_split_at_every_byte_boundary() -> None:
    wire = b"".join(w for w, _ in SERVER_FRAMES)
    expected = [m for _, m in SERVER_FRAMES]
    for cut in range(len(wire) + 1):
        d = client_decoder()
        assert d.feed(wire[:cut]) + d.feed(memoryview(wire)[cut:]) == expected


def test_decoder_buffered_protocol_receives_large_payload_directly() -> None:
    big = pa.table({"x": pa.array(range(100_000), pa.int64())})
    payload = encode_ipc_stream(big)
    wire = hello_wire() + bundle_wire(5, {0: payload}, {0: 100_000}) + hello_wire()[:2]
    d, out, pos, direct = server_decoder(), [], 0, 0
    while pos < len(wire):
        buf = d.get_buffer(-1)
        n = min(len(buf), len(wire) - pos)
        direct += len(buf) != p.SCRATCH_BYTES
        buf[:n] = wire[pos : pos + n]
        pos += n
        out += d.buffer_updated(n)
    assert direct > 0  # at least one recv went straight into the frame buffer
    assert [type(m) for m in out] == [p.Hello, p.BundleFrame]
    assert isinstance(out[1], p.BundleFrame) and bytes(out[1].slots[0].ipc) == payload
    assert d.buffered == 2


class Reservations:
    """A reserve callback that says no to the first ``refusals`` asks."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.asked: list[int] = []

    def __call__(self, nbytes: int) -> bool:
        self.asked.append(nbytes)
        if self.refusals:
            self.refusals -= 1
            return False
        return True


def test_decoder_pauses_at_a_bundle_header_until_its_bytes_are_reserved() -> None:
    payload = encode_ipc_stream(table(4))
    first, second = bundle_wire(1, {0: payload}, {0: 4}), bundle_wire(2, {0: payload}, {0: 4})
    reserve = Reservations(refusals=1)
    d = p.FrameDecoder(MAX_FRAME, reserve=reserve)
    out = d.feed(hello_wire() + first + second)
    assert [type(m) for m in out] == [p.Hello]  # stopped at the first BUNDLE header
    body = len(first) - 5
    assert d.awaiting == body and reserve.asked == [body]
    assert d.buffered == len(first) + len(second)  # header + the input held back
    assert d.expected == len(first)
    with pytest.raises(AssertionError):
        d.get_buffer()  # nothing may be received while a frame waits
    out = d.resume()  # the caller got the bytes: the held input is decoded
    assert [m.request_id for m in out] == [1, 2]  # type: ignore[union-attr]
    assert reserve.asked == [body, len(second) - 5]  # the second was reserved on the way
    assert d.awaiting is None and d.buffered == 0


def test_decoder_paused_at_every_bundle_decodes_the_same_frames_at_any_split() -> None:
    wire, count = producer_stream()
    whole = server_decoder().feed(wire)
    for cut in range(len(wire) + 1):
        reserve = Reservations(refusals=count)  # every BUNDLE waits for its reservation
        d = p.FrameDecoder(MAX_FRAME, reserve=reserve)
        out = []
        for part in (wire[:cut], wire[cut:]):
            out += d.feed(part)
            while d.awaiting is not None:
                out += d.resume()
        assert out == whole and len(reserve.asked) == count - 1


def test_decoder_reserves_nothing_for_small_frames_and_closes_its_buffers() -> None:
    reserve = Reservations(refusals=0)
    d = p.FrameDecoder(MAX_FRAME, reserve=reserve)
    d.feed(hello_wire())
    assert reserve.asked == []
    d.feed(bundle_wire(1, {0: encode_ipc_stream(table(2))}, {0: 2})[:20])
    assert reserve.asked and d.buffered == 20
    d.close()
    with pytest.raises(ProtocolError):
        d.feed(b"x")


# --- limits and malformed input ---------------------------------------------------------


def test_decoder_oversize_length_rejected_before_allocation() -> None:
    d = p.FrameDecoder(p.max_frame_bytes(64 << 20))
    with pytest.raises(ProtocolError) as info:
        d.feed(struct.pack("<I", 70_000_000))  # only the length: nothing to allocate yet
    assert info.value.code == p.ErrorCode.TOO_LARGE
    assert "70000000" in str(info.value)
    with pytest.raises(ProtocolError):  # the decoder stays failed
        d.feed(b"")


def test_decoder_oversize_small_frame_rejected_before_allocation() -> None:
    d = server_decoder()
    with pytest.raises(ProtocolError, match="HELLO frame of 1000000 bytes") as info:
        d.feed(struct.pack("<IB", 1_000_000, 0x01))
    assert info.value.code == p.ErrorCode.MALFORMED


def ipc_message_ends(payload: bytes) -> list[int]:
    """Offsets where each IPC message of ``payload`` ends (schema, batches)."""
    reader, ends = pa.BufferReader(payload), list[int]()
    while True:
        try:
            pa.ipc.read_message(reader)
        except (EOFError, pa.ArrowInvalid):
            return ends
        ends.append(reader.tell())


def test_end_check_catches_ipc_stream_cut_at_message_boundary() -> None:
    full = table(100, batches=2)
    payload = encode_ipc_stream(full)
    cut = payload[: ipc_message_ends(payload)[1]]  # schema + first batch, no EOS
    assert read_ipc_stream(cut).num_rows == 100  # Arrow sees a complete stream: why we check
    good = bundle_wire(1, {0: payload}, {0: 200})
    head_len = 5 + 4 + 1 + 3 + 1 + 8 + 8
    # Splice the cut payload into the frame, keeping the sender's end check.
    body = good[5:head_len] + cut + good[-12:]
    spliced = struct.pack("<IB", 1 + len(body), 0x03) + body
    spliced = spliced[: head_len - 4] + struct.pack("<I", len(cut)) + spliced[head_len:]
    d = server_decoder()
    d.feed(hello_wire())
    with pytest.raises(ProtocolError, match=r"end check failed: crc 0x[0-9a-f]{8} != 0x") as info:
        d.feed(spliced)
    assert info.value.code == p.ErrorCode.MALFORMED
    # A sender that re-checksums the cut stream still declared 200 rows: validation catches it.
    d = server_decoder()
    frame = d.feed(hello_wire() + bundle_wire(1, {0: cut}, {0: 200}))[1]
    assert isinstance(frame, p.BundleFrame)
    with pytest.raises(ProtocolError, match="declares 200 rows but its IPC stream holds 100"):
        p.validate_bundle(frame)


def test_end_check_total_rows_mismatch_rejected() -> None:
    good = bundle_wire(1, {0: b"x"}, {0: 5})
    body = bytearray(good[5:-4])
    body[-8:] = struct.pack("<Q", 6)
    wire = good[:5] + bytes(body) + struct.pack("<I", crc32c(bytes(body)))
    with pytest.raises(ProtocolError, match="total_rows 6 != sum of slot row counts 5"):
        server_decoder().feed(hello_wire() + wire)


def test_negotiate_rejects_unsupported_version() -> None:
    hello = p.Hello(min_version=4, max_version=5, role=p.Role.PRODUCER)
    with pytest.raises(ProtocolError, match="versions 4..5, this server 1..3") as info:
        p.hello_reply(hello, max_bundle_bytes=1, max_inflight=1)
    assert info.value.code == p.ErrorCode.UNSUPPORTED_VERSION
    ok = p.Hello(min_version=1, max_version=9, role=p.Role.PRODUCER)
    assert p.negotiate(ok) == 3
    assert p.hello_reply(ok, max_bundle_bytes=10, max_inflight=2) == p.encode_hello_ok(
        version=3, max_bundle_bytes=10, max_inflight=2
    )
    old_client = p.Hello(min_version=1, max_version=1, role=p.Role.SUBSCRIBER)
    assert p.negotiate(old_client) == 1  # a version-1 client keeps working


def test_named_producer_hello_and_numbered_bundle_round_trip() -> None:
    hello = p.encode_hello(p.Role.PRODUCER, producer="collector-7", incarnation=2**64 - 1)
    assert hello == struct.pack("<IB3sHHB", 29, 1, b"QVR", 1, 3, 1) + b"\x0bcollector-7" \
        + struct.pack("<Q", 2**64 - 1)
    table = pa.table({"v": [1, 2]})
    bundle = b"".join(p.encode_bundle(5, "web", {0: encode_ipc_stream(table)}, {0: 2},
                                      producer_seq=42))
    dec = p.FrameDecoder(1 << 20)
    got_hello, frame = dec.feed(hello + bundle)
    assert (got_hello.producer, got_hello.incarnation) == ("collector-7", 2**64 - 1)
    assert (frame.request_id, frame.client, frame.txn, frame.producer_seq) == (5, "web", None, 42)
    plain = dec.feed(b"".join(p.encode_bundle(6, "web", {0: encode_ipc_stream(table)}, {0: 2})))
    assert plain[0].producer_seq == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_version": 2}, "a producer id needs a producer HELLO offering version 3"),
    ({"incarnation": 0}, "incarnation 0 outside"),
])
def test_named_producer_hello_refuses_what_it_cannot_say(kwargs: dict[str, int],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        p.encode_hello(p.Role.PRODUCER, producer="c", **{"incarnation": 1, **kwargs})


def test_numbered_bundle_refuses_a_txn_tag_too() -> None:
    txn = TxnTag(job_id="j", partition=0, attempt=0, row_offset=0)
    with pytest.raises(ValueError, match="not both"):
        p.encode_bundle(1, "web", {0: b""}, {0: 0}, txn=txn, producer_seq=1)


def test_reject_bundle_round_trips_and_matches_vector() -> None:
    wire = p.encode_reject_bundle(1, 2, 3)
    assert wire == struct.pack("<IBHQI", 15, 0x17, 1, 2, 3)
    dec = p.FrameDecoder(1 << 20)
    msgs = dec.feed(p.encode_hello(p.Role.SUBSCRIBER) + p.encode_subscribe("s", 4) + wire)
    assert msgs[-1] == p.RejectBundle(shard=1, segment_seq=2, bundle_index=3)
    assert dec.version == 3


def test_reject_bundle_on_a_version_1_connection_is_malformed() -> None:
    dec = p.FrameDecoder(1 << 20)
    hello = p.encode_hello(p.Role.SUBSCRIBER, min_version=1, max_version=1)
    with pytest.raises(ProtocolError, match="REJECT_BUNDLE needs protocol version 2; this "
                       "connection agreed version 1") as info:
        dec.feed(hello + p.encode_subscribe("s", 4) + p.encode_ack_bundle(0, 0, 0)
                 + p.encode_reject_bundle(0, 0, 1))
    assert info.value.code == p.ErrorCode.MALFORMED


def test_reject_bundle_is_not_a_producer_frame() -> None:
    dec = p.FrameDecoder(1 << 20)
    with pytest.raises(ProtocolError, match="REJECT_BUNDLE frame not allowed on a producer"):
        dec.feed(p.encode_hello(p.Role.PRODUCER) + p.encode_reject_bundle(0, 0, 1))


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (struct.pack("<IB3sHHB", 9, 1, b"XYZ", 1, 1, 1), "bad magic"),
        (struct.pack("<IB3sHHB", 9, 1, b"QVR", 2, 1, 1), "min_version 2 > max_version 1"),
        (struct.pack("<IB3sHHB", 9, 1, b"QVR", 1, 1, 9), "unknown role 9"),
        (struct.pack("<IB3sHH", 8, 1, b"QVR", 1, 1), "HELLO frame truncated"),
        (struct.pack("<IB3sHHBB", 10, 1, b"QVR", 1, 1, 1, 0), "a producer id needs a producer "
         "HELLO offering protocol version 3"),
        (struct.pack("<IB3sHHBB", 10, 1, b"QVR", 1, 3, 1, 0), "invalid producer id"),
        (struct.pack("<IB", 1, 0x7F), "unknown frame type 0x7f"),
        (struct.pack("<I", 0), "frame_len 0"),
        (p.encode_ack(1, 1, 1), "expected HELLO as the first frame, got ACK"),
        (hello_wire() + hello_wire(), "HELLO frame not allowed on a producer connection"),
        (hello_wire() + p.encode_subscribe("a", 1), "SUBSCRIBE frame not allowed on a producer"),
        (hello_wire(p.Role.SUBSCRIBER) + bundle_wire(1, {0: b""}, {0: 0}), "BUNDLE frame not"),
        (hello_wire() + bundle_wire(1, {0: b""}, {0: 0})[:-1] + b"\x00", "end check failed"),
        (
            hello_wire(p.Role.SUBSCRIBER) + struct.pack("<IBB", 4, 0x10, 5) + b"ab",
            "SUBSCRIBE frame truncated",
        ),
    ],
)
def test_decoder_rejects_malformed_frames(wire: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        server_decoder().feed(wire)
    assert info.value.code == p.ErrorCode.MALFORMED


def raw_bundle(body_head: bytes, bitmap: int = 0) -> bytes:
    body = body_head + struct.pack("<QQ", bitmap, 0)
    return struct.pack("<IB", 1 + len(body) + 4, 0x03) + body + struct.pack("<I", crc32c(body))


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (struct.pack("<IB", 0, 1) + b"a\x00", "request_id 0 is reserved"),
        (struct.pack("<IB", 1, 2) + b"a " + b"\x00", "invalid client name"),
        (struct.pack("<IB", 1, 0) + b"\x00", "invalid client name"),
        (struct.pack("<IB", 1, 1) + b"a\x03", "transactional tag flag 3 not 0, 1 or 2"),
        (struct.pack("<IB", 1, 1) + b"a\x02" + bytes(8), "producer_seq 0 is reserved"),
        (struct.pack("<IB", 1, 1) + b"a\x01\x01\x00\xff" + bytes(16), "job_id is not utf-8"),
    ],
)
def test_decoder_rejects_bad_bundle_fields(head: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        server_decoder().feed(hello_wire() + raw_bundle(head))


def test_decoder_client_side_rejects_client_frames() -> None:
    with pytest.raises(ProtocolError, match="HELLO frames are not sent by servers"):
        client_decoder().feed(hello_wire())


def test_validate_bundle_rejects_slot_63() -> None:
    payload = encode_ipc_stream(table(1))
    frame = server_decoder().feed(hello_wire() + bundle_wire(1, {63: payload}, {63: 1}))[1]
    with pytest.raises(ProtocolError, match="slot 63 is reserved for bundle metadata") as info:
        p.validate_bundle(frame)  # type: ignore[arg-type]
    assert info.value.code == p.ErrorCode.MALFORMED


@pytest.mark.parametrize("name", [b"top", b"inner"])
def test_validate_bundle_rejects_a_field_name_that_is_not_utf8(name: bytes) -> None:
    """Arrow's IPC reader takes any bytes as a name; pyarrow fails only when it is read
    as a string, at finalize, after the ACK: ingest must refuse it (found by the fuzz)."""
    data = pa.table({"top": pa.array([{"inner": 1}], pa.struct([("inner", pa.int64())]))})
    payload = encode_ipc_stream(data).replace(name, b"\xff" * len(name))
    frame = server_decoder().feed(hello_wire() + bundle_wire(1, {0: payload}, {0: 1}))[1]
    with pytest.raises(ProtocolError, match="a field name is not valid UTF-8") as info:
        p.validate_bundle(frame)  # type: ignore[arg-type]
    assert info.value.code == p.ErrorCode.MALFORMED


@pytest.mark.parametrize("name", ["_quiver_ingested_at", "_quiver_bundle", "_quiver_x"])
def test_validate_bundle_rejects_a_top_level_column_with_the_reserved_prefix(name: str) -> None:
    data = pa.table({"a": [1], name: ["x"]})
    frame = server_decoder().feed(
        hello_wire() + bundle_wire(1, {4: encode_ipc_stream(data)}, {4: 1}))[1]
    with pytest.raises(ProtocolError, match=f"slot 4: column '{name}': the prefix "
                       "'_quiver_' is reserved") as info:
        p.validate_bundle(frame)  # type: ignore[arg-type]
    assert info.value.code == p.ErrorCode.MALFORMED


def test_validate_bundle_accepts_the_prefix_nested_or_inside_a_name() -> None:
    nested = pa.array([{"_quiver_bundle": 1}], pa.struct([("_quiver_bundle", pa.int64())]))
    data = pa.table({"s": nested, "quiver_x": [1], "x_quiver_": [2], "_quiverx": [3]})
    frame = server_decoder().feed(
        hello_wire() + bundle_wire(1, {0: encode_ipc_stream(data)}, {0: 1}))[1]
    [slot] = p.validate_bundle(frame)  # type: ignore[arg-type]
    assert slot.row_count == 1


def test_validate_bundle_rejects_invalid_ipc_and_empty_and_too_large() -> None:
    frames = server_decoder().feed(
        hello_wire() + bundle_wire(1, {0: b"not arrow at all"}, {0: 1})
        + b"".join(p.encode_bundle(2, "web", {}, {}))
    )
    with pytest.raises(ProtocolError, match="slot 0: payload is not a valid Arrow IPC stream"):
        p.validate_bundle(frames[1])  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="bundle has no slots"):
        p.validate_bundle(frames[2])  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="exceeds max_bundle_bytes 3") as info:
        p.validate_bundle(frames[1], max_bundle_bytes=3)  # type: ignore[arg-type]
    assert info.value.code == p.ErrorCode.TOO_LARGE


def _compressed(t: pa.Table, codec: str) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema,
                           options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        writer.write(t)
    return sink.getvalue().to_pybytes()


def _cut_body(payload: bytes) -> bytes:
    """Schema message, then a record batch whose body is cut after 16 bytes."""
    schema_end = 8 + struct.unpack_from("<i", payload, 4)[0]
    meta_end = schema_end + 8 + struct.unpack_from("<i", payload, schema_end + 4)[0]
    return payload[: meta_end + 16]


@pytest.mark.parametrize(("payload", "arrow_says"), [
    # pyarrow raises plain OSError (not ArrowException) for these two.
    (struct.pack("<i", -2) + bytes(16), "negative continuation token"),
    (_cut_body(encode_ipc_stream(table(100))), "Expected to be able to read 800 bytes"),
    (b"\xff\xff\xff\xff" + struct.pack("<i", -8) + bytes(16), "negative metadata length"),
    (_compressed(table(100), "zstd"), "compressed IPC bodies (LZ4/ZSTD) are not accepted"),
    (_compressed(pa.table({"d": pa.array(["a", "b"] * 50).dictionary_encode()}), "lz4"),
     "compressed IPC bodies"),
])
def test_validate_bundle_turns_every_pyarrow_failure_into_malformed(
        payload: bytes, arrow_says: str) -> None:
    frame = server_decoder().feed(hello_wire() + bundle_wire(1, {0: payload}, {0: 100}))[1]
    with pytest.raises(ProtocolError) as info:
        p.validate_bundle(frame)  # type: ignore[arg-type]
    assert info.value.code == p.ErrorCode.MALFORMED
    assert str(info.value).startswith("slot 0: payload is not a valid Arrow IPC stream")
    assert arrow_says in str(info.value)


def test_validate_bundle_accepts_uncompressed_and_empty_compressed_streams() -> None:
    empty = pa.table({"x": pa.array([], pa.int64())})
    for payload, rows in ((encode_ipc_stream(table(5)), 5), (_compressed(empty, "zstd"), 0)):
        frame = server_decoder().feed(hello_wire() + bundle_wire(1, {0: payload}, {0: rows}))[1]
        (slot,) = p.validate_bundle(frame)  # type: ignore[arg-type]
        assert slot.row_count == rows


def test_encoders_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="client name"):
        p.encode_bundle(1, "has space", {0: b""}, {0: 0})
    with pytest.raises(ValueError, match="request_id 0"):
        p.encode_bundle(0, "a", {0: b""}, {0: 0})
    with pytest.raises(ValueError, match="slot 64"):
        p.encode_bundle(1, "a", {64: b""}, {64: 0})
    with pytest.raises(ValueError, match="same slot ids"):
        p.encode_bundle(1, "a", {0: b""}, {1: 0})
    with pytest.raises(ValueError, match="subscriber name"):
        p.encode_subscribe("Upper", 1)


def test_encode_error_truncates_long_message_on_character_boundary() -> None:
    msg = decode_one(p.encode_error(3, 7, "é" * 40_000), client_decoder())
    assert isinstance(msg, p.Error)
    assert msg.message == "é" * 32_767


def test_error_mapping_both_ways() -> None:
    def err(code: int) -> p.Error:
        return p.Error(request_id=1, code=code, message="m")

    assert isinstance(p.exception_for(err(5)), AtCapacity)
    assert isinstance(p.exception_for(err(6)), ShuttingDown)
    assert isinstance(p.exception_for(err(4)), Unauthorized)
    other = p.exception_for(err(99))
    assert isinstance(other, ProtocolError) and other.code == 99
    assert p.error_code_for(AtCapacity("x")) == p.ErrorCode.AT_CAPACITY
    assert p.error_code_for(ShuttingDown("x")) == p.ErrorCode.SHUTTING_DOWN
    assert p.error_code_for(Unauthorized("x")) == p.ErrorCode.UNAUTHORIZED
    assert p.error_code_for(ProtocolError(2, "x")) == p.ErrorCode.TOO_LARGE
    assert p.error_code_for(RuntimeError()) == p.ErrorCode.INTERNAL
    assert p.ErrorCode.AT_CAPACITY not in p.CLOSES_CONNECTION
    assert p.ErrorCode.MALFORMED in p.CLOSES_CONNECTION


# --- fuzzing ----------------------------------------------------------------------------

FUZZ = settings(max_examples=size(100, 300), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def feed_all(decoder: p.FrameDecoder, data: bytes, step: int) -> list[p.Message]:
    out: list[p.Message] = []
    try:
        for i in range(0, len(data), step):
            out += decoder.feed(data[i : i + step])
    except ProtocolError:
        return out
    return out


def check_decoded(messages: list[p.Message]) -> None:
    for msg in messages:
        if isinstance(msg, p.BundleFrame | p.Delivery):
            try:
                p.validate_bundle(msg)
            except ProtocolError:
                pass


@FUZZ
@given(data=st.binary(max_size=300), step=st.integers(1, 64), prefix=st.booleans())
def test_fuzz_random_bytes_only_raise_protocol_error(data: bytes, step: int, prefix: bool) -> None:
    wire = (hello_wire() if prefix else b"") + data
    check_decoded(feed_all(server_decoder(), wire, step))
    check_decoded(feed_all(client_decoder(), data, step))


def valid_stream() -> bytes:
    payload = encode_ipc_stream(table(5, batches=2))
    parts = p.encode_bundle(1, "web", {0: payload, 4: payload}, {0: 10, 4: 10}, TXN)
    return hello_wire() + b"".join(parts)


VALID = valid_stream()


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
    cut=st.integers(0, len(VALID)),
    fix_crc=st.booleans(),
    step=st.integers(1, 512),
)
def test_fuzz_mutated_frames_only_raise_protocol_error(
    edits: list[tuple[int, int]], cut: int, fix_crc: bool, step: int
) -> None:
    wire = bytearray(VALID[:cut] + VALID[cut + 1 :] if cut % 2 else VALID)
    for pos, value in edits:
        wire[pos % len(wire)] = value
    if fix_crc and len(wire) > 18:
        # Re-checksum so mutations reach the field parsers and Arrow, not just the CRC.
        wire[-4:] = struct.pack("<I", crc32c(bytes(wire[14:-4])))
    check_decoded(feed_all(server_decoder(), bytes(wire), step))


# --- JOB / JOB_OK (transactional writes, SPEC §7) ------------------------------------------

END_PARTITION = {"op": "end_partition", "client": "spark", "job_id": "j-1", "partition": 3,
                 "attempt": 17, "rows": 1000, "checksum": 0xE3069283}


def job_wire(frame_type: int, request_id: int, raw: bytes) -> bytes:
    return struct.pack("<IBII", 1 + 8 + len(raw), frame_type, request_id, len(raw)) + raw


def test_encode_job_frames_match_vectors() -> None:
    assert p.encode_job_request(7, {"op": "status", "job_id": "é"}) == (
        job_wire(0x06, 7, '{"op":"status","job_id":"é"}'.encode())
    )
    assert p.encode_job_reply(7, {"state": "unknown"}) == bytes.fromhex(
        "1c000000" "07" "07000000" "13000000") + b'{"state":"unknown"}'


def test_decoder_job_request_round_trips_between_bundles() -> None:
    payload = encode_ipc_stream(table(2))
    wire = (hello_wire() + bundle_wire(1, {0: payload}, {0: 2})
            + p.encode_job_request(2, END_PARTITION) + bundle_wire(3, {0: payload}, {0: 2}))
    whole = server_decoder().feed(wire)
    assert [type(m) for m in whole] == [p.Hello, p.BundleFrame, p.JobRequest, p.BundleFrame]
    assert whole[2] == p.JobRequest(request_id=2, body=END_PARTITION)
    for cut in range(len(wire) + 1):
        d = server_decoder()
        assert d.feed(wire[:cut]) + d.feed(wire[cut:]) == whole


def test_decoder_job_reply_round_trips_beside_acks() -> None:
    reply = {"job_id": "j-1", "state": "committed", "already": False,
             "winners": [{"partition": 0, "attempt": 5, "rows": 10, "checksum": 1}]}
    wire = p.encode_ack(1, 0, 9) + p.encode_job_reply(2, reply) + p.encode_error(3, 10, "no")
    assert client_decoder().feed(wire) == [
        p.Ack(request_id=1, shard=0, sequence=9), p.JobReply(request_id=2, body=reply),
        p.Error(request_id=3, code=p.ErrorCode.JOB_CONFLICT, message="no"),
    ]


def test_job_body_up_to_the_limit_passes_and_one_byte_more_is_refused() -> None:
    filler = "x" * (p.MAX_JOB_BODY_BYTES - len('{"f":""}'))
    wire = p.encode_job_request(1, {"f": filler})
    assert len(wire) == 4 + p.JOB_FRAME_MAX
    d = p.FrameDecoder(p.max_frame_bytes(64 << 20))
    assert d.feed(hello_wire() + wire)[1] == p.JobRequest(request_id=1, body={"f": filler})
    with pytest.raises(ValueError, match=r"JOB body of 1048577 bytes of JSON exceeds 1048576"):
        p.encode_job_request(1, {"f": filler + "x"})
    with pytest.raises(ValueError, match="request_id 0"):
        p.encode_job_request(0, {})
    with pytest.raises(TypeError, match="JSON object, not list"):
        p.encode_job_reply(1, [1])  # type: ignore[arg-type]


def test_decoder_refuses_overlong_job_frame_before_allocation() -> None:
    d = p.FrameDecoder(p.max_frame_bytes(64 << 20))
    d.feed(hello_wire())
    with pytest.raises(ProtocolError, match="JOB frame of 1048586 bytes is longer") as info:
        d.feed(struct.pack("<IB", p.JOB_FRAME_MAX + 1, 0x06))  # header only: nothing allocated
    assert info.value.code == p.ErrorCode.MALFORMED


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"op": "commit"', "JOB: body is not JSON"),
        (b"", "JOB: body is not JSON"),
        (b'["op", "commit"]', "JOB: body is JSON but not an object"),
        (b'"commit"', "JOB: body is JSON but not an object"),
        (b"null", "JOB: body is JSON but not an object"),
        (b'{"op": "fetch", "after": [1, -1e400]}',
         r"JOB: body holds a number out of the 64-bit float range at \.after\[1\]$"),
        (b'{"a": 1e400}', r"JOB: body holds a number out of the 64-bit float range at \.a$"),
        (b'{"a": ' + b"[" * 5000 + b"1e400" + b"]" * 5000 + b"}",
         "JOB: body is JSON nested too deeply for a request$"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "JOB: body is JSON nested too deeply for a request$"),
        (b'{"op": "\xff"}', r"JOB: body is not UTF-8 \(invalid byte at offset 8\)$"),
        (b"\xff", r"JOB: body is not UTF-8 \(invalid byte at offset 0\)$"),
        # A UTF-16 surrogate encoded as UTF-8, and a sequence cut short at the end.
        (b'{"op": "\xed\xa0\x80"}', r"JOB: body is not UTF-8 \(invalid byte at offset 8\)$"),
        (b'{"op": "\xc3', r"JOB: body is not UTF-8 \(invalid byte at offset 8\)$"),
    ],
)
def test_decoder_rejects_bad_job_json(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        server_decoder().feed(hello_wire() + job_wire(0x06, 1, raw))
    assert info.value.code == p.ErrorCode.MALFORMED


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (job_wire(0x06, 0, b"{}"), "JOB: request_id 0 is reserved"),
        (struct.pack("<IBII", 11, 0x06, 1, 3) + b"{}", "JOB frame truncated"),
        (struct.pack("<IBII", 12, 0x06, 1, 1) + b"{}x", "unexpected trailing bytes"),
        (struct.pack("<IBII", 9, 0x06, 1, p.MAX_JOB_BODY_BYTES + 1), "exceeds 1048576"),
        (p.encode_job_reply(1, {}), "JOB_OK frame not allowed on a producer connection"),
    ],
)
def test_decoder_rejects_malformed_job_frames(wire: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        server_decoder().feed(hello_wire() + wire)
    assert info.value.code == p.ErrorCode.MALFORMED


def test_job_frames_only_in_their_direction_and_role() -> None:
    with pytest.raises(ProtocolError, match="JOB frame not allowed on a subscriber"):
        server_decoder().feed(hello_wire(p.Role.SUBSCRIBER) + p.encode_job_request(1, {}))
    with pytest.raises(ProtocolError, match="JOB frames are not sent by servers"):
        client_decoder().feed(p.encode_job_request(1, {}))


def test_job_conflict_maps_both_ways_and_keeps_the_connection() -> None:
    exc = p.exception_for(p.Error(request_id=4, code=10, message="job j was aborted"))
    assert isinstance(exc, JobConflict) and str(exc) == "job j was aborted"
    assert p.error_code_for(JobConflict("x")) == p.ErrorCode.JOB_CONFLICT == 10
    assert p.ErrorCode.JOB_CONFLICT not in p.CLOSES_CONNECTION


JOB_VALID = hello_wire() + p.encode_job_request(5, END_PARTITION)


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, len(JOB_VALID) - 1), st.integers(0, 255)),
                   max_size=6),
    step=st.integers(1, 64),
)
def test_fuzz_mutated_job_frames_only_raise_protocol_error(
        edits: list[tuple[int, int]], step: int) -> None:
    wire = bytearray(JOB_VALID)
    for pos, value in edits:
        wire[pos] = value
    for msg in feed_all(server_decoder(), bytes(wire), step):
        if isinstance(msg, p.JobRequest):
            assert isinstance(msg.body, dict)
