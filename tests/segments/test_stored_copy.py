"""Write once: a segment stream without dictionaries is the WAL's record batch messages,
copied as stored (no decode, no second encode); only its IPC file head and footer are new.

A producer's record batch message can carry what a decode and re-encode would drop (the
message's own custom metadata): such a message must reach the segment file, and a
subscriber, byte for byte.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pyarrow as pa
import pytest

from quiverd.client import Client
from quiverd.client.core import IpcPayload
from quiverd.kernel.bundle import Bundle, Slot, encode_ipc_stream, inspect_ipc_stream
from quiverd.segments import open_segment as open_segment_module
from quiverd.segments.files import write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.ipc_slices import file_blocks, file_pieces, stream_messages
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader


def _table(n: int, offset: int = 0) -> pa.Table:
    return pa.table({"id": pa.array(range(offset, offset + n), pa.int64()),
                     "s": [f"row-{offset + i}" for i in range(n)]})


def _ipc_with_batch_metadata(table: pa.Table, tag: str) -> bytes:
    """An IPC stream whose record batch messages carry custom metadata: a decode and
    re-encode (the batch does not keep it) would give other bytes."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for k, batch in enumerate(table.to_batches(max_chunksize=max(table.num_rows // 2, 1))):
            writer.write_batch(batch, custom_metadata={"tag": f"{tag}-{k}"})
    return sink.getvalue().to_pybytes()


def _slot(ipc: bytes, slot: int = 0) -> Slot:
    facts = inspect_ipc_stream(ipc)
    return Slot(slot=slot, fingerprint=facts.fingerprint, row_count=facts.rows, ipc=ipc,
                schema=facts.schema, batches=facts.batches)


def _lazy(payloads: list[bytes]) -> tuple[OpenSegment, dict[int, memoryview]]:
    """An open segment of bundles left in the WAL, and the buffers its fetch hands out."""
    segment = OpenSegment()
    bundles = [Bundle(client="c", slots=(_slot(ipc),), ingestion_ts_ns=100 + i, sequence=1 + i)
               for i, ipc in enumerate(payloads)]
    segment.add_batch(bundles)
    fetched = {b.sequence: memoryview(bytearray(payloads[i])) for i, b in enumerate(bundles)}
    segment.load(lambda seqs: {s: {0: fetched[s]} for s in seqs})
    return segment, fetched


def _batch_messages(ipc: bytes | memoryview) -> list[bytes]:
    cut = stream_messages(memoryview(ipc))
    assert cut is not None
    return [bytes(m) for m in cut.batches]


def test_segment_stream_without_dictionaries_is_the_stored_batch_messages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = [_ipc_with_batch_metadata(_table(40, 40 * i), f"b{i}") for i in range(5)]

    def no_decode(payload: object) -> None:
        raise AssertionError("a stream without dictionaries was decoded for its segment")

    monkeypatch.setattr(open_segment_module, "_decode", no_decode)
    segment, fetched = _lazy(payloads)
    pieces = encode_segment(segment, max_dictionary_cardinality=1000)
    # Each stored message is written from the fetched (WAL) buffer itself: no copy.
    owners = {id(p.obj) for p in pieces if isinstance(p, memoryview)}
    assert all(id(buf.obj) in owners for buf in fetched.values())
    path = tmp_path / "s.qseg"
    write_segment(path, pieces)
    with SegmentReader.open(path) as reader:
        row = reader.directory.to_pylist()[0]
        offset, length = row["byte_offset"], row["byte_length"]
        data = memoryview(path.read_bytes())[offset: offset + length]
        blocks = file_blocks(data)
        stored = [bytes(data[o: o + n]) for o, n in blocks.batches]
        assert stored == [m for ipc in payloads for m in _batch_messages(ipc)]
        for i, ipc in enumerate(payloads):
            assert reader.bundle(i).slots[0].equals(pa.ipc.open_stream(ipc).read_all())
            # Delivery sends the slot as the producer sent it, batch metadata included.
            [slot] = reader.stored_slots(i) or []
            assert [bytes(p) for p in slot.parts[1:-1]] == _batch_messages(ipc)
            got = pa.ipc.open_stream(b"".join(bytes(p) for p in slot.parts))
            assert got.read_next_batch_with_custom_metadata().custom_metadata == \
                {b"tag": f"b{i}-0".encode()}


def test_stored_copy_gives_the_same_segment_as_held_bundles() -> None:
    payloads = [_ipc_with_batch_metadata(_table(10 + i, i), f"h{i}") for i in range(4)]
    lazy, _ = _lazy(payloads)
    held = OpenSegment()
    for i, ipc in enumerate(payloads):
        held.add(Bundle(client="c", slots=(_slot(ipc),), ingestion_ts_ns=100 + i, sequence=1 + i))

    def encoded(segment: OpenSegment) -> bytes:
        return b"".join(bytes(p) for p in encode_segment(segment, max_dictionary_cardinality=1000))

    assert encoded(lazy) == encoded(held)


def test_a_stream_with_a_slot_that_cannot_be_cut_is_encoded_from_batches(tmp_path: Path) -> None:
    """An empty IPC stream (schema and EOS: no record batch message to copy) beside
    ordinary ones: the whole stream is decoded and encoded as before, and reads back."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _table(1).schema):
        pass
    empty = sink.getvalue().to_pybytes()
    payloads = [encode_ipc_stream(_table(5)), empty, encode_ipc_stream(_table(3, 5))]
    segment, _ = _lazy(payloads)
    assert segment.streams[0].stored_messages() is None
    assert all(b is not None for b in segment.streams[0].batches)
    path = tmp_path / "s.qseg"
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1000))
    with SegmentReader.open(path) as reader:
        assert [reader.bundle(i).slots[0].num_rows for i in range(3)] == [5, 0, 3]
        assert reader.bundle(2).slots[0].equals(_table(3, 5))


def test_a_stream_with_dictionaries_is_still_unified(tmp_path: Path) -> None:
    tables = [pa.table({"d": pa.array(v).dictionary_encode()}) for v in (["a", "b"], ["c", "a"])]
    segment, _ = _lazy([encode_ipc_stream(t) for t in tables])
    assert segment.streams[0].stored_messages() is None
    path = tmp_path / "s.qseg"
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1000))
    with SegmentReader.open(path) as reader:
        assert [reader.bundle(i).slots[0] for i in range(2)] == tables


@pytest.mark.parametrize("batches", [1, 3])
def test_file_pieces_read_by_pyarrow_as_the_file_new_file_writes(batches: int) -> None:
    table = _table(30).replace_schema_metadata({"origin": "test"})
    ipc = encode_ipc_stream(pa.Table.from_batches(table.to_batches(max_chunksize=30 // batches)))
    messages = [memoryview(m) for m in _batch_messages(ipc)]
    pieces, size = file_pieces(table.schema.serialize().to_pybytes(), messages)
    data = b"".join(bytes(p) for p in pieces)
    assert len(data) == size
    reader = pa.ipc.open_file(pa.py_buffer(data))  # Arrow verifies the footer flatbuffer
    assert reader.num_record_batches == batches and reader.schema.equals(table.schema,
                                                                        check_metadata=True)
    assert reader.read_all().equals(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=30 // batches):
            writer.write_batch(batch)
    reference = sink.getvalue().to_pybytes()
    # Head, schema and batch messages are what pyarrow writes; only the footer differs.
    end = file_blocks(memoryview(reference)).batches[-1]
    assert data[: end[0] + end[1]] == reference[: end[0] + end[1]]


def test_stream_messages_refuses_what_it_cannot_copy() -> None:
    dicts = encode_ipc_stream(pa.table({"d": pa.array(["x"]).dictionary_encode()}))
    assert stream_messages(memoryview(dicts)) is None  # a dictionary message
    plain = encode_ipc_stream(_table(3))
    assert stream_messages(memoryview(plain[:-20])) is None  # cut inside a message
    legacy = pa.BufferOutputStream()
    with pa.ipc.new_stream(legacy, _table(3).schema,
                           options=pa.ipc.IpcWriteOptions(use_legacy_format=True)) as w:
        w.write(_table(3))
    assert stream_messages(memoryview(legacy.getvalue().to_pybytes())) is None


def test_daemon_segment_holds_the_producers_batch_messages_byte_for_byte(daemon_factory):
    """Through a real daemon (WAL, read-back, finalize): the segment's stream is the
    producer's record batch messages, custom metadata a re-encode would drop included."""
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 100},
                       in_process=True).start()
    payloads = [_ipc_with_batch_metadata(_table(50, 50 * i), f"p{i}") for i in range(6)]
    with Client.connect(d.socket) as c:
        acks = c.send_many([IpcPayload(ipc=p, rows=50) for p in payloads], client="c")
    assert d.stop() == 0
    [path] = sorted((d.data_dir / "shard-0/segments").glob("*.qseg"))
    with SegmentReader.open(path) as reader:
        by_sequence = {reader.bundle(i).sequence: i for i in range(reader.footer.bundle_count)}
        for ipc, ack in zip(payloads, acks, strict=True):
            [slot] = reader.stored_slots(by_sequence[ack.sequence]) or []
            assert [bytes(p) for p in slot.parts[1:-1]] == _batch_messages(ipc)


def _schema_message(endianness: int) -> bytes:
    """A minimal Schema message whose Schema table sets ``endianness`` (pyarrow itself
    writes only little-endian streams, leaving the field out)."""
    meta = bytearray(48)
    struct.pack_into("<I", meta, 0, 24)  # root: the Message table
    struct.pack_into("<5H", meta, 4, 10, 12, 8, 10, 4)  # Message vtable: version, type, header
    struct.pack_into("<3H", meta, 16, 6, 8, 4)  # Schema vtable: endianness
    struct.pack_into("<iIhB", meta, 24, 20, 8, 4, 1)  # Message: header at 36, V5, Schema
    struct.pack_into("<ih", meta, 36, 20, endianness)  # Schema
    return struct.pack("<Ii", 0xFFFFFFFF, len(meta)) + bytes(meta)


def test_stream_messages_refuses_a_big_endian_stream() -> None:
    """Arrow's reader swaps big-endian bodies on decode; copied under the file's
    little-endian schema they would read as other values: such a stream is decoded."""
    batch = _batch_messages(encode_ipc_stream(_table(3)))[0]
    little = _schema_message(0) + batch
    assert stream_messages(memoryview(little)) is not None  # the crafted message parses
    assert stream_messages(memoryview(_schema_message(1) + batch)) is None


def _typed_tables() -> dict[str, pa.Table]:
    n = 7
    base = {
        "bool": pa.array([True, None, False] * 2 + [True]),
        "int8": pa.array([1, -2, None, 4, 5, 6, 7], pa.int8()),
        "f64": pa.array([0.5 * i for i in range(n)]),
        "dec": pa.array([None] + [i * 10 for i in range(n - 1)], pa.decimal128(12, 2)),
        "ts": pa.array(range(n), pa.timestamp("us", tz="UTC")),
        "bin": pa.array([b"x" * i for i in range(n)]),
        "large": pa.array([f"v{i}" for i in range(n)], pa.large_utf8()),
        "view": pa.array([f"a longer string than twelve {i}" for i in range(n)], pa.string_view()),
        "fsb": pa.array([bytes([i]) * 4 for i in range(n)], pa.binary(4)),
        "list": pa.array([[i] * (i % 3) for i in range(n)], pa.list_(pa.int32())),
        "struct": pa.array([{"a": i, "b": None if i % 2 else "s"} for i in range(n)]),
        "null": pa.nulls(n),
    }
    tables = {name: pa.table({name: col, "id": pa.array(range(n), pa.int64())})
              for name, col in base.items()}
    tables["sliced"] = pa.table(base).slice(2, 4)
    return tables


@pytest.mark.parametrize("name", sorted(_typed_tables()))
def test_stored_copy_reads_back_every_type(tmp_path: Path, name: str) -> None:
    """Each Arrow type (and a sliced table) copied as stored reads back equal, and its
    slot is delivered as the bytes the producer sent."""
    table = _typed_tables()[name]
    payloads = [encode_ipc_stream(table), encode_ipc_stream(table.slice(1))]
    segment, _ = _lazy(payloads)
    assert segment.streams[0].stored_messages() is not None
    path = tmp_path / "s.qseg"
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1000))
    with SegmentReader.open(path) as reader:
        for i, ipc in enumerate(payloads):
            sent = pa.ipc.open_stream(ipc).read_all()
            assert reader.bundle(i).slots[0].equals(sent)
            [slot] = reader.stored_slots(i) or []
            assert b"".join(bytes(p) for p in slot.parts[1:-1]) == b"".join(_batch_messages(ipc))
            assert pa.ipc.open_stream(b"".join(bytes(p) for p in slot.parts)).read_all() == sent
