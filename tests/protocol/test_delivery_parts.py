"""DELIVERY frames whose slot payloads come as pieces (frames.encode_delivery_parts)."""

from __future__ import annotations

import pyarrow as pa

from quiverd.kernel.bundle import Slot, TxnTag, encode_ipc_stream, read_ipc_stream
from quiverd.protocol import frames
from quiverd.protocol.codec import Delivery, FrameDecoder, max_frame_bytes


def test_delivery_parts_same_bytes_as_joined_payloads() -> None:
    big = encode_ipc_stream(pa.table({"n": pa.array(range(20_000), pa.int64())}))
    small = encode_ipc_stream(pa.table({"s": ["a", "b"]}))
    end = len(big) - 200
    cut = [memoryview(big)[:100], memoryview(big)[100:end], memoryview(big)[end:]]
    txn = TxnTag(job_id="j", partition=1, attempt=2, row_offset=3)
    common = {"shard": 1, "segment_seq": 7, "bundle_index": 9, "client": "app", "txn": txn,
              "ingestion_ts_ns": 42}
    joined = frames.encode_delivery(**common, slots=[
        Slot(slot=0, fingerprint=b"", row_count=20_000, ipc=big),
        Slot(slot=3, fingerprint=b"", row_count=2, ipc=small)])
    pieces = frames.encode_delivery_parts(**common, slots=[
        (0, 20_000, cut), (3, 2, [memoryview(small)[:10], memoryview(small)[10:]])])
    wire = b"".join(bytes(p) for p in pieces)
    assert wire == b"".join(bytes(p) for p in joined)
    assert any(p is cut[1] for p in pieces)  # the large piece is passed through, uncopied
    assert len(pieces) == 4  # small pieces merged around it: head, big, tail, end check
    (msg,) = FrameDecoder(max_frame_bytes(1 << 20), from_client=False).feed(wire)
    assert isinstance(msg, Delivery) and msg.txn == txn
    assert [(s.slot, s.row_count) for s in msg.slots] == [(0, 20_000), (3, 2)]
    assert read_ipc_stream(msg.slots[1].ipc).column("s").to_pylist() == ["a", "b"]


def test_bundle_frame_small_payload_not_merged() -> None:
    # BUNDLE frames keep their payloads as separate buffers, however small.
    payload = encode_ipc_stream(pa.table({"s": ["a"]}))
    parts = frames.encode_bundle(1, "app", {0: payload}, {0: 1})
    assert any(p is payload for p in parts)
