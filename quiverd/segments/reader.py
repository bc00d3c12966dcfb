"""Reading segment files (layout: quiverd.segments.format): validate first, then map.

``SegmentReader.open`` checks the trailer magic, the footer bounds and a CRC-32C
before it parses anything else, because Arrow IPC has no checksum of its own: a
flipped bit would read back as wrong values. ``full=True`` (the default) checks
the whole-file CRC over ``file[:-4]``; ``full=False`` (recovery at startup) only
the version 2 footer's ``metadata_crc32c`` over directory, manifest and footer,
so opening costs O(metadata) bytes read, not O(file). A version 1 file has no
metadata CRC: it always gets the whole-file check. A reader opened with
``full=False`` has ``fully_checked`` False until ``check_file_crc()`` passes.
The file is memory-mapped; every stream slice is handed to Arrow's IPC file
reader without a copy, and bundles are restored to the exact schema their
producer sent (quiverd.segments.dictionaries).
"""

from __future__ import annotations

import mmap
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord, FormatMismatch
from quiverd.kernel.jobs import END_OFFSET, read_end_marker
from quiverd.segments.dictionaries import restore_batch
from quiverd.segments.format import (
    ALIGN,
    DIRECTORY_SCHEMA,
    FOOTER,
    FOOTER_V1,
    MAGIC,
    MANIFEST_SCHEMA,
    TRAILER,
    VERSION,
    VERSION_1,
)
from quiverd.segments.ipc_slices import EOS, FileBlocks, batch_rows, file_blocks
from quiverd.segments.schema import representative_schema
from quiverd.segments.table import StagedRef

MIN_FILE_LEN = FOOTER_V1.size + TRAILER.size


@dataclass(frozen=True, slots=True)
class Footer:
    version: int
    stream_count: int
    bundle_count: int
    directory_offset: int
    directory_length: int
    manifest_offset: int
    manifest_length: int
    metadata_crc32c: int | None = None  # version 2 and later


@dataclass(frozen=True, slots=True)
class ReadBundle:
    """One bundle as the producer sent it; ``slots`` maps slot id → table."""

    index: int
    sequence: int
    client: str
    ingestion_ts_ns: int
    txn: TxnTag | None
    slots: dict[int, pa.Table]


@dataclass(frozen=True, slots=True)
class StoredSlot:
    """One slot of a bundle as an IPC stream: pieces to send in order, cut from the
    mapped file (schema message, dictionary and record batch messages, EOS)."""

    slot: int
    rows: int
    parts: tuple[bytes | memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


def parse_footer(data: pa.Buffer, path: str, *, full: bool = True) -> Footer:
    """Check trailer, footer bounds and CRCs over ``data`` (a whole file); pure.

    ``full``: the whole-file CRC too. Without it a version 2 file is checked by its
    metadata CRC alone, and only the tail, directory and manifest pages are read.
    A version 1 file, an unknown version or a footer size that disagrees with the
    version always get the whole-file CRC, so damage reads as CorruptRecord and
    only an intact file of a newer version as FormatMismatch.
    """
    size = data.size
    if size < MIN_FILE_LEN:
        raise CorruptRecord(path, 0, f"truncated: {size} bytes, a segment needs {MIN_FILE_LEN}")
    view = memoryview(data)
    footer_size, magic, crc = TRAILER.unpack(view[size - TRAILER.size:])
    if magic != MAGIC:
        raise CorruptRecord(path, size - 12, f"bad magic {magic!r} (truncated or not a segment)")
    footer_start = size - TRAILER.size - footer_size
    if footer_size < FOOTER_V1.size or footer_start < 0:
        raise CorruptRecord(path, size - TRAILER.size, f"bad footer: size {footer_size}")
    version = int.from_bytes(view[footer_start: footer_start + 2], "little")
    layout = {VERSION: FOOTER, VERSION_1: FOOTER_V1}.get(version)
    if full or layout is not FOOTER or footer_size != FOOTER.size:
        check_file_crc(view, crc, path)
    if layout is None:
        raise FormatMismatch(path, footer_start, f"unsupported segment version {version}")
    if footer_size != layout.size:
        raise CorruptRecord(path, size - TRAILER.size, f"bad footer: size {footer_size}")
    footer = Footer(*layout.unpack(view[footer_start: footer_start + footer_size]))
    regions = [(footer.directory_offset, footer.directory_length),
               (footer.manifest_offset, footer.manifest_length)]
    if (footer.directory_offset + footer.directory_length > footer.manifest_offset
            or any(off % ALIGN or off + n > footer_start for off, n in regions)):
        raise CorruptRecord(path, footer_start, f"bad footer: regions out of bounds {footer}")
    if footer.metadata_crc32c is not None:
        covered = view[footer.directory_offset: footer_start + FOOTER_V1.size]
        actual = crc32c(covered)
        if actual != footer.metadata_crc32c:
            raise CorruptRecord(path, footer_start + FOOTER_V1.size, "metadata crc mismatch: "
                                f"stored {footer.metadata_crc32c:#010x}, got {actual:#010x}")
    return footer


def check_file_crc(view: memoryview, stored: int, path: str) -> None:
    """The trailer's CRC-32C over ``view[:-4]`` (every byte but itself); pure."""
    actual = crc32c(view[: len(view) - 4])
    if actual != stored:
        raise CorruptRecord(path, len(view) - 4,
                            f"crc mismatch: stored {stored:#010x}, got {actual:#010x}")


class SegmentReader:
    """A validated, memory-mapped segment. Use as a context manager or close()."""

    def __init__(self, path: str, source: mmap.mmap, data: pa.Buffer, footer: Footer,
                 *, fully_checked: bool = True) -> None:
        self.path = path
        self.footer = footer
        self.fully_checked = fully_checked  # the whole-file CRC passed
        self._source = source
        self._data = data
        self.directory = self._table(footer.directory_offset, footer.directory_length,
                                     DIRECTORY_SCHEMA, footer.stream_count, "directory")
        self.manifest = self._table(footer.manifest_offset, footer.manifest_length,
                                    MANIFEST_SCHEMA, footer.bundle_count, "manifest")
        self._streams = self.directory.to_pydict()
        self._check_streams()
        self._readers: dict[int, pa.ipc.RecordBatchFileReader] = {}
        self._schemas: dict[tuple[int, int], pa.Schema] = {}
        # stored_slots' caches: per stream, its IPC file's message blocks; per
        # (stream, variant), whether the stored schema has the original's types.
        self._blocks: dict[int, tuple[int, FileBlocks]] = {}
        self._as_sent: dict[tuple[int, int], bool] = {}
        self._remapped: list[bool] | None = None
        self._load_manifest()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, full: bool = True,
             prefetch: bool = True) -> SegmentReader:
        """Map and validate a segment; ``full=False``: the metadata CRC only (version 2).

        ``prefetch`` asks the kernel to read the whole file ahead (MADV_WILLNEED), as
        delivery will; recovery, which needs only the metadata pages, passes False
        (pyarrow's ``memory_map`` would advise WILLNEED on the whole file: about 12 MB
        read per 32 MiB segment on a cold cache instead of the metadata's few pages).
        """
        name, source, data, footer = _map(path, full=full, prefetch=prefetch)
        try:
            checked = full or footer.version == VERSION_1  # version 1: the file CRC, always
            return cls(name, source, data, footer, fully_checked=checked)
        except BaseException:
            _unmap(source)
            raise

    def check_file_crc(self) -> None:
        """The whole-file CRC, once (reads every byte); raises CorruptRecord."""
        if not self.fully_checked:
            stored = int.from_bytes(memoryview(self._data)[self._data.size - 4:], "little")
            check_file_crc(memoryview(self._data), stored, self.path)
            self.fully_checked = True

    def has_end_markers(self) -> bool:
        """Does the manifest list a transactional end marker (``staged`` reads its rows)?"""
        return any(t is not None and t["row_offset"] == END_OFFSET for t in self._txns)

    def close(self) -> None:
        self._readers.clear()
        _unmap(self._source)

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream_reader(self, stream_id: int) -> pa.ipc.RecordBatchFileReader:
        """Arrow's file reader over one stream slice (zero copy, cached)."""
        reader = self._readers.get(stream_id)
        if reader is None:
            offset = self._streams["byte_offset"][stream_id]
            length = self._streams["byte_length"][stream_id]
            try:
                reader = pa.ipc.open_file(self._data.slice(offset, length))
            except (pa.ArrowInvalid, OSError) as exc:
                raise CorruptRecord(self.path, offset, f"stream {stream_id}: {exc}") from exc
            self._readers[stream_id] = reader
        return reader

    def bundles(self) -> Iterator[ReadBundle]:
        """Every bundle in arrival order, each exactly as sent."""
        for i in range(self.footer.bundle_count):
            yield self.bundle(i)

    def bundle(self, index: int) -> ReadBundle:
        if not 0 <= index < self.footer.bundle_count:
            raise IndexError(f"bundle {index} not in 0..{self.footer.bundle_count - 1}")
        chunks: dict[int, list[pa.RecordBatch]] = {}
        schemas: dict[int, pa.Schema] = {}
        for j in range(self._ref_offsets[index], self._ref_offsets[index + 1]):
            slot = self._ref_slot[j]
            batch, schemas[slot] = self._chunk(j)
            chunks.setdefault(slot, []).append(batch)
        txn = self._txns[index]
        return ReadBundle(
            index=index, sequence=self._sequences[index], client=self._clients[index],
            ingestion_ts_ns=self._ts[index], txn=None if txn is None else TxnTag(**txn),
            slots={s: pa.Table.from_batches(b, schema=schemas[s]) for s, b in chunks.items()},
        )

    def bundle_meta(self, index: int) -> ReadBundle:
        """Bundle ``index`` without its data (``slots`` empty): nothing is decoded."""
        if not 0 <= index < self.footer.bundle_count:
            raise IndexError(f"bundle {index} not in 0..{self.footer.bundle_count - 1}")
        txn = self._txns[index]
        return ReadBundle(
            index=index, sequence=self._sequences[index], client=self._clients[index],
            ingestion_ts_ns=self._ts[index], txn=None if txn is None else TxnTag(**txn),
            slots={},
        )

    def stored_slots(self, index: int) -> list[StoredSlot] | None:
        """Bundle ``index``'s slots (slot order) as IPC streams cut from the file:
        zero copy, nothing decoded. None when a chunk is not stored as it was sent
        (a dictionary remapped, its index widened or stored plain): ``bundle`` then
        restores it. Raises CorruptRecord for a footer or manifest that points
        outside the file."""
        if not 0 <= index < self.footer.bundle_count:
            raise IndexError(f"bundle {index} not in 0..{self.footer.bundle_count - 1}")
        remapped = self._remapped_refs()
        out: list[StoredSlot] = []
        j, end = self._ref_offsets[index], self._ref_offsets[index + 1]
        while j < end:
            slot = self._ref_slot[j]
            schema = self._schema_bytes(j)
            parts: list[bytes | memoryview] = [schema]
            rows, last_stream = 0, -1
            while j < end and self._ref_slot[j] == slot:
                stream_id, chunk = self._ref_stream[j], self._ref_chunk[j]
                if remapped[j] or self._schema_bytes(j) != schema \
                        or not self._stored_as_sent(stream_id, self._ref_variant[j]):
                    return None
                base, blocks = self._stream_blocks(stream_id)
                if chunk >= len(blocks.batches):
                    raise CorruptRecord(self.path, base, f"stream {stream_id}: no chunk {chunk}")
                if stream_id != last_stream:  # a solo stream per chunk: its own dictionaries
                    parts.extend(self._slice(base, block) for block in blocks.dictionaries)
                    last_stream = stream_id
                batch = self._slice(base, blocks.batches[chunk])
                try:
                    rows += batch_rows(batch)
                except ValueError as exc:
                    raise CorruptRecord(self.path, base, f"stream {stream_id}: {exc}") from exc
                parts.append(batch)
                j += 1
            parts.append(EOS)
            out.append(StoredSlot(slot=slot, rows=rows, parts=tuple(parts)))
        return out

    def staged(self) -> dict[int, StagedRef]:
        """The transactional bundles by index; an end marker's rows and checksum are
        read from its one-row slot."""
        out: dict[int, StagedRef] = {}
        for i, txn in enumerate(self._txns):
            if txn is None:
                continue
            end = (-1, 0)
            if txn["row_offset"] == END_OFFSET:
                try:
                    end = read_end_marker(self.bundle(i).slots[0])
                except (KeyError, ValueError) as exc:
                    raise CorruptRecord(str(self.path), 0, f"bundle {i} is tagged as an end "
                                        f"marker but is not one: {exc}") from exc
            out[i] = StagedRef(job_id=txn["job_id"], partition=txn["partition"],
                               attempt=txn["attempt"], end_rows=end[0], end_checksum=end[1])
        return out

    def original_schema(self, stream_id: int, variant: int = 0) -> pa.Schema:
        """A schema exactly as a producer sent it for this stream."""
        key = (stream_id, variant)
        schema = self._schemas.get(key)
        if schema is None:
            raw = self._streams["original_schemas"][stream_id][variant]
            schema = self._schemas[key] = pa.ipc.read_schema(pa.py_buffer(raw))
        return schema

    def representative_schema(self, slot: int) -> pa.Schema:
        return representative_schema(
            self.original_schema(sid) for sid, s in enumerate(self._streams["slot_id"]) if s == slot
        )

    def stats(self) -> dict[str, Any]:
        s = self._streams
        slots: dict[int, dict[str, int]] = {}
        for sid, slot in enumerate(s["slot_id"]):
            entry = slots.setdefault(slot, {"streams": 0, "rows": 0, "chunks": 0})
            entry["streams"] += 1
            entry["rows"] += s["row_count"][sid]
            entry["chunks"] += s["chunk_count"][sid]
        return {
            "file_bytes": self._data.size, "stream_count": self.footer.stream_count,
            "bundle_count": self.footer.bundle_count, "row_count": sum(s["row_count"]),
            "stream_bytes": sum(s["byte_length"]),
            "min_ingestion_ts": min(self._ts, default=None),
            "max_ingestion_ts": max(self._ts, default=None),
            "first_sequence": self._sequences[0] if self._sequences else None,
            "last_sequence": self._sequences[-1] if self._sequences else None,
            "slots": slots,
        }

    def _chunk(self, j: int) -> tuple[pa.RecordBatch, pa.Schema]:
        stream_id, chunk, variant = self._ref_stream[j], self._ref_chunk[j], self._ref_variant[j]
        if (stream_id >= self.footer.stream_count
                or chunk >= self._streams["chunk_count"][stream_id]
                or variant >= len(self._streams["original_schemas"][stream_id])):
            raise CorruptRecord(self.path, self.footer.manifest_offset,
                                f"slot_ref {j} points outside the directory")
        original = self.original_schema(stream_id, variant)
        batch = self.stream_reader(stream_id).get_batch(chunk)
        return restore_batch(batch, original, self._maps(j)), original

    def _schema_bytes(self, j: int) -> bytes:
        """Slot ref ``j``'s original schema as an IPC message (as serialized at finalize)."""
        stream_id, variant = self._ref_stream[j], self._ref_variant[j]
        schemas = (self._streams["original_schemas"][stream_id]
                   if stream_id < self.footer.stream_count else [])
        if variant >= len(schemas):
            raise CorruptRecord(self.path, self.footer.manifest_offset,
                                f"slot_ref {j} points outside the directory")
        raw: bytes = schemas[variant]
        return raw

    def _stored_as_sent(self, stream_id: int, variant: int) -> bool:
        """Has the stream's stored schema the original's exact types (no index
        widened, no dictionary stored plain)? Metadata is the original's anyway."""
        key = (stream_id, variant)
        same = self._as_sent.get(key)
        if same is None:
            stored = self.stream_reader(stream_id).schema
            same = self._as_sent[key] = stored.equals(self.original_schema(stream_id, variant))
        return same

    def _stream_blocks(self, stream_id: int) -> tuple[int, FileBlocks]:
        """The stream's file offset and its IPC file's message blocks (cached)."""
        found = self._blocks.get(stream_id)
        if found is None:
            offset = self._streams["byte_offset"][stream_id]
            length = self._streams["byte_length"][stream_id]
            try:
                blocks = file_blocks(memoryview(self._data)[offset: offset + length])
            except ValueError as exc:
                raise CorruptRecord(self.path, offset, f"stream {stream_id}: {exc}") from exc
            found = self._blocks[stream_id] = (offset, blocks)
        return found

    def _slice(self, base: int, block: tuple[int, int]) -> memoryview:
        return memoryview(self._data)[base + block[0]: base + block[0] + block[1]]

    def _remapped_refs(self) -> list[bool]:
        """Per slot ref: does it carry a dictionary map (its dictionary must be
        restored)? From offsets and validity only, once per segment."""
        if self._remapped is None:
            maps = self._ref_maps
            offsets = maps.offsets.to_pylist()
            inner_valid = maps.values.is_valid().to_pylist()
            outer_valid = maps.is_valid().to_pylist()
            self._remapped = [bool(outer_valid[i]) and any(inner_valid[offsets[i]:offsets[i + 1]])
                              for i in range(len(maps))]
        return self._remapped

    def _maps(self, j: int) -> list[pa.Array | None]:
        scalar = self._ref_maps[j]
        inner = scalar.values if scalar.is_valid else None
        if inner is None or len(inner) == 0:
            return []
        return [m.values if m.is_valid else None for m in inner]

    def _table(self, offset: int, length: int, schema: pa.Schema, rows: int, what: str) -> pa.Table:
        try:
            table = pa.ipc.open_file(self._data.slice(offset, length)).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptRecord(self.path, offset, f"bad {what}: {exc}") from exc
        if not table.schema.equals(schema) or table.num_rows != rows:
            raise CorruptRecord(self.path, offset, f"bad {what}: schema or row count")
        return table

    def _check_streams(self) -> None:
        s = self._streams
        for sid in range(self.footer.stream_count):
            offset, length = s["byte_offset"][sid], s["byte_length"][sid]
            if (s["stream_id"][sid] != sid or offset % ALIGN
                    or offset + length > self.footer.directory_offset):
                raise CorruptRecord(self.path, self.footer.directory_offset,
                                    f"bad directory: stream {sid} at {offset}+{length}")

    def _load_manifest(self) -> None:
        # Arrival-order metadata as Python lists: one conversion per segment,
        # so per-bundle access is list indexing rather than Arrow scalar work.
        m = self.manifest
        self._clients: list[str] = m.column("client").to_pylist()
        self._ts: list[int] = m.column("ingestion_ts").to_pylist()
        self._sequences: list[int] = m.column("sequence").to_pylist()
        self._txns: list[dict[str, Any] | None] = m.column("txn").to_pylist()
        refs = m.column("slot_refs").combine_chunks()
        offsets = refs.offsets.to_pylist()
        self._ref_offsets = [o - offsets[0] for o in offsets]
        flat = refs.flatten()
        self._ref_slot: list[int] = flat.field("slot_id").to_pylist()
        self._ref_stream: list[int] = flat.field("stream_id").to_pylist()
        self._ref_chunk: list[int] = flat.field("chunk_index").to_pylist()
        self._ref_variant: list[int] = flat.field("schema_variant").to_pylist()
        self._ref_maps = flat.field("dictionary_maps")


def read_manifest(path: str | os.PathLike[str], *, full: bool = False
                  ) -> tuple[Footer, pa.Table, bool]:
    """The checked footer and batch manifest alone, what recovery needs of a segment:
    returns (footer, manifest, fully_checked). The stream directory is not parsed
    (version 2: the metadata CRC covers it; ``SegmentReader`` checks it when opened)."""
    name, source, data, footer = _map(path, full=full, prefetch=full)
    try:
        table = pa.ipc.open_file(data.slice(footer.manifest_offset,
                                            footer.manifest_length)).read_all()
        if not table.schema.equals(MANIFEST_SCHEMA) or table.num_rows != footer.bundle_count:
            raise CorruptRecord(name, footer.manifest_offset, "bad manifest: schema or row count")
        # The table views the map: it is unmapped once the caller drops the table.
        return footer, table, full or footer.version == VERSION_1
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptRecord(name, footer.manifest_offset, f"bad manifest: {exc}") from exc
    finally:
        _unmap(source)


def _map(path: str | os.PathLike[str], *, full: bool, prefetch: bool
         ) -> tuple[str, mmap.mmap, pa.Buffer, Footer]:
    """Map a segment file and check its footer (``parse_footer``)."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < MIN_FILE_LEN:  # mmap of an empty file fails; say what is wrong instead
            raise CorruptRecord(name, 0, f"truncated: {size} bytes, a segment needs "
                                f"{MIN_FILE_LEN}")
        source = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if prefetch:
            source.madvise(mmap.MADV_WILLNEED)
        else:
            _read_metadata_ahead(source)
        data = pa.py_buffer(source)
        return name, source, data, parse_footer(data, name, full=full)
    except BaseException:
        _unmap(source)
        raise


def _read_metadata_ahead(source: mmap.mmap) -> None:
    """Page in only the tail and the metadata region of a version 2 file.

    A fault on a mapped file reads ``read_ahead_kb`` around it (8 MiB on this
    machine's disk): MADV_RANDOM stops that, then one WILLNEED covers directory,
    manifest and footer. A file of another version is checked whole: WILLNEED on
    all of it. The offsets read here are only a hint; ``parse_footer`` checks them."""
    size = len(source)
    footer_size = int.from_bytes(source[size - TRAILER.size: size - TRAILER.size + 4], "little")
    footer_start = size - TRAILER.size - footer_size
    version = (int.from_bytes(source[footer_start: footer_start + 2], "little")
               if 0 <= footer_start <= size - FOOTER.size else None)
    if version != VERSION or footer_size != FOOTER.size:
        source.madvise(mmap.MADV_WILLNEED)
        return
    source.madvise(mmap.MADV_RANDOM)
    start = int.from_bytes(source[footer_start + 10: footer_start + 18], "little")
    if 0 <= start < size:
        start -= start % mmap.PAGESIZE
        source.madvise(mmap.MADV_WILLNEED, start, size - start)


def _unmap(source: mmap.mmap) -> None:
    """Unmap now, or (while Arrow buffers of it live on: tables handed to a subscriber)
    when the last of them is freed."""
    try:
        source.close()
    except BufferError:
        pass


def verify_segment(path: str | os.PathLike[str]) -> None:
    """Raise CorruptRecord unless the file passes every check, down to each chunk."""
    with SegmentReader.open(path) as reader:
        for sid in range(reader.footer.stream_count):
            stream = reader.stream_reader(sid)
            if stream.num_record_batches != reader.directory["chunk_count"][sid].as_py():
                raise CorruptRecord(reader.path, reader.directory["byte_offset"][sid].as_py(),
                                    f"stream {sid}: chunk count disagrees with the directory")
        for i in range(reader.footer.bundle_count):
            try:
                reader.bundle(i)
            except (pa.ArrowInvalid, pa.ArrowIndexError, IndexError) as exc:
                raise CorruptRecord(reader.path, reader.footer.manifest_offset,
                                    f"bundle {i}: {exc}") from exc


def describe_segment(path: str | os.PathLike[str]) -> dict[str, Any]:
    """JSON-ready summary for ``quiverd segment dump FILE --json``."""
    with SegmentReader.open(path) as reader:
        directory = reader.directory.drop_columns(["original_schemas"]).to_pylist()
        for row in directory:
            row["schema_fingerprint"] = row["schema_fingerprint"].hex()
        slots = sorted(set(reader.directory.column("slot_id").to_pylist()))
        txns = reader.manifest.column("txn").null_count
        stats = reader.stats()
        return {
            "path": reader.path,
            "footer": {k: getattr(reader.footer, k) for k in Footer.__slots__},
            "stats": {**stats, "slots": {str(k): v for k, v in stats["slots"].items()}},
            "directory": directory,
            "manifest": {
                "bundle_count": reader.footer.bundle_count,
                "clients": dict(Counter(reader.manifest.column("client").to_pylist())),
                "transactional_bundles": reader.footer.bundle_count - txns,
            },
            "representative_schemas": {
                str(slot): str(reader.representative_schema(slot)) for slot in slots
            },
        }
