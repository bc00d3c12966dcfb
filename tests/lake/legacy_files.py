"""Lake files of the format before issue 20, written by hand: ``_quiver_ingested_at``
timestamp[ns, UTC], ``_quiver_shard`` uint16, ``_quiver_segment`` uint64,
``_quiver_bundle`` uint32. Written, uploaded and registered as the uploader of that
time did (real ActiveFile, put_file, register), so readers and compaction meet them as
they meet the files a lake holds after an upgrade."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import anyio
import pyarrow as pa
from ulid import ULID

from quiverd.lake.bundles import LEGACY_TYPES
from quiverd.lake.drift import conform, normalize
from quiverd.lake.model import (
    BUNDLE_COLUMN,
    INGESTED_AT,
    SEGMENT_COLUMN,
    SHARD_COLUMN,
    Coverage,
    FileRow,
    FileState,
)
from quiverd.lake.parquet import ActiveFile, FileFacts, ParquetSettings, parse_file_name
from quiverd.lake.tier import Tier

LEGACY_FIELDS = [pa.field(name, t) for name, t in LEGACY_TYPES.items()]


def legacy_table(table: pa.Table, *, ts_ns: int, segment: int, bundle: int,
                 shard: int = 0) -> pa.Table:
    """``table`` plus the four bundle columns of the old format."""
    n = table.num_rows
    values = {INGESTED_AT: ts_ns, SHARD_COLUMN: shard, SEGMENT_COLUMN: segment,
              BUNDLE_COLUMN: bundle}
    for f in LEGACY_FIELDS:
        table = table.append_column(f, pa.array([values[f.name]] * n, f.type))
    return table


def legacy_name(client: str, ts_ns: int, file_id: str, status: str) -> str:
    """The old file name ``{client}_{timestamp}_{ulid}_{status}.parquet`` (still parsed)."""
    seconds, ns = divmod(ts_ns, 10**9)
    stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y%m%dT%H%M%S") + f"{ns:09d}Z"
    name = f"{client}_{stamp}_{file_id}_{status}.parquet"
    assert parse_file_name(name) is not None, name
    return name


async def add_legacy_file(tier: Tier, table: pa.Table, *, client: str = "app",
                          slot: int = 0, segment: int, bundle: int = 0,
                          ts_ns: int) -> FileRow:
    """Write, upload and register one old-format lake file; its catalog row."""
    file_id = str(ULID())
    full = legacy_table(table, ts_ns=ts_ns, segment=segment, bundle=bundle)
    schema = normalize(full.schema)
    active = tier.data.staging_active / legacy_name(client, ts_ns, file_id, "active")
    stable = tier.data.staging_stable / legacy_name(client, ts_ns, file_id, "stable")

    def write() -> FileFacts:
        f = ActiveFile.create(active, schema, ParquetSettings(),
                              metadata={"quiver.file_id": file_id}, time_column=INGESTED_AT)
        f.append(conform(full, schema))
        facts = f.close()
        active.rename(stable)
        return facts

    facts = await anyio.to_thread.run_sync(write)
    key = f"client={client}/slot={slot}/{tier.node_id}/{stable.name}"  # the old layout
    await tier.store.put_file(key, stable, size=facts.compressed_size, crc32c=facts.crc32c)
    row = FileRow(
        file_id=file_id, client_name=client, uri=tier.store.uri(key), start_ts=facts.start_ts,
        end_ts=facts.end_ts, row_count=facts.rows, uncompressed_size=facts.uncompressed_size,
        compressed_size=facts.compressed_size, schema_hash=facts.schema_hash,
        uploaded_at=time.time_ns(), node_id=tier.node_id, source_id=tier.source_id, shard=0,
        slot=slot, object_key=key, first_segment=segment, first_bundle=bundle,
        last_segment=segment, last_bundle=bundle, bundle_count=1, crc32c=facts.crc32c,
        state=FileState.META_REGISTERED, local_path=str(stable), created_at=ts_ns,
        updated_at=ts_ns)
    await tier.catalog.register(row, [Coverage(segment_seq=segment, bundle_indexes=(bundle,))])
    return row
