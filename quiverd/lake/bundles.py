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

from pathlib import Path

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


def _constant(value: int, n: int, type_: pa.DataType) -> pa.Array:
    return pa.nulls(n, pa.int64()).fill_null(value).cast(type_)


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
