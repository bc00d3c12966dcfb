"""Segment files (quiverd.segments: format, reader, dictionaries): layout, round trips, damage."""

from __future__ import annotations

import random
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiverd.kernel.bundle import Bundle, Slot, TxnTag, fingerprint, read_ipc_stream
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord, FormatMismatch
from quiverd.segments.files import write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.segments.reader import SegmentReader, describe_segment, verify_segment
from quiverd.segments.schema import to_representative


def slot_of(slot: int, table: pa.Table) -> Slot:
    """Like bundle.make_slot, but keeps every batch boundary of ``table``."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    ipc = sink.getvalue().to_pybytes()
    return Slot(slot=slot, fingerprint=fingerprint(table.schema), row_count=table.num_rows, ipc=ipc)


def bundle_of(
    seq: int, tables: dict[int, pa.Table], *, client: str = "app", txn: TxnTag | None = None
) -> Bundle:
    slots = tuple(slot_of(s, t) for s, t in sorted(tables.items()))
    return Bundle(client=client, slots=slots, txn=txn, ingestion_ts_ns=1_000 + seq, sequence=seq)


def write(path: Path, bundles: list[Bundle], *, max_card: int = 1 << 20) -> Path:
    segment = OpenSegment()
    for b in bundles:
        segment.add(b)
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=max_card))
    return path


def assert_round_trip(path: Path, bundles: list[Bundle]) -> None:
    """Every bundle reads back exactly as sent: values, types, metadata, order."""
    with SegmentReader.open(path) as reader:
        read = list(reader.bundles())
    assert len(read) == len(bundles)
    for i, (got, sent) in enumerate(zip(read, bundles, strict=True)):
        assert (got.index, got.sequence, got.client, got.txn) == (
            i, sent.sequence, sent.client, sent.txn)
        assert got.ingestion_ts_ns == sent.ingestion_ts_ns
        assert sorted(got.slots) == [s.slot for s in sent.slots]
        for s in sent.slots:
            original = read_ipc_stream(s.ipc)
            assert got.slots[s.slot].equals(original, check_metadata=True), (i, s.slot)


def dict_col(values: Sequence[str | None], index_type: pa.DataType = pa.int32()) -> pa.Array:
    encoded = pa.array(values, pa.utf8()).dictionary_encode()
    return pa.DictionaryArray.from_arrays(encoded.indices.cast(index_type), encoded.dictionary)


def three_slot_bundles() -> list[Bundle]:
    """Slots 0, 1, 5 with some absent per bundle, multi-batch slots, a txn tag,
    an empty slot and schema-metadata variants sharing a stream."""
    bundles = []
    for seq in range(12):
        tables: dict[int, pa.Table] = {}
        logs = pa.table({"ts": pa.array(range(seq, seq + 4), pa.int64()),
                         "msg": [f"m{seq}-{i}" for i in range(4)]})
        if seq % 3 != 2:
            tables[0] = pa.concat_tables([logs, logs.slice(1)])  # two batches
        if seq % 2 == 0:
            attrs = pa.table({"key": ["host"], "value": [f"h{seq}"]})
            tables[1] = attrs.replace_schema_metadata({"producer": f"v{seq % 4}"})
        if seq % 4 == 1:
            tables[5] = pa.table({"x": pa.array([], pa.float64())})
        txn = TxnTag(job_id="j1", partition=seq, attempt=0, row_offset=4 * seq)
        client = f"c{seq % 2}"
        bundles.append(bundle_of(seq, tables, client=client, txn=txn if seq % 5 == 0 else None))
    bundles.append(bundle_of(99, {}))  # a bundle with no user slots at all
    return bundles


# --- layout -----------------------------------------------------------------


def test_segment_layout_streams_aligned_footer_and_crc(tmp_path: Path) -> None:
    path = write(tmp_path / "0000000000000001.qseg", three_slot_bundles())
    raw = path.read_bytes()
    footer_size, magic, crc = struct.unpack("<I8sI", raw[-16:])
    assert (footer_size, magic) == (38, b"QUIVER\0S")
    assert crc == crc32c(raw[:-4])
    fields = struct.unpack("<HIIQIQII", raw[-16 - 38:-16])
    version, streams, bundles, dir_off, dir_len, man_off, man_len, meta_crc = fields
    assert (version, bundles) == (2, 13)
    # The metadata CRC: directory, zero pad, manifest and the footer's first 34 bytes.
    assert meta_crc == crc32c(raw[dir_off:len(raw) - 16 - 4])
    directory = pa.ipc.open_file(pa.py_buffer(raw[dir_off:dir_off + dir_len])).read_all()
    manifest = pa.ipc.open_file(pa.py_buffer(raw[man_off:man_off + man_len])).read_all()
    assert directory.num_rows == streams == 3 and manifest.num_rows == bundles
    assert man_off + man_len == len(raw) - 16 - 38
    end = 0
    for row in directory.to_pylist():
        off, length = row["byte_offset"], row["byte_length"]
        assert off % 64 == 0 and raw[end:off] == bytes(off - end)  # zero pad only
        stream = pa.ipc.open_file(pa.py_buffer(raw[off:off + length]))  # opens on its own
        assert stream.num_record_batches == row["chunk_count"]
        rows = sum(stream.get_batch(i).num_rows for i in range(row["chunk_count"]))
        assert rows == row["row_count"]
        end = off + length
    assert dir_off % 64 == 0 and man_off % 64 == 0
    assert manifest.column("bundle_index").to_pylist() == list(range(13))
    assert stat.S_IMODE(path.stat().st_mode) == 0o440


def test_segment_open_segment_tracks_counts_and_sequences() -> None:
    segment = OpenSegment()
    bundles = three_slot_bundles()
    for b in bundles:
        segment.add(b)
    assert (segment.bundle_count, segment.stream_count) == (13, 3)
    assert (segment.first_sequence, segment.last_sequence) == (0, 99)
    assert (segment.min_ts, segment.max_ts) == (1_000, 1_099)
    assert segment.bytes == sum(b.payload_bytes for b in bundles)


# --- round trips ------------------------------------------------------------


def test_segment_round_trip_three_slots_some_absent(tmp_path: Path) -> None:
    bundles = three_slot_bundles()
    path = write(tmp_path / "s.qseg", bundles)
    assert_round_trip(path, bundles)
    verify_segment(path)
    with SegmentReader.open(path) as reader:
        assert reader.bundle(0).txn == bundles[0].txn
        assert reader.stats()["last_sequence"] == 99
        with pytest.raises(IndexError):
            reader.bundle(13)
    summary = describe_segment(path)
    assert summary["stats"]["bundle_count"] == 13 and set(summary["representative_schemas"]) == {
        "0", "1", "5"}


def test_segment_schema_drift_opens_streams_with_representative_schema(tmp_path: Path) -> None:
    v1 = pa.table({"a": pa.array([1, 2], pa.int32()), "s": ["x", "y"]})
    v2 = pa.table({"a": pa.array([3], pa.int64()), "s": ["z"]})
    v3 = pa.table({"a": pa.array([4], pa.int32()), "s": ["w"], "new": [1.5]})
    bundles = [bundle_of(i, {0: t}) for i, t in enumerate([v1, v2, v1, v3])]
    path = write(tmp_path / "s.qseg", bundles)
    assert_round_trip(path, bundles)
    with SegmentReader.open(path) as reader:
        assert reader.footer.stream_count == 3
        rep = reader.representative_schema(0)
        assert rep == pa.schema([("a", pa.int64()), ("s", pa.utf8()), ("new", pa.float64())])
        omitted = reader.directory.column("omitted_columns").to_pylist()
        assert omitted == [["new"], ["new"], []]
        first = to_representative(reader.bundle(0).slots[0], rep)
    assert first.column("a").to_pylist() == [1, 2]
    assert first.column("new").to_pylist() == [None, None]


# --- dictionaries -----------------------------------------------------------


def test_segment_dictionaries_changing_per_batch_read_back_exact(tmp_path: Path) -> None:
    rng = random.Random(7)
    bundles = []
    for seq in range(20):
        vocab = [f"v{rng.randrange(40)}" for _ in range(rng.randrange(1, 12))]
        values = [rng.choice(vocab) for _ in range(30)]
        # A pandas-like dictionary: unused entries, arbitrary order.
        dictionary = pa.array(sorted(set(vocab)) + [f"unused{seq}"])
        lookup = {v: i for i, v in enumerate(dictionary.to_pylist())}
        indices = pa.array([lookup[v] for v in values], pa.int16())
        cat = pa.DictionaryArray.from_arrays(indices, dictionary)
        table = pa.table({"cat": cat, "enc": dict_col(values, pa.uint8()), "n": range(30)})
        bundles.append(bundle_of(seq, {0: table}))
    path = write(tmp_path / "s.qseg", bundles)
    assert_round_trip(path, bundles)
    with SegmentReader.open(path) as reader:
        stored = reader.stream_reader(0)
        assert stored.num_record_batches == 20
        column = pa.Table.from_batches([stored.get_batch(i) for i in range(20)]).column("cat")
        assert column.chunks[0].dictionary.equals(column.chunks[-1].dictionary)


@pytest.mark.parametrize(
    ("index_type", "distinct", "stored"),
    [(pa.uint8(), 300, pa.uint16()), (pa.int8(), 200, pa.int16()),
     (pa.uint16(), 70_000, pa.uint32()), (pa.int16(), 40_000, pa.int32())],
)
def test_segment_dictionary_index_widens_values_identical(
    tmp_path: Path, index_type: pa.DataType, distinct: int, stored: pa.DataType
) -> None:
    per_bundle = 100 if distinct < 1000 else 10_000
    bundles = []
    for seq, start in enumerate(range(0, distinct, per_bundle)):
        values = [f"k{i}" for i in range(start, min(start + per_bundle, distinct))]
        bundles.append(bundle_of(seq, {0: pa.table({"k": dict_col(values, index_type)})}))
    path = write(tmp_path / "s.qseg", bundles)
    assert_round_trip(path, bundles)
    with SegmentReader.open(path) as reader:
        assert reader.stream_reader(0).schema.field("k").type.index_type == stored


def test_segment_dictionary_past_cardinality_falls_back_to_plain(tmp_path: Path) -> None:
    bundles = [bundle_of(s, {0: pa.table({"k": dict_col([f"x{s}-{i}" for i in range(8)])})})
               for s in range(4)]
    path = write(tmp_path / "s.qseg", bundles, max_card=20)
    assert_round_trip(path, bundles)
    with SegmentReader.open(path) as reader:
        assert reader.stream_reader(0).schema.field("k").type == pa.utf8()


@pytest.mark.parametrize("max_card", [1 << 20, 3])
def test_segment_dictionary_null_keys_and_values(tmp_path: Path, max_card: int) -> None:
    with_null_keys = dict_col(["a", None, "b", None])
    null_value = pa.DictionaryArray.from_arrays(
        pa.array([0, 1, None, 1], pa.int32()), pa.array(["c", None]))
    bundles = [bundle_of(0, {0: pa.table({"k": with_null_keys})}),
               bundle_of(1, {0: pa.table({"k": null_value})})]
    path = write(tmp_path / "s.qseg", bundles, max_card=max_card)
    with SegmentReader.open(path) as reader:
        for got, sent in zip(reader.bundles(), bundles, strict=True):
            original = read_ipc_stream(sent.slots[0].ipc).column("k")
            column = got.slots[0].column("k")
            assert column.type == original.type
            assert column.to_pylist() == original.to_pylist()
    if max_card > 3:  # the unified path is exact even for a null dictionary value
        assert_round_trip(path, bundles)


def test_segment_nested_dictionary_gets_stream_per_chunk(tmp_path: Path) -> None:
    def nested(values: list[str]) -> pa.Table:
        return pa.table({"s": pa.StructArray.from_arrays([dict_col(values)], names=["d"])})

    bundles = [bundle_of(0, {0: nested(["a", "b"])}), bundle_of(1, {0: nested(["c"])})]
    path = write(tmp_path / "s.qseg", bundles)
    assert_round_trip(path, bundles)
    with SegmentReader.open(path) as reader:
        assert reader.footer.stream_count == 2


# --- damage -----------------------------------------------------------------


@pytest.fixture
def segment_bytes(tmp_path: Path) -> bytes:
    return write(tmp_path / "good.qseg", three_slot_bundles()[:5]).read_bytes()


def _open_raw(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "bad.qseg"
    path.write_bytes(raw)
    SegmentReader.open(path).close()


def test_segment_truncated_anywhere_is_corrupt(tmp_path: Path, segment_bytes: bytes) -> None:
    n = len(segment_bytes)
    for cut in [0, 1, 15, 49, 50, 64, n // 3, n // 2, n - 17, n - 4, n - 1]:
        with pytest.raises(CorruptRecord):
            _open_raw(tmp_path, segment_bytes[:cut])


def test_segment_flipped_byte_anywhere_is_corrupt(tmp_path: Path, segment_bytes: bytes) -> None:
    n = len(segment_bytes)
    positions = set(random.Random(1).sample(range(n), 150)) | set(range(n - 64, n))
    for pos in sorted(positions):
        raw = bytearray(segment_bytes)
        raw[pos] ^= 0x10
        with pytest.raises(CorruptRecord):
            _open_raw(tmp_path, bytes(raw))


def _resealed(raw: bytes, footer: tuple[int, ...], footer_size: int = 38) -> bytes:
    """Replace the footer and recompute valid CRCs (metadata and whole file): damage
    no CRC can see."""
    fields = struct.pack("<HIIQIQI", *footer[:7])
    head = raw[:-16 - 38] + fields
    meta = crc32c(head[min(footer[3], len(head)):])
    body = head + struct.pack("<I", meta) + struct.pack("<I8s", footer_size, b"QUIVER\0S")
    return body + struct.pack("<I", crc32c(body))


def as_version_1(raw: bytes) -> bytes:
    """The same segment as format version 1 wrote it: a 34-byte footer, no metadata CRC."""
    fields = struct.unpack("<HIIQIQII", raw[-16 - 38:-16])
    body = (raw[:-16 - 38] + struct.pack("<HIIQIQI", 1, *fields[1:7])
            + struct.pack("<I8s", 34, b"QUIVER\0S"))
    return body + struct.pack("<I", crc32c(body))


def test_segment_bad_magic_and_bad_footer(tmp_path: Path, segment_bytes: bytes) -> None:
    with pytest.raises(CorruptRecord, match="bad magic"):
        _open_raw(tmp_path, segment_bytes[:-12] + b"QUIVER\0X" + segment_bytes[-4:])
    footer = struct.unpack("<HIIQIQII", segment_bytes[-54:-16])
    with pytest.raises(CorruptRecord, match="bad footer"):
        _open_raw(tmp_path, _resealed(segment_bytes, footer, footer_size=len(segment_bytes)))
    beyond = footer[:5] + (len(segment_bytes),) + footer[6:]
    with pytest.raises(CorruptRecord, match="bad footer"):
        _open_raw(tmp_path, _resealed(segment_bytes, beyond))
    with pytest.raises(FormatMismatch):
        _open_raw(tmp_path, _resealed(segment_bytes, (3,) + footer[1:]))
    _open_raw(tmp_path, _resealed(segment_bytes, footer))  # the resealing itself is sound


@pytest.mark.parametrize("step", ["tmp_written", "tmp_fsynced", "renamed", "dir_fsynced"])
def test_segment_crash_at_each_write_step(tmp_path: Path, step: str) -> None:
    segment = OpenSegment()
    for b in three_slot_bundles():
        segment.add(b)
    pieces = encode_segment(segment, max_dictionary_cardinality=1000)
    path = tmp_path / "0000000000000007.qseg"

    def crash(name: str) -> None:
        if name == step:
            raise SystemExit(f"crash at {name}")

    with pytest.raises(SystemExit):
        write_segment(path, pieces, hook=crash)
    renamed = step in ("renamed", "dir_fsynced")
    assert path.exists() == renamed
    if renamed:
        verify_segment(path)
        assert not (tmp_path / "0000000000000007.qseg.tmp").exists()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(
    st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f", None]), max_size=12),
    st.sampled_from([pa.int8(), pa.uint8(), pa.int32()]),
    st.permutations(range(6)),
), min_size=1, max_size=6), st.sampled_from([3, 1000]))
def test_segment_dictionary_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory,
    chunks: list[tuple[list[str | None], pa.DataType, list[int]]], max_card: int,
) -> None:
    """Random dictionaries (any order, unused entries) read back as the same values
    and type; exactly the same arrays unless the cardinality fallback applied."""
    letters = ["a", "b", "c", "d", "e", "f"]
    bundles = []
    for seq, (values, index_type, order) in enumerate(chunks):
        dictionary = pa.array([letters[i] for i in order])
        indices = pa.array([None if v is None else order.index(letters.index(v))
                            for v in values], index_type)
        column = pa.DictionaryArray.from_arrays(indices, dictionary)
        table = pa.table({"k": column}).replace_schema_metadata({"seq": str(seq)})
        bundles.append(bundle_of(seq, {3: table}))
    path = write(tmp_path_factory.mktemp("prop") / "s.qseg", bundles, max_card=max_card)
    with SegmentReader.open(path) as reader:
        for got, sent in zip(reader.bundles(), bundles, strict=True):
            original = read_ipc_stream(sent.slots[0].ipc)
            assert got.slots[3].schema.equals(original.schema, check_metadata=True)
            assert got.slots[3].column("k").to_pylist() == original.column("k").to_pylist()
            if max_card == 1000:
                assert got.slots[3].equals(original, check_metadata=True)


def test_segment_empty_open_segment_writes_valid_file(tmp_path: Path) -> None:
    path = write(tmp_path / "e.qseg", [])
    verify_segment(path)
    with SegmentReader.open(path) as reader:
        assert list(reader.bundles()) == [] and reader.stats()["row_count"] == 0


def test_segment_add_rejects_bad_payload_without_partial_state() -> None:
    segment = OpenSegment()
    good = bundle_of(0, {0: pa.table({"a": [1]})})
    bad = Slot(slot=1, fingerprint=b"\0" * 32, row_count=1, ipc=b"not arrow")
    with pytest.raises(pa.ArrowInvalid):
        segment.add(Bundle(client="x", slots=(good.slots[0], bad), ingestion_ts_ns=1, sequence=1))
    assert (segment.bundle_count, segment.stream_count, segment.bytes) == (0, 0, 0)
