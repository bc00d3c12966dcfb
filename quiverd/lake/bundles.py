"""What the uploader makes of a delivered bundle's slot: rows with its id, in a file.

Every row gets four columns, so the slots of one bundle (one file per slot) rejoin:

    _quiver_ingested_at  timestamp[ns, UTC]  the bundle's ingestion time
    _quiver_shard        uint16              ┐
    _quiver_segment      uint64              ├ the bundle id (SPEC §5)
    _quiver_bundle       uint32              ┘

Ingest refuses producer columns with the ``_quiver_`` prefix (SPEC §1); in a bundle
stored before that rule, a producer column of the same name wins (it is left as sent).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa

from quiverd.kernel.durable import fsync_dir
from quiverd.lake.model import (
    BUNDLE_COLUMN,
    INGESTED_AT,
    SEGMENT_COLUMN,
    SHARD_COLUMN,
    Coverage,
)
from quiverd.lake.parquet import ActiveFile, FileFacts

EXTRA_FIELDS = (pa.field(INGESTED_AT, pa.timestamp("ns", tz="UTC")),
                pa.field(SHARD_COLUMN, pa.uint16()),
                pa.field(SEGMENT_COLUMN, pa.uint64()),
                pa.field(BUNDLE_COLUMN, pa.uint32()))
EXTRA_NAMES = frozenset(f.name for f in EXTRA_FIELDS)


def with_extras(schema: pa.Schema) -> pa.Schema:
    """A slot's schema plus the bundle columns it does not already have."""
    names = set(schema.names)
    return pa.schema([*schema, *(x for x in EXTRA_FIELDS if x.name not in names)])


def slot_table(table: pa.Table, *, shard: int, segment_seq: int, bundle_index: int,
               ingestion_ts_ns: int) -> pa.Table:
    """One slot's table with the bundle columns added (worker thread)."""
    n = table.num_rows
    columns = {
        INGESTED_AT: _constant(ingestion_ts_ns, n, pa.timestamp("ns", tz="UTC")),
        SHARD_COLUMN: _constant(shard, n, pa.uint16()),
        SEGMENT_COLUMN: _constant(segment_seq, n, pa.uint64()),
        BUNDLE_COLUMN: _constant(bundle_index, n, pa.uint32()),
    }
    for name, column in columns.items():
        if table.schema.get_field_index(name) < 0:
            table = table.append_column(name, column)
    return table


def with_bundle_columns(table: pa.Table, rows: list[int], *, shard: int,
                        segment_seqs: list[int], bundle_indexes: list[int],
                        ingestion_ts_ns: list[int]) -> pa.Table:
    """Many bundles' slots concatenated (``rows[k]`` rows of the k-th, one schema
    without any bundle column) with the bundle columns added for all of them at once:
    a few numpy repeats per row group instead of four arrays per bundle."""
    counts = np.asarray(rows, dtype=np.int64)
    columns: dict[str, np.ndarray] = {
        INGESTED_AT: np.repeat(np.asarray(ingestion_ts_ns, dtype=np.int64), counts),
        SHARD_COLUMN: np.full(int(counts.sum()), shard, dtype=np.uint16),
        SEGMENT_COLUMN: np.repeat(np.asarray(segment_seqs, dtype=np.uint64), counts),
        BUNDLE_COLUMN: np.repeat(np.asarray(bundle_indexes, dtype=np.uint32), counts),
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


# numpy storage of the bundle columns' types (timestamp[ns] is an int64 array).
_STORAGE = {pa.timestamp("ns").id: np.int64, pa.uint16().id: np.uint16,
            pa.uint32().id: np.uint32, pa.uint64().id: np.uint64}


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
    active_path.rename(stable)
    fsync_dir(stable.parent)
    fsync_dir(active_path.parent)
    return facts


def coverage(bundles: list[tuple[int, int]]) -> list[Coverage]:
    by_segment: dict[int, set[int]] = {}
    for seg, idx in bundles:
        by_segment.setdefault(seg, set()).add(idx)
    return [Coverage(segment_seq=seg, bundle_indexes=tuple(sorted(idxs)))
            for seg, idxs in sorted(by_segment.items())]
