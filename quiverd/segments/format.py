"""Segment files: the finalized, read-only form of one shard's open segment.

``segments/<seq:016>.qseg``, all integers little-endian (SPEC §4)::

    [stream 0: Arrow IPC FILE]            offset 0
    [zero pad to 64][stream 1: IPC FILE]  every stream starts on a 64-byte boundary
    ...
    [zero pad to 64][stream directory]    Arrow IPC FILE, one row per stream:
        stream_id u32, slot_id u16, schema_fingerprint fsb(32), byte_offset u64,
        byte_length u64, row_count u64, chunk_count u32, min_ingestion_ts i64,
        max_ingestion_ts i64, omitted_columns list<utf8>,
        original_schemas list<binary>      every distinct schema (with metadata)
                                           the producers sent for this stream
    [zero pad to 64][batch manifest]      Arrow IPC FILE, one row per bundle, arrival order:
        bundle_index u32, client utf8, ingestion_ts i64, sequence u64 (WAL),
        txn struct<job_id utf8, partition u32, attempt u32, row_offset u64> (nullable),
        slot_refs list<struct<slot_id u16, stream_id u32, chunk_index u32,
                              schema_variant u32, dictionary_maps list<list<int32>>>>
    [footer, FOOTER_LEN = 2 + 4 + 4 + 8 + 4 + 8 + 4 + 4 = 38 bytes]
        version u16 = 2, stream_count u32, bundle_count u32, directory_offset u64,
        directory_length u32, manifest_offset u64, manifest_length u32,
        metadata_crc32c u32 over file[directory_offset : footer_start + 34]: the stream
                            directory, the zero pad, the manifest and the footer's
                            own 34 bytes before this field
    [trailer, TRAILER_LEN = 4 + 8 + 4 = 16 bytes]
        footer_size u32, magic b"QUIVER\\0S", crc32c u32 over file[:-4]

Version 2 lets startup trust a segment after reading only its metadata (the
trailer, the footer and the region ``metadata_crc32c`` covers: O(segments) bytes,
not O(retained bytes)); the whole-file CRC in the trailer is still checked before
the stream bytes are first delivered, by the scrubber and by ``quiverd fsck``.
Version 1 (still read) has the 34-byte footer without ``metadata_crc32c``
(``FOOTER_V1``), so only the whole-file CRC can vouch for its metadata.

A stream is every chunk of one ``(slot, schema fingerprint)``; a slot whose IPC
stream held k batches has k consecutive slot_refs. ``schema_variant`` indexes
``original_schemas`` (same types, maybe other metadata); ``dictionary_maps``
lets the reader give back each chunk's original dictionary (quiverd.segments.dictionaries).
Streams whose schema nests dictionaries inside other types cannot share one
IPC-file dictionary safely, so each such chunk gets a stream of its own.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from quiverd.kernel.crc import crc32c
from quiverd.segments.dictionaries import needs_solo_stream, unify_batches
from quiverd.segments.ipc_slices import file_pieces
from quiverd.segments.open_segment import BundleEntry, OpenSegment, Stream
from quiverd.segments.schema import representative_schema

Piece = bytes | memoryview

SEGMENT_MODE = 0o440
VERSION = 2  # the version written; VERSION_1 files are still read
VERSION_1 = 1
ALIGN = 64
MAGIC = b"QUIVER\0S"
FOOTER_V1 = struct.Struct("<HIIQIQI")  # 2 + 4 + 4 + 8 + 4 + 8 + 4 = 34 bytes
FOOTER = struct.Struct("<HIIQIQII")  # FOOTER_V1 + metadata_crc32c u32 = 38 bytes
TRAILER = struct.Struct("<I8sI")  # footer_size, magic, crc32c = 16 bytes

TXN_TYPE = pa.struct([
    pa.field("job_id", pa.utf8()), pa.field("partition", pa.uint32()),
    pa.field("attempt", pa.uint32()), pa.field("row_offset", pa.uint64()),
])
MAPS_TYPE = pa.list_(pa.list_(pa.int32()))
SLOT_REF_TYPE = pa.struct([
    pa.field("slot_id", pa.uint16()), pa.field("stream_id", pa.uint32()),
    pa.field("chunk_index", pa.uint32()), pa.field("schema_variant", pa.uint32()),
    pa.field("dictionary_maps", MAPS_TYPE),
])
MANIFEST_SCHEMA = pa.schema([
    pa.field("bundle_index", pa.uint32()), pa.field("client", pa.utf8()),
    pa.field("ingestion_ts", pa.int64()), pa.field("sequence", pa.uint64()),
    pa.field("txn", TXN_TYPE), pa.field("slot_refs", pa.list_(SLOT_REF_TYPE)),
])
DIRECTORY_SCHEMA = pa.schema([
    pa.field("stream_id", pa.uint32()), pa.field("slot_id", pa.uint16()),
    pa.field("schema_fingerprint", pa.binary(32)), pa.field("byte_offset", pa.uint64()),
    pa.field("byte_length", pa.uint64()), pa.field("row_count", pa.uint64()),
    pa.field("chunk_count", pa.uint32()), pa.field("min_ingestion_ts", pa.int64()),
    pa.field("max_ingestion_ts", pa.int64()), pa.field("omitted_columns", pa.list_(pa.utf8())),
    pa.field("original_schemas", pa.list_(pa.binary())),
])


def encode_segment(open_segment: OpenSegment, *, max_dictionary_cardinality: int,
                   arena: Arena | None = None) -> list[Piece]:
    """The whole segment file as pieces to write in order (blocking, pure).

    A stream without dictionaries is its chunks' record batch messages as stored
    (views of the WAL page cache or of held payloads, ``Stream.stored_messages``),
    copied behind a new IPC file head and footer (``ipc_slices.file_pieces``): no
    decode, no encode. Other streams are serialized once into one IPC file each;
    only dictionary columns are rebuilt. The last piece carries the footer, trailer
    and CRC.
    """
    pieces: list[Piece] = []
    if arena is not None:
        arena.reset()
    offset = 0
    stream_rows: list[dict[str, object]] = []
    chunk_maps: list[list[list[pa.Array | None]]] = []
    for stream_id, stream in enumerate(open_segment.streams):
        schema = stream.schemas[0]
        stored = stream.stored_messages()
        if stored is not None:
            parts, size = file_pieces(schema.serialize().to_pybytes(), stored)
            pieces.extend(parts)
            stream_rows.append(_directory_row(stream_id, stream, offset, size))
            chunk_maps.append([[] for _ in stored])
            offset = _pad(pieces, offset + size)
            continue
        if needs_solo_stream(schema):
            stored_schema, batches = schema, stream.batches
            maps: list[list[pa.Array | None]] = [[] for _ in batches]
        else:
            stored_schema, batches, maps = unify_batches(
                schema, stream.batches, max_dictionary_cardinality
            )
        data = (_ipc_file(stored_schema, batches) if arena is None
                else arena.write(stored_schema, batches))
        pieces.append(memoryview(data))
        stream_rows.append(_directory_row(stream_id, stream, offset, data.size))
        chunk_maps.append(maps)
        offset = _pad(pieces, offset + data.size)
    directory = _ipc_file_of(directory_table(stream_rows, open_segment.streams))
    directory_offset = offset
    pieces.append(memoryview(directory))
    offset = _pad(pieces, offset + directory.size)
    manifest = _ipc_file_of(manifest_table(open_segment.entries, chunk_maps))
    manifest_offset = offset
    pieces.append(memoryview(manifest))
    crc = 0
    for piece in pieces:
        crc = crc32c(piece, crc)
    pieces.append(encode_tail(
        stream_count=len(stream_rows), bundle_count=open_segment.bundle_count,
        directory_offset=directory_offset, directory=memoryview(directory),
        manifest_offset=manifest_offset, manifest=memoryview(manifest), crc=crc))
    return pieces


def encode_tail(*, stream_count: int, bundle_count: int, directory_offset: int,
                directory: Piece, manifest_offset: int, manifest: Piece, crc: int) -> bytes:
    """Footer + trailer, the file's last bytes (pure).

    ``crc`` is the running CRC-32C of every byte before them (streams, pads,
    directory, pad, manifest). The footer's ``metadata_crc32c`` covers the
    directory, the zero pad up to ``manifest_offset``, the manifest and the
    footer's first 34 bytes; the trailer's CRC covers everything but itself.
    """
    footer = FOOTER_V1.pack(VERSION, stream_count, bundle_count, directory_offset,
                            len(directory), manifest_offset, len(manifest))
    gap = manifest_offset - directory_offset - len(directory)
    assert 0 <= gap < ALIGN, (directory_offset, len(directory), manifest_offset)
    meta = crc32c(footer, crc32c(manifest, crc32c(bytes(gap), crc32c(directory))))
    tail = footer + struct.pack("<I", meta) + TRAILER.pack(FOOTER.size, MAGIC, 0)[:-4]
    return tail + struct.pack("<I", crc32c(tail, crc))


class Arena:
    """One warm buffer the streams of a segment are encoded into, reused segment after
    segment (one per finalizer). A growing ``BufferOutputStream`` copies on every
    doubling and writes into fresh pages each time (≈ 3.7 µs per 4 KiB here,
    NOTES.md); encoding into the same pages is ≈ 3× faster. Each stream is sized by
    a dry run first (``MockOutputStream``: no bytes copied), so a write never overflows;
    a segment larger than the arena moves on to a bigger one (earlier pieces keep the
    old buffer alive). The pieces ``encode_segment`` returns view it: valid until the
    next ``encode_segment`` with the same arena.
    """

    def __init__(self) -> None:
        self.buffer: pa.Buffer | None = None
        self.used = 0

    def reset(self) -> None:
        """A new segment: regions of the last one are free again."""
        self.used = 0

    def write(self, schema: pa.Schema, batches: list[pa.RecordBatch]) -> pa.Buffer:
        """The IPC file of ``batches``, encoded into the arena."""
        dry = pa.MockOutputStream()
        _write_ipc_file(dry, schema, batches)
        size = dry.size()
        start = self.used
        if self.buffer is None or start + size > self.buffer.size:
            grown = max(2 * (self.buffer.size if self.buffer is not None else 0), size + size // 4)
            self.buffer, start = pa.allocate_buffer(grown), 0
        # A slice of a pa.Buffer is read-only; one through a memoryview stays writable.
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(memoryview(self.buffer)[start:start + size]))
        _write_ipc_file(sink, schema, batches)
        end = start + size
        self.used = end + -end % ALIGN
        return self.buffer.slice(start, size)


def _write_ipc_file(sink: pa.NativeFile, schema: pa.Schema,
                    batches: list[pa.RecordBatch]) -> None:
    with pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)


def _ipc_file(schema: pa.Schema, batches: list[pa.RecordBatch]) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    _write_ipc_file(sink, schema, batches)
    return sink.getvalue()


def _ipc_file_of(table: pa.Table) -> pa.Buffer:
    return _ipc_file(table.schema, table.to_batches())


def _pad(pieces: list[Piece], end: int) -> int:
    """Zero-pad so the next region starts on an ALIGN boundary; returns its offset."""
    gap = -end % ALIGN
    if gap:
        pieces.append(bytes(gap))
    return end + gap


def _directory_row(stream_id: int, stream: Stream, offset: int, length: int) -> dict[str, object]:
    return {
        "stream_id": stream_id, "slot_id": stream.slot,
        "schema_fingerprint": stream.fingerprint, "byte_offset": offset,
        "byte_length": length, "row_count": stream.rows, "chunk_count": len(stream.batches),
        "min_ingestion_ts": stream.min_ts, "max_ingestion_ts": stream.max_ts,
    }


def directory_table(rows: list[dict[str, object]], streams: list[Stream]) -> pa.Table:
    """The stream directory; omitted columns are judged against the slot's
    representative schema over this segment's streams."""
    by_slot: dict[int, list[pa.Schema]] = {}
    for stream in streams:
        by_slot.setdefault(stream.slot, []).append(stream.schemas[0])
    names = {slot: representative_schema(schemas).names for slot, schemas in by_slot.items()}
    for row, stream in zip(rows, streams, strict=True):
        present = set(stream.schemas[0].names)
        row["omitted_columns"] = [n for n in names[stream.slot] if n not in present]
        row["original_schemas"] = [s.serialize().to_pybytes() for s in stream.schemas]
    return pa.Table.from_pylist(rows, schema=DIRECTORY_SCHEMA)


def manifest_table(
    entries: list[BundleEntry], chunk_maps: list[list[list[pa.Array | None]]]
) -> pa.Table:
    """The batch manifest. Per-chunk work is Python (a few fields per chunk);
    dictionary maps are assembled as Arrow arrays, never as Python lists."""
    ref_offsets = [0]
    slot_ids: list[int] = []
    stream_ids: list[int] = []
    chunks: list[int] = []
    variants: list[int] = []
    maps: list[list[pa.Array | None]] = []
    for entry in entries:
        for ref in entry.refs:
            slot_ids.append(ref.slot)
            stream_ids.append(ref.stream)
            chunks.append(ref.chunk)
            variants.append(ref.variant)
            maps.append(chunk_maps[ref.stream][ref.chunk])
        ref_offsets.append(len(slot_ids))
    refs = pa.StructArray.from_arrays(
        [pa.array(slot_ids, pa.uint16()), pa.array(stream_ids, pa.uint32()),
         pa.array(chunks, pa.uint32()), pa.array(variants, pa.uint32()), _maps_array(maps)],
        fields=list(SLOT_REF_TYPE),
    )
    txns = [None if e.txn is None else {
        "job_id": e.txn.job_id, "partition": e.txn.partition, "attempt": e.txn.attempt,
        "row_offset": e.txn.row_offset,
    } for e in entries]
    columns = [
        pa.array(range(len(entries)), pa.uint32()),
        pa.array([e.client for e in entries], pa.utf8()),
        pa.array([e.ingestion_ts_ns for e in entries], pa.int64()),
        pa.array([e.sequence for e in entries], pa.uint64()),
        pa.array(txns, TXN_TYPE),
        pa.ListArray.from_arrays(pa.array(ref_offsets, pa.int32()), refs),
    ]
    return pa.Table.from_arrays(columns, schema=MANIFEST_SCHEMA)


def _maps_array(maps: list[list[pa.Array | None]]) -> pa.Array:
    """list<list<int32>> from per-chunk lists of optional int32 arrays."""
    outer = [0]
    inner = [0]
    inner_null: list[bool] = []
    values: list[pa.Array] = []
    for chunk_maps in maps:
        for mapping in chunk_maps:
            inner_null.append(mapping is None)
            if mapping is not None:
                values.append(mapping)
            inner.append(inner[-1] + (0 if mapping is None else len(mapping)))
        outer.append(len(inner_null))
    flat = pa.concat_arrays(values) if values else pa.array([], pa.int32())
    mask = pa.array(inner_null, pa.bool_())
    inner_array = pa.ListArray.from_arrays(pa.array(inner, pa.int32()), flat, mask=mask)
    return pa.ListArray.from_arrays(pa.array(outer, pa.int32()), inner_array)
