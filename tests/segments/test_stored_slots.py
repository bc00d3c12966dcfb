"""Slots delivered as stored (SegmentReader.stored_slots, quiverd.segments.ipc_slices).

Every bundle's slots are cut from real segment files (OpenSegment + encode_segment +
write_segment) as IPC streams and decoded with pyarrow: what comes back must equal
what the producer sent, schema and field metadata, dictionaries and batch
boundaries included; bundles whose dictionaries were remapped at finalize must be
refused (None), so the caller restores them.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import Bundle, read_ipc_stream
from quiverd.kernel.errors import CorruptRecord
from quiverd.segments import format as segment_format
from quiverd.segments.ipc_slices import EOS, batch_rows, file_blocks
from quiverd.segments.reader import SegmentReader
from tests.segments.test_format import bundle_of, dict_col, three_slot_bundles, write


def stored_stream(parts: tuple[bytes | memoryview, ...]) -> pa.Table:
    return pa.ipc.open_stream(b"".join(bytes(p) for p in parts)).read_all()


def assert_stored_as_sent(path: Path, bundles: list[Bundle]) -> list[int]:
    """Each bundle sliced from the file equals the sent one; returns the indexes
    refused (to be restored), whose ``bundle()`` is checked instead."""
    refused = []
    with SegmentReader.open(path) as reader:
        for i, sent in enumerate(bundles):
            stored = reader.stored_slots(i)
            if stored is None:
                refused.append(i)
                continue
            assert [s.slot for s in stored] == [s.slot for s in sent.slots], i
            for got, slot in zip(stored, sent.slots, strict=True):
                original = read_ipc_stream(slot.ipc)
                table = stored_stream(got.parts)
                assert got.parts[-1] == EOS
                assert got.rows == original.num_rows == slot.row_count
                assert table.schema.equals(original.schema, check_metadata=True), (i, slot.slot)
                assert [f.metadata for f in table.schema] == [f.metadata for f in original.schema]
                assert table.equals(original, check_metadata=True), (i, slot.slot)
                if not original.num_rows:  # an empty stream is stored as one 0-row batch
                    continue
                assert [b.num_rows for b in table.to_batches()] == [
                    b.num_rows for b in original.to_batches()]
                for name in original.column_names:
                    for a, b in zip(table.column(name).chunks, original.column(name).chunks,
                                    strict=True):
                        if pa.types.is_dictionary(a.type):  # the very same dictionary
                            assert a.dictionary.equals(b.dictionary)
                            assert a.indices.equals(b.indices)
            meta = reader.bundle_meta(i)
            assert (meta.client, meta.txn, meta.ingestion_ts_ns, meta.slots) == (
                sent.client, sent.txn, sent.ingestion_ts_ns, {})
    return refused


def test_stored_slots_three_slots_multi_batch_metadata_variants_empty(tmp_path: Path) -> None:
    bundles = three_slot_bundles()  # slots absent, two batches, metadata variants, 0-row, none
    path = write(tmp_path / "s.qseg", bundles)
    assert assert_stored_as_sent(path, bundles) == []
    with SegmentReader.open(path) as reader:
        assert reader.stored_slots(len(bundles) - 1) == []  # a bundle with no user slots
        with pytest.raises(IndexError):
            reader.stored_slots(len(bundles))


def test_stored_slots_schema_drift_and_field_metadata(tmp_path: Path) -> None:
    v1 = pa.table({"a": pa.array([1, 2], pa.int32()), "s": ["x", "y"]})
    v2 = pa.table({"a": pa.array([3], pa.int64()), "s": ["z"]})
    v3 = pa.table({"a": pa.array([4], pa.int32()), "s": ["w"], "new": [1.5]})
    tagged = v1.cast(pa.schema([pa.field("a", pa.int32(), metadata={"unit": "ms"}),
                                pa.field("s", pa.utf8())], metadata={"v": "1"}))
    bundles = [bundle_of(i, {0: t}) for i, t in enumerate([v1, v2, tagged, v3, v1])]
    path = write(tmp_path / "s.qseg", bundles)
    assert assert_stored_as_sent(path, bundles) == []


def test_stored_slots_fixed_vocabulary_dictionaries_sliced_exact(tmp_path: Path) -> None:
    # The same dictionaries in every batch (the common producer): nothing to remap.
    vocabulary = ["DEBUG", "INFO", "WARN"]
    rng = random.Random(3)
    bundles = []
    for seq in range(6):
        levels = pa.DictionaryArray.from_arrays(
            pa.array([rng.randrange(3) for _ in range(50)], pa.int8()), pa.array(vocabulary))
        hosts = pa.DictionaryArray.from_arrays(
            pa.array([rng.choice([0, 1, None]) for _ in range(50)], pa.uint16()),
            pa.array(["h1", None]))
        t = pa.table({"level": levels, "n": range(50), "host": hosts})
        bundles.append(bundle_of(seq, {0: pa.concat_tables([t.slice(0, 20), t.slice(20)]),
                                       2: t.slice(0, 5)}))
    path = write(tmp_path / "s.qseg", bundles)
    assert assert_stored_as_sent(path, bundles) == []


def test_stored_slots_remapped_dictionaries_refused(tmp_path: Path) -> None:
    # Dictionaries that change per bundle are unified at finalize: those chunks carry
    # maps and must be restored, never sent as stored (the values would differ).
    bundles = [bundle_of(s, {0: pa.table({"k": dict_col(values)})})
               for s, values in enumerate([["a", "b", "c"], ["a", "b", "c"], ["c", "a"], ["b"]])]
    path = write(tmp_path / "s.qseg", bundles)
    refused = assert_stored_as_sent(path, bundles)
    assert refused == [2, 3]
    with SegmentReader.open(path) as reader:
        for i in refused:
            restored = reader.bundle(i).slots[0]
            assert restored.equals(read_ipc_stream(bundles[i].slots[0].ipc), check_metadata=True)


@pytest.mark.parametrize(("index_type", "count", "max_card"),
                         [(pa.uint8(), 300, 1 << 20), (pa.int32(), 8, 3)])
def test_stored_slots_widened_or_plain_dictionary_refused(
        tmp_path: Path, index_type: pa.DataType, count: int, max_card: int) -> None:
    bundles = [bundle_of(s, {0: pa.table({"k": dict_col(
        [f"x{s}-{i}" for i in range(count // 2)], index_type)})}) for s in range(2)]
    path = write(tmp_path / "s.qseg", bundles, max_card=max_card)
    assert assert_stored_as_sent(path, bundles) == [0, 1]


def test_stored_slots_widened_index_without_map_refused(tmp_path: Path) -> None:
    # Bundle 0's dictionary *is* the vocabulary (no map), but 300 entries outgrow its
    # uint8 index type, so the stored index is uint16: only the types tell.
    words = pa.array([f"w{i}" for i in range(300)])
    first = pa.DictionaryArray.from_arrays(pa.array([0, 255, 7], pa.uint8()), words)
    bundles = [bundle_of(0, {0: pa.table({"k": first})}),
               bundle_of(1, {0: pa.table({"k": dict_col(["w3", "w1"], pa.uint8())})})]
    path = write(tmp_path / "s.qseg", bundles)
    assert assert_stored_as_sent(path, bundles) == [0, 1]
    with SegmentReader.open(path) as reader:
        assert reader.stream_reader(0).schema.field("k").type.index_type == pa.uint16()
        assert reader._remapped_refs() == [False, True]


def test_stored_slots_nested_dictionary_solo_streams_multi_batch(tmp_path: Path) -> None:
    def nested(values: list[str]) -> pa.Table:
        return pa.table({"s": pa.StructArray.from_arrays([dict_col(values)], names=["d"]),
                         "top": dict_col(values[::-1])})

    two = pa.concat_tables([nested(["a", "b"]), nested(["c"])])  # two batches, two dicts
    bundles = [bundle_of(0, {0: two}), bundle_of(1, {0: nested(["c", "c"])})]
    path = write(tmp_path / "s.qseg", bundles)
    assert assert_stored_as_sent(path, bundles) == []
    with SegmentReader.open(path) as reader:
        assert reader.footer.stream_count == 3
        assert len(reader.stored_slots(0)[0].parts) == 1 + 2 * 3 + 1  # type: ignore[index]


def test_stored_slots_outlive_the_reader(tmp_path: Path) -> None:
    bundles = three_slot_bundles()[:3]
    path = write(tmp_path / "s.qseg", bundles)
    with SegmentReader.open(path) as reader:
        stored = reader.stored_slots(0)
    assert stored is not None
    path.unlink()  # closed and deleted: the views keep the mapping alive
    assert stored_stream(stored[0].parts).equals(read_ipc_stream(bundles[0].slots[0].ipc))


def test_stored_slots_batch_is_a_view_of_the_file(tmp_path: Path) -> None:
    big = pa.table({"n": pa.array(range(100_000), pa.int64())})
    path = write(tmp_path / "s.qseg", [bundle_of(0, {0: big})])
    raw = path.read_bytes()
    with SegmentReader.open(path) as reader:
        stored = reader.stored_slots(0)
        assert stored is not None
        batch = max(stored[0].parts, key=len)
        assert isinstance(batch, memoryview) and len(batch) > 800_000
        start = raw.index(bytes(batch))
        offset = reader.directory.column("byte_offset")[0].as_py()
        assert offset <= start < offset + reader.directory.column("byte_length")[0].as_py()


# --- ipc_slices: the IPC file footer, parsed by hand -------------------------


def ipc_file(*batches: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()


def test_file_blocks_match_pyarrow_messages() -> None:
    t = pa.record_batch({"k": dict_col(["a", "b", "a"]), "n": [1, 2, 3]})
    raw = ipc_file(t, t.slice(1), t.slice(0, 0))
    blocks = file_blocks(memoryview(raw))
    assert len(blocks.dictionaries) == 1 and len(blocks.batches) == 3
    assert [batch_rows(memoryview(raw)[o:o + n]) for o, n in blocks.batches] == [3, 2, 0]
    pieces = [t.schema.serialize().to_pybytes()]
    pieces += [raw[o:o + n] for o, n in (*blocks.dictionaries, blocks.batches[1])]
    got = pa.ipc.open_stream(b"".join(pieces) + EOS).read_all()
    assert got.equals(pa.Table.from_batches([t.slice(1)]))


def test_file_blocks_damaged_footer_raises_value_error_only() -> None:
    """Any truncation or flipped byte near the end gives blocks inside the file or a
    ValueError: never an out-of-bounds slice, never another exception."""
    raw = ipc_file(pa.record_batch({"k": dict_col(["a", "b"]), "n": [1, 2]}))
    (footer_len,) = struct.unpack_from("<i", raw, len(raw) - 10)
    start = len(raw) - 10 - footer_len
    damaged = [raw[:n] for n in range(0, len(raw), 7)]
    for pos in range(start - 8, len(raw)):
        for bit in (0x01, 0x80):
            flipped = bytearray(raw)
            flipped[pos] ^= bit
            damaged.append(bytes(flipped))
    ok = 0
    for data in damaged:
        try:
            blocks = file_blocks(memoryview(data))
        except ValueError:
            continue
        ok += 1
        for offset, length in (*blocks.dictionaries, *blocks.batches):
            assert 8 <= offset and offset + length <= len(data)
    assert ok < len(damaged)


def test_stored_slots_damaged_stream_footer_is_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose IPC footer is damaged before the segment's CRCs were computed
    (a bug, not a disk error) reads as CorruptRecord, not as wrong bytes. Stream 0 has
    no dictionary: its IPC file is built from the stored messages (``file_pieces``)."""
    real = segment_format.file_pieces
    calls: list[bytes] = []

    def damaged_first(schema: bytes, batches: list[memoryview]
                      ) -> tuple[list[bytes | memoryview], int]:
        pieces, size = real(schema, batches)
        if not calls:  # stream 0 only: directory and manifest stay readable
            tail = bytearray(pieces[-1])
            struct.pack_into("<i", tail, len(tail) - 10, 1 << 30)  # footer_len beyond it
            pieces[-1] = bytes(tail)
        calls.append(schema)
        return pieces, size

    monkeypatch.setattr(segment_format, "file_pieces", damaged_first)
    path = write(tmp_path / "s.qseg", three_slot_bundles()[:2])
    with SegmentReader.open(path) as reader, pytest.raises(CorruptRecord, match="stream 0"):
        reader.stored_slots(0)
