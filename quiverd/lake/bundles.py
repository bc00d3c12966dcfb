"""What the uploader makes of a delivered bundle's slot: rows with its id, in a file.

Every row gets four columns, so the slots of one bundle (one file per slot) rejoin:

    _quiver_ingested_at  timestamp[us, UTC]  the bundle's ingestion time (ns // 1000)
    _quiver_shard        int32               ┐
    _quiver_segment      int64               ├ the bundle id (SPEC §5)
    _quiver_bundle       int64               ┘

Types every engine reads as they are (Spark, Iceberg, DuckDB): signed ints wide enough
for the id's range (a shard fits 16 bits, a bundle index 32, a segment seq 63: the
catalog stores it as a signed 64-bit int too; a seq of 2**63 or more is refused with
ValueError, never wrapped), microseconds for the time. Files written before issue 20
hold the *legacy* types (timestamp[ns, UTC], uint16, uint64, uint32): ``as_current``
names their columns with the current types, and the Spark reader casts their values to
it (the ingestion time truncated to microseconds, the ids exactly), so a read presents
one schema across old and new files. Compaction never takes an old file.

Ingest refuses producer columns with the ``_quiver_`` prefix (SPEC §1); in a bundle
stored before that rule, a producer column of the same name wins (it is left as sent).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa

from quiverd.kernel import fs
from quiverd.kernel.durable import fsync_dir
from quiverd.lake.model import (
    BUNDLE_COLUMN,
    INGESTED_AT,
    SEGMENT_COLUMN,
    SHARD_COLUMN,
    Coverage,
)
from quiverd.lake.parquet import ActiveFile, FileFacts

EXTRA_FIELDS = (pa.field(INGESTED_AT, pa.timestamp("us", tz="UTC")),
                pa.field(SHARD_COLUMN, pa.int32()),
                pa.field(SEGMENT_COLUMN, pa.int64()),
                pa.field(BUNDLE_COLUMN, pa.int64()))
EXTRA_NAMES = frozenset(f.name for f in EXTRA_FIELDS)
# The same columns in files written before issue 20 (SPEC §6, "Lake file columns").
LEGACY_TYPES = {INGESTED_AT: pa.timestamp("ns", tz="UTC"), SHARD_COLUMN: pa.uint16(),
                SEGMENT_COLUMN: pa.uint64(), BUNDLE_COLUMN: pa.uint32()}
MAX_SEGMENT_SEQ = 2**63 - 1  # int64's largest: the column's and the catalog's
NS_PER_US = 1000


def with_extras(schema: pa.Schema) -> pa.Schema:
    """A slot's schema plus the bundle columns it does not already have."""
    names = set(schema.names)
    return pa.schema([*schema, *(x for x in EXTRA_FIELDS if x.name not in names)])


def slot_table(table: pa.Table, *, shard: int, segment_seq: int, bundle_index: int,
               ingestion_ts_ns: int) -> pa.Table:
    """One slot's table with the bundle columns added (worker thread)."""
    _check_segment_seqs([segment_seq])
    n = table.num_rows
    for field, value in zip(EXTRA_FIELDS, (ingestion_ts_ns // NS_PER_US, shard, segment_seq,
                                           bundle_index), strict=True):
        if table.schema.get_field_index(field.name) < 0:
            table = table.append_column(field, _constant(value, n, field.type))
    return table


def with_bundle_columns(table: pa.Table, rows: list[int], *, shard: int,
                        segment_seqs: list[int], bundle_indexes: list[int],
                        ingestion_ts_ns: list[int]) -> pa.Table:
    """Many bundles' slots concatenated (``rows[k]`` rows of the k-th, one schema
    without any bundle column) with the bundle columns added for all of them at once:
    a few numpy repeats per row group instead of four arrays per bundle."""
    _check_segment_seqs(segment_seqs)
    counts = np.asarray(rows, dtype=np.int64)
    micros = np.asarray(ingestion_ts_ns, dtype=np.int64) // NS_PER_US
    columns: dict[str, np.ndarray] = {
        INGESTED_AT: np.repeat(micros, counts),
        SHARD_COLUMN: np.full(int(counts.sum()), shard, dtype=np.int32),
        SEGMENT_COLUMN: np.repeat(np.asarray(segment_seqs, dtype=np.int64), counts),
        BUNDLE_COLUMN: np.repeat(np.asarray(bundle_indexes, dtype=np.int64), counts),
    }
    for field in EXTRA_FIELDS:
        values = columns[field.name]
        table = table.append_column(field, pa.Array.from_buffers(
            field.type, len(values), [None, pa.py_buffer(values)]))
    return table


def _constant(value: int, n: int, type_: pa.DataType) -> pa.Array:
    """``n`` copies of ``value`` as a ``type_`` array, built from one numpy buffer.
    Not ``fill_null`` or ``pa.array``: their first call imports pandas (~0.4 s of CPU,
    measured in the uploader's first row group), and they take three kernels a column."""
    values = np.full(n, value, dtype=_STORAGE[type_.id])
    return pa.Array.from_buffers(type_, n, [None, pa.py_buffer(values)])


# numpy storage of the bundle columns' types (timestamp[us] is an int64 array).
_STORAGE = {pa.timestamp("us").id: np.int64, pa.int32().id: np.int32,
            pa.int64().id: np.int64}


def _check_segment_seqs(segment_seqs: list[int]) -> None:
    """Refuse a segment seq the int64 column cannot hold (never reached: seqs count
    segments from 1), rather than let numpy raise OverflowError or wrap it."""
    if segment_seqs and not 0 <= max(segment_seqs) <= MAX_SEGMENT_SEQ:
        raise ValueError(f"segment seq {max(segment_seqs)} does not fit the lake's int64 "
                         f"{SEGMENT_COLUMN} column (at most {MAX_SEGMENT_SEQ})")


def as_current(schema: pa.Schema) -> pa.Schema:
    """``schema`` with quiverd's columns of the legacy types (a file from before issue
    20) named with the current ones; every other column as it is."""
    if not any(schema.get_field_index(n) >= 0 for n in LEGACY_TYPES):
        return schema
    current = {f.name: f for f in EXTRA_FIELDS}
    return pa.schema([current[f.name] if LEGACY_TYPES.get(f.name) == f.type else f
                      for f in schema], metadata=schema.metadata)


def time_column_of(schema: pa.Schema, wanted: str) -> str:
    """The column a file's time range is taken from: ``wanted`` (``lake.time_column``)
    when the file has it as a timestamp or integer, else the ingestion time."""
    i = schema.get_field_index(wanted or INGESTED_AT)
    kind = schema.field(i).type if i >= 0 else None
    if kind is None or not (pa.types.is_timestamp(kind) or pa.types.is_integer(kind)):
        return INGESTED_AT  # absent here, or not a time: ingestion time
    return wanted or INGESTED_AT


class CoverageCache:
    """Which bundles of a segment registered files already hold, per slot: asked of the
    catalog once per (shard, segment), the ``limit`` most recent kept, and kept true
    after each registration (a crash between registering and acking redelivers)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: OrderedDict[tuple[int, int], dict[int, set[int]]] = OrderedDict()

    def get(self, shard: int, segment_seq: int) -> dict[int, set[int]] | None:
        found = self.entries.get((shard, segment_seq))
        if found is not None:
            self.entries.move_to_end((shard, segment_seq))
        return found

    def put(self, shard: int, segment_seq: int, covered: dict[int, set[int]]) -> None:
        self.entries[(shard, segment_seq)] = covered
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def remember(self, shard: int, slot: int, bundles: list[tuple[int, int]]) -> None:
        """A file of ``slot`` holding ``bundles`` (segment_seq, index) was registered."""
        for seg, idx in bundles:
            cached = self.entries.get((shard, seg))
            if cached is not None:
                cached.setdefault(slot, set()).add(idx)


def close_to_stable(active: ActiveFile, active_path: Path, stable: Path) -> FileFacts:
    """Footer, fsync, rename Active -> Stable, fsync the directories (worker thread)."""
    facts = active.close()
    fs.active().rename(active_path, stable)
    fsync_dir(stable.parent)
    fsync_dir(active_path.parent)
    return facts


def coverage(bundles: list[tuple[int, int]]) -> list[Coverage]:
    by_segment: dict[int, set[int]] = {}
    for seg, idx in bundles:
        by_segment.setdefault(seg, set()).add(idx)
    return [Coverage(segment_seq=seg, bundle_indexes=tuple(sorted(idxs)))
            for seg, idxs in sorted(by_segment.items())]
