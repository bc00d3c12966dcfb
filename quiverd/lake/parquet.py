"""Active Parquet files: append conformed tables as row groups, close with facts, name
files, read zone maps and bloom filter presence back from a footer.

File names (design doc 001; the node id joined them with issue 20, the client left: the
object key holds it):

    {timestamp}_{ulid}~{node_id}_{status}.parquet        written since issue 20
    {client}_{timestamp}_{ulid}_{status}.parquet         before: still parsed
     timestamp  YYYYMMDDTHHMMSS + 9 digits of ns + Z, UTC: 8 + 1 + 6 + 9 + 1 = 25 chars,
                fixed width, so names in one partition sort by time
     ulid       26 Crockford base32 chars         (the file_id)
     node_id    [A-Za-z0-9._-]{1,64}              (kernel.names.NODE_ID)
     client     [A-Za-z0-9._-]{1,255}             (kernel.names.CLIENT_NAME_RULE)
     status     active | stable

Neither a client name nor a node id may hold '~', so a name with one is of the new
grammar; in it the node id is what lies between '~' and the last '_' (node ids may hold
'_', the status may not). Names start with a digit: Spark and Hadoop skip files whose
names start with '_' or '.'.

Layout of one file, as pyarrow's writer lays it out with ``ParquetSettings``:

    "PAR1"
    row group 0 .. n          one ``append`` = one write_table call = one or more row
      column chunk per leaf     groups of at most ``row_group_rows`` rows
        dictionary page         Parquet's own dictionary encoding (drift.py decodes
        data pages              Arrow dictionaries), zstd at ``compression_level``,
                                each page with a CRC-32 page checksum
    bloom filters             one per configured column per row group, written at close
    page index                column index (min/max per page) + offset index per chunk
    footer (FileMetaData)     schema, row group statistics (the zone maps), key-value
                              metadata: ARROW:schema + quiverd's (node, source, client,
                              slot, file_id)
    footer length (4, LE)  "PAR1"

Nothing is read back (issue 30, "read back never"): the CRC-32C is taken over the
bytes as they go to the file (``_Checksummed``, under the writer's 1 MiB buffer, so one
CRC call per MiB), and the footer is the writer's own FileMetaData, serialized
(``FileFacts.footer``, byte for byte the file's footer) for the indexer's zone maps and
the Iceberg DataFile (``lake.footers`` hands it over).

``ActiveFile`` does blocking I/O (writes, fsync): callers run it in a worker thread.
Renaming Active -> Stable and fsyncing the directory is the caller's job.
"""

from __future__ import annotations

import io
import os
import re
import struct
import weakref
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from quiverd.kernel import fs
from quiverd.kernel.crc import crc32c
from quiverd.kernel.names import CLIENT_NAME_RULE, NODE_ID, node_id_problem
from quiverd.lake.drift import schema_hash
from quiverd.lake.model import ZoneMap
from quiverd.lake.verified import corrupt_error, is_damage, open_verified

Status = Literal["active", "stable"]
SUFFIX = ".parquet"
TIMESTAMP_LEN = 8 + 1 + 6 + 9 + 1  # YYYYMMDD T HHMMSS nnnnnnnnn Z
ULID_LEN = 26
# Bloom filters are sized for a fixed NDV because a file's rows are unknown when it
# opens. pyarrow 26 sizes each row group's filter for the distinct values it actually
# saw, capped at the NDV given (measured at fpp 0.05: 1 value -> 47 bytes, 100k ->
# 128 KiB, 1 Mi -> 1 MiB), so small files stay small and a row group keeps the asked
# fpp up to this many distinct values. A row group cannot hold more distinct values
# than rows, so ``create`` uses min(row_group_rows, BLOOM_NDV_MAX).
BLOOM_NDV_MAX = 1 << 20
_NAME = re.compile(
    rf"(?P<ts>\d{{8}}T\d{{15}}Z)_(?P<ulid>[0-9A-HJKMNP-TV-Z]{{{ULID_LEN}}})"
    rf"~(?P<node>{NODE_ID.pattern})_(?P<status>active|stable)\.parquet"
)
_OLD_NAME = re.compile(
    rf"(?P<client>{CLIENT_NAME_RULE})_(?P<ts>\d{{8}}T\d{{15}}Z)"
    rf"_(?P<ulid>[0-9A-HJKMNP-TV-Z]{{{ULID_LEN}}})_(?P<status>active|stable)\.parquet"
)
_NS_PER_UNIT = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
_DAY_MS = 86_400_000


class ParquetSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How every lake file is written (from ``LakeConfig`` and ``IndexConfig``)."""

    compression_level: int = 3  # zstd
    bloom_filter_columns: tuple[str, ...] = ()
    bloom_filter_fpp: float = 0.05
    row_group_rows: int = 1 << 20  # a cap per row group


class FileFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What ``ActiveFile.close`` knows about a finished file (catalog fields)."""

    rows: int
    uncompressed_size: int  # Arrow bytes appended
    compressed_size: int  # Parquet file bytes
    crc32c: int  # whole-file CRC-32C
    start_ts: int  # min of the time column, ns; 0 when the file holds no time value
    end_ts: int  # max of the time column, ns; 0 when the file holds no time value
    schema_hash: str
    indexes: tuple[str, ...]  # "zonemap", "bloom:<column>" for each filter written
    # The file's footer as the writer wrote it, in the form of a Parquet ``_metadata``
    # file ("PAR1" FileMetaData length "PAR1": ``footer_metadata`` reads it back).
    footer: bytes = b""


class ActiveFile:
    """One Parquet file being written: ``create``, ``append``..., then ``close`` or
    ``abort``. Not thread-safe: one worker thread at a time."""

    def __init__(self, path: Path, file: io.BufferedWriter, writer: pq.ParquetWriter,
                 schema: pa.Schema, settings: ParquetSettings, time_column: str) -> None:
        assert isinstance(file.raw, _Checksummed), "create() opens the file"
        self.path = path
        self._file = file
        self._sum: _Checksummed = file.raw
        self._writer = writer
        self._schema = schema
        self._settings = settings
        self._time_column = time_column
        self._rows = 0
        self._uncompressed_bytes = 0
        self._start_ts: int | None = None
        self._end_ts: int | None = None
        self._closed = False
        self._final_size = 0  # bytes_written once the handle is closed
        # A file nobody closed or aborted (the daemon's fatal exit) is left unfinished:
        # pyarrow's writer would write a footer from __del__, making it look whole, and
        # on a dead disk that write failed at exit with a traceback in the log.
        weakref.finalize(self, _discard, file, writer)

    @classmethod
    def create(cls, path: Path, schema: pa.Schema, settings: ParquetSettings, *,
               metadata: dict[str, str], time_column: str) -> ActiveFile:
        """Open a new file at ``path`` (never an existing one: FileExistsError) for tables
        of ``schema``; ``metadata`` goes to the footer's key-value metadata."""
        field = schema.field(time_column) if time_column in schema.names else None
        if field is None or not (pa.types.is_timestamp(field.type)
                                 or pa.types.is_integer(field.type)):
            raise ValueError(f"time column {time_column!r} must be a timestamp or integer "
                             f"column of the file schema")
        blooms = bloom_columns(schema, settings.bloom_filter_columns)
        ndv = min(settings.row_group_rows, BLOOM_NDV_MAX)
        # "xb": two writers racing for one name must not clobber each other's file.
        file = _checksummed(fs.create_binary(path))  # owned until close/abort
        try:
            writer = pq.ParquetWriter(
                file, schema.with_metadata(metadata), compression="zstd",
                compression_level=settings.compression_level, write_statistics=True,
                write_page_index=True, write_page_checksum=True, store_schema=True,
                bloom_filter_options={c: {"ndv": ndv, "fpp": settings.bloom_filter_fpp}
                                      for c in blooms} or None)
        except BaseException:
            file.close()
            fs.active().unlink(path, missing_ok=True)
            raise
        return cls(path, file, writer, schema, settings, time_column)

    def append(self, table: pa.Table) -> None:
        """Write ``table`` (already conformed to the file's schema) as row groups."""
        assert not self._closed, "append after close/abort"
        if table.num_rows == 0:
            return
        self._writer.write_table(table, row_group_size=self._settings.row_group_rows)
        self._rows += table.num_rows
        self._uncompressed_bytes += table.nbytes
        lo, hi = _time_range(table.column(self._time_column))
        if lo is not None and hi is not None:
            self._start_ts = lo if self._start_ts is None else min(self._start_ts, lo)
            self._end_ts = hi if self._end_ts is None else max(self._end_ts, hi)

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def uncompressed_bytes(self) -> int:
        return self._uncompressed_bytes

    @property
    def bytes_written(self) -> int:
        """The file's size so far: row groups written (the footer comes at close)."""
        return self._final_size if self._closed else self._file.tell()

    @property
    def start_ts(self) -> int | None:
        """Min of the time column in ns, None before the first non-null value."""
        return self._start_ts

    @property
    def end_ts(self) -> int | None:
        return self._end_ts

    def close(self) -> FileFacts:
        """Write the footer, fsync, and return the file's facts: its CRC-32C taken as it
        was written and its footer from the writer, neither read back from disk."""
        assert not self._closed, "close after close/abort"
        self._closed = True
        try:
            self._writer.close()
            fs.fsync_file(self._file)
            on_disk = os.fstat(self._file.fileno()).st_size
        finally:
            self._file.close()
        # Every byte passed through the checksum: a write that bypassed it (or a seek
        # back) would leave the sums of a different file.
        assert self._sum.size == on_disk, (self._sum.size, on_disk)
        self._final_size = on_disk
        meta = self._writer.writer.metadata
        assert meta.num_rows == self._rows, (meta.num_rows, self._rows)
        blooms = [c for c in bloom_columns(self._schema, self._settings.bloom_filter_columns)
                  if _has_bloom(meta, c)]
        return FileFacts(
            rows=self._rows, uncompressed_size=self._uncompressed_bytes,
            compressed_size=self._final_size, crc32c=self._sum.crc,
            start_ts=self._start_ts or 0, end_ts=self._end_ts or 0,
            schema_hash=schema_hash(self._schema),
            indexes=("zonemap", *(f"bloom:{c}" for c in blooms)),
            footer=footer_bytes(meta))

    def abort(self) -> None:
        """Close the handle and delete the file (no footer). Safe after close or abort."""
        if not self._closed:
            self._closed = True
            # Disarm the writer: its __del__ would otherwise write a footer into the
            # closed handle. The C++ writer is dropped with the Python object.
            self._writer.is_open = False
            try:
                self._file.close()  # flushes buffered bytes: may find the disk full
            except OSError:
                pass  # the file is being thrown away; its bytes do not matter
        fs.active().unlink(self.path, missing_ok=True)


class _Checksummed(io.RawIOBase):
    """The raw file under the writer's buffer, summing every byte written to it: the
    buffer hands it 1 MiB at a time, so the CRC costs one call (GIL released,
    ``kernel.crc``) per MiB. Parquet files are written front to back, never rewritten,
    so the running CRC is the file's."""

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__()
        self._raw = raw
        self.crc = 0
        self.size = 0  # bytes written

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True  # position queries only (BufferedWriter.tell)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def write(self, b: Any, /) -> int:  # any buffer (3.12's collections.abc.Buffer)
        n = self._raw.write(b)
        assert n is not None, "the file is blocking"
        # A short write sums what was written: the buffer passes the rest again.
        self.crc = crc32c(memoryview(b).cast("B")[:n], self.crc)
        self.size += n
        return n

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                self._raw.close()
            finally:
                super().close()


def _checksummed(file: io.BufferedWriter, buffer_size: int = 1 << 20) -> io.BufferedWriter:
    """``file`` (from ``fs.create_binary``, nothing written yet) with its raw file summed."""
    raw = file.detach()
    assert isinstance(raw, io.RawIOBase), raw
    return io.BufferedWriter(_Checksummed(raw), buffer_size=buffer_size)


def footer_bytes(meta: pq.FileMetaData) -> bytes:
    """A footer as a Parquet ``_metadata`` file: "PAR1" + FileMetaData + its length + "PAR1"
    (the FileMetaData part is byte for byte the one at the end of the file)."""
    out = pa.BufferOutputStream()
    meta.write_metadata_file(out)
    return out.getvalue().to_pybytes()


def footer_metadata(footer: bytes) -> pq.FileMetaData:
    """The FileMetaData of ``footer_bytes`` read back (in memory)."""
    return pq.read_metadata(pa.BufferReader(footer))


def _discard(file: io.BufferedWriter, writer: pq.ParquetWriter) -> None:
    """Release an unclosed Active file's handle without a footer (collection or exit).
    The handle goes first: the C++ writer's destructor then writes into a closed file."""
    try:
        file.close()
    except OSError:
        pass  # a dead or full disk: the unfinished file is abandoned on restart anyway
    writer.is_open = False


def bloom_columns(schema: pa.Schema, wanted: tuple[str, ...]) -> list[str]:
    """The configured bloom filter columns this schema has as flat (leaf) columns."""
    return [c for c in dict.fromkeys(wanted)
            if c in schema.names and not pa.types.is_nested(schema.field(c).type)]


class FileName(NamedTuple):
    """A lake file name read back: ``node_id`` set for the current grammar, ``client``
    for names written before issue 20."""

    ts: str
    ulid: str
    status: str
    node_id: str | None
    client: str | None


def file_name(node_id: str, ts_ns: int, file_id: str, status: Status) -> str:
    """``{timestamp}_{ulid}~{node_id}_{status}.parquet`` for a file node ``node_id``
    opened at ``ts_ns``."""
    problem = node_id_problem(node_id)
    if problem is not None:
        raise ValueError(problem)
    assert ts_ns >= 0 and status in ("active", "stable"), (ts_ns, status)
    seconds, ns = divmod(ts_ns, 10**9)
    stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y%m%dT%H%M%S") + f"{ns:09d}Z"
    assert len(stamp) == TIMESTAMP_LEN, f"year out of range: {stamp}"
    name = f"{stamp}_{file_id}~{node_id}_{status}{SUFFIX}"
    assert parse_file_name(name) is not None, f"not a lake file name: {name!r}"
    return name


def parse_file_name(name: str) -> FileName | None:
    """A lake file name (either grammar) read back; None for other names."""
    m = _NAME.fullmatch(name)
    if m is not None:
        return FileName(m["ts"], m["ulid"], m["status"], m["node"], None)
    m = _OLD_NAME.fullmatch(name)
    if m is not None:
        return FileName(m["ts"], m["ulid"], m["status"], None, m["client"])
    return None


def crc32c_file(path: Path, chunk_bytes: int = 8 << 20) -> int:
    """Whole-file CRC-32C, read in chunks of ``chunk_bytes``."""
    crc = 0
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32c(view[:n], crc)
    return crc


def has_bloom_filter(path: Path, column: str) -> bool:
    """True when every row group of the file has a bloom filter for ``column``."""
    return _has_bloom(pq.read_metadata(path), column)


def _has_bloom(meta: pq.FileMetaData, column: str) -> bool:
    leaf = _leaf_index(meta.schema, column)
    if leaf is None or meta.num_row_groups == 0:
        return False
    return all(meta.row_group(i).column(leaf).bloom_filter_offset is not None
               for i in range(meta.num_row_groups))


def _leaf_index(schema: pq.ParquetSchema, column: str) -> int | None:
    """The Parquet leaf column of a flat top-level ``column``, None if there is none."""
    for j in range(len(schema)):
        if schema.column(j).path == column:
            return j
    return None


def _time_range(column: pa.ChunkedArray) -> tuple[int | None, int | None]:
    """Min and max of a timestamp or integer column, in ns (None when all null)."""
    bounds = pc.min_max(column)
    lo, hi = bounds["min"], bounds["max"]
    if not lo.is_valid:
        return None, None
    if pa.types.is_timestamp(column.type):
        factor = _NS_PER_UNIT[column.type.unit]
        return lo.value * factor, hi.value * factor
    return lo.as_py(), hi.as_py()


# ---- zone maps -------------------------------------------------------------------------

ZoneValue = int | float | str | bool | None
_Native = int | float | str | bool | Decimal


def zone_maps(path: Path, columns: list[str], footer: bytes = b"") -> list[ZoneMap]:
    """Min/max/null count of each requested flat column the file has, combined over its
    row groups from the footer statistics (computed from the data when a row group has
    none). Values are JSON scalars: timestamps and times as ns ints, dates as day ints,
    decimals as str; binary columns are skipped (no JSON form that keeps their order).

    ``footer`` (``FileFacts.footer``) is the file's footer as the writer gave it: then
    the file is opened only for a column whose statistics are missing."""
    pf = None if footer else open_verified(path, file_id="", uri=path.as_uri())
    meta = footer_metadata(footer) if pf is None else pf.metadata
    arrow = meta.schema.to_arrow_schema()  # what ParquetFile.schema_arrow gives
    out: list[ZoneMap] = []
    for name in dict.fromkeys(columns):
        if name not in arrow.names:
            continue
        kind = _kind(arrow.field(name).type)
        leaf = _leaf_index(meta.schema, name)
        if kind is None or leaf is None:
            continue
        if kind == "null":
            out.append(ZoneMap(column=name, min_value=None, max_value=None,
                               null_count=meta.num_rows))
            continue
        bounds = _from_statistics(meta, leaf, kind, arrow.field(name).type)
        if bounds is None:
            if pf is None:
                pf = open_verified(path, file_id="", uri=path.as_uri())
            bounds = _from_data(pf, name, kind, path)
        lo, hi, nulls = bounds
        out.append(ZoneMap(column=name, min_value=_json(lo), max_value=_json(hi),
                           null_count=nulls))
    return out


def _kind(t: pa.DataType) -> str | None:
    """How a column's values become zone map values; None for columns without zone maps."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    for kind, test in (("null", pa.types.is_null), ("timestamp", pa.types.is_timestamp),
                       ("date", pa.types.is_date), ("time", pa.types.is_time),
                       ("duration", pa.types.is_duration), ("decimal", pa.types.is_decimal),
                       ("float16", pa.types.is_float16), ("number", pa.types.is_integer),
                       ("number", pa.types.is_floating), ("bool", pa.types.is_boolean),
                       ("string", pa.types.is_string), ("string", pa.types.is_large_string)):
        if test(t):
            return kind
    return None


def _from_statistics(meta: pq.FileMetaData, leaf: int, kind: str, arrow_type: pa.DataType
                     ) -> tuple[_Native | None, _Native | None, int] | None:
    """Bounds from the footer, None when a row group lacks usable statistics."""
    lows: list[_Native] = []
    highs: list[_Native] = []
    nulls = 0
    for i in range(meta.num_row_groups):
        chunk = meta.row_group(i).column(leaf)
        stats = chunk.statistics if chunk.is_stats_set else None
        if stats is None or not stats.has_null_count or chunk.physical_type == "INT96":
            return None
        nulls += stats.null_count
        if stats.num_values == 0:
            continue  # all null in this row group
        if not stats.has_min_max:
            return None  # e.g. values too long for statistics: compute them
        lows.append(_stat_value(stats, "min", kind, arrow_type))
        highs.append(_stat_value(stats, "max", kind, arrow_type))
    if not lows:
        return None, None, nulls
    return min(lows), max(highs), nulls


def _stat_value(stats: pq.Statistics, bound: Literal["min", "max"], kind: str,
                arrow_type: pa.DataType) -> _Native:
    """One footer statistic as a comparable Python value, in zone map units. Temporal
    kinds use the raw value: pyarrow's converted one cannot hold nanoseconds."""
    raw = stats.min_raw if bound == "min" else stats.max_raw
    if kind in ("timestamp", "time"):
        # The file's unit, not the Arrow one: Parquet stores timestamp[s] as ms.
        unit = _json_unit(stats.logical_type.to_json())
        assert isinstance(raw, int)
        return raw * unit
    if kind == "date":
        assert isinstance(raw, int)
        return raw  # Parquet stores date32 and date64 as int32 days
    if kind == "duration":
        assert isinstance(raw, int)
        return raw * _NS_PER_UNIT[arrow_type.unit]
    value = stats.min if bound == "min" else stats.max
    if kind == "float16":
        if isinstance(value, bytes):
            return float(struct.unpack("<e", value)[0])
        assert isinstance(value, float)
        return value
    if kind == "string" and isinstance(value, bytes):
        return value.decode()
    assert isinstance(value, int | float | str | bool | Decimal), (kind, value)
    return value


def _json_unit(logical: str) -> int:
    """ns per unit of a Parquet TIMESTAMP/TIME logical type given as pyarrow's JSON."""
    unit = msgspec.json.decode(logical).get("timeUnit", "")
    return {"milliseconds": 10**6, "microseconds": 10**3, "nanoseconds": 1}[unit]


def _from_data(pf: pq.ParquetFile, name: str, kind: str, path: Path
               ) -> tuple[_Native | None, _Native | None, int]:
    """Bounds computed from the column itself (only that column is read)."""
    try:
        column = pf.read(columns=[name]).column(name)
    except (OSError, pa.ArrowInvalid) as exc:
        if not is_damage(exc):
            raise
        raise corrupt_error(exc, file_id="", uri=path.as_uri()) from exc
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    t = column.type
    scale, divide = 1, 1
    if kind in ("timestamp", "time", "duration", "date"):
        # min_max has no duration kernel, and temporal scalars cannot hold ns as Python
        # objects: work on the stored integers and convert units after.
        if pa.types.is_date64(t):
            divide = _DAY_MS
        elif kind != "date":
            scale = _NS_PER_UNIT[t.unit]
        column = column.cast(pa.int64() if t.bit_width == 64 else pa.int32())
    elif kind == "float16":
        column = column.cast(pa.float32())  # min_max has no float16 kernel
    bounds = pc.min_max(column)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if lo is not None and kind in ("timestamp", "time", "duration", "date"):
        lo, hi = lo * scale // divide, hi * scale // divide
    assert isinstance(lo, _Native | None) and isinstance(hi, _Native | None), (kind, lo, hi)
    return lo, hi, column.null_count


def _json(value: _Native | None) -> ZoneValue:
    return str(value) if isinstance(value, Decimal) else value
