"""STREAM / STREAM_OK (ranged reads): byte-exact vectors, round trips, where they may go."""

from __future__ import annotations

import struct

import pytest

from quiverd.kernel.errors import ProtocolError
from quiverd.protocol import codec as p

MAX_FRAME = p.max_frame_bytes(1 << 20)


def hello_wire(role: p.Role) -> bytes:
    return struct.pack("<IB3sHHB", 9, 0x01, b"QVR", 1, 1, role)


def test_encode_stream_frames_match_vectors() -> None:
    assert p.encode_stream_request(7, {"op": "open", "subscriber": "s"}) == bytes.fromhex(
        "27000000" "15" "07000000" "1e000000") + b'{"op":"open","subscriber":"s"}'
    assert p.encode_stream_reply(7, {"acked": 3}) == bytes.fromhex(
        "14000000" "16" "07000000" "0b000000") + b'{"acked":3}'


def test_stream_request_round_trips_on_a_subscriber_connection() -> None:
    body = {"op": "fetch", "subscriber": "s", "shard": 1, "after": [3, -1],
            "through": [4, 9], "client": None}
    wire = hello_wire(p.Role.SUBSCRIBER) + p.encode_stream_request(1, body)
    whole = p.FrameDecoder(MAX_FRAME).feed(wire)
    assert whole[1] == p.StreamRequest(request_id=1, body=body)
    for cut in range(len(wire) + 1):
        d = p.FrameDecoder(MAX_FRAME)
        assert d.feed(wire[:cut]) + d.feed(wire[cut:]) == whole


def test_stream_reply_decodes_beside_deliveries_errors() -> None:
    wire = p.encode_stream_reply(2, {"bundles": 0}) + p.encode_error(3, 5, "held")
    assert p.FrameDecoder(MAX_FRAME, from_client=False).feed(wire) == [
        p.StreamReply(request_id=2, body={"bundles": 0}),
        p.Error(request_id=3, code=p.ErrorCode.AT_CAPACITY, message="held")]


def test_stream_frame_refused_on_a_producer_connection() -> None:
    wire = hello_wire(p.Role.PRODUCER) + p.encode_stream_request(1, {"op": "open"})
    with pytest.raises(ProtocolError) as err:
        p.FrameDecoder(MAX_FRAME).feed(wire)
    assert err.value.code == p.ErrorCode.MALFORMED


def test_stream_request_id_zero_and_long_body_refused() -> None:
    zero = hello_wire(p.Role.SUBSCRIBER) + bytes.fromhex("0b000000" "15" "00000000"
                                                         "02000000") + b"{}"
    with pytest.raises(ProtocolError, match="request_id 0 is reserved"):
        p.FrameDecoder(MAX_FRAME).feed(zero)
    # A STREAM body is small JSON: the small-frame limit applies, checked on the header.
    long = hello_wire(p.Role.SUBSCRIBER) + struct.pack("<IB", 70_000, 0x15)
    with pytest.raises(ProtocolError) as err:
        p.FrameDecoder(MAX_FRAME).feed(long)
    assert err.value.code == p.ErrorCode.MALFORMED
