"""Helpers for lake tests: a Tier on a temp directory, files registered as the uploader
registers them (real ActiveFile, put_file, register)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pyarrow as pa
from ulid import ULID

from quiverd.kernel import logs
from quiverd.kernel.config import (
    CatalogConfig,
    CompactionConfig,
    Config,
    JanitorConfig,
    LakeConfig,
    StoreConfig,
)
from quiverd.kernel.layout import DataDir
from quiverd.lake.bundles import EXTRA_FIELDS
from quiverd.lake.catalog import open_catalog
from quiverd.lake.drift import conform, normalize
from quiverd.lake.model import INGESTED_AT, Coverage, FileRow, FileState
from quiverd.lake.parquet import ActiveFile, FileFacts, ParquetSettings, file_name
from quiverd.lake.partitions import hour_of_ns
from quiverd.lake.store import open_store
from quiverd.lake.tier import Tier

LOG = logs.get("test")
NS = 1_000_000_000
GRACE_S = 3600
DELETE_GRACE_S = 600


@asynccontextmanager
async def open_test_tier(root: Path, *, store: StoreConfig | None = None, dsn: str = "",
                         node_id: str = "n1", source_id: str | None = None,
                         **lake: object) -> AsyncIterator[Tier]:
    """A Tier as open_tier builds it, on ``root``, with lake settings overridden."""
    settings: dict[str, object] = {
        "janitor": JanitorConfig(grace_s=GRACE_S),
        "compaction": CompactionConfig(delete_grace_s=DELETE_GRACE_S, min_files=2),
        "store": store or StoreConfig(), **lake}
    cfg = Config(data_dir=str(root), lake=LakeConfig(**settings),  # type: ignore[arg-type]
                 catalog=CatalogConfig(dsn=dsn))
    data = DataDir(root)
    for d in (data.staging_active, data.staging_stable):
        d.mkdir(parents=True, exist_ok=True)
    catalog = open_catalog(cfg.catalog, data.catalog_db, log=LOG)
    object_store = open_store(cfg.lake.store, data_dir=root, log=LOG)
    await catalog.start()
    try:
        yield Tier(cfg=cfg, data=data, store=object_store, catalog=catalog, node_id=node_id,
                   source_id=source_id or str(ULID()), log=LOG)
    finally:
        await catalog.close()
        await object_store.close()


def with_extras(table: pa.Table, *, ts_ns: int, segment: int, bundle: int) -> pa.Table:
    """``table`` plus the uploader's four bundle columns (one bundle per file)."""
    n = table.num_rows
    values = {INGESTED_AT: [ts_ns // 1000] * n, "_quiver_shard": [0] * n,  # us
              "_quiver_segment": [segment] * n, "_quiver_bundle": [bundle] * n}
    for f in EXTRA_FIELDS:
        table = table.append_column(f, pa.array(values[f.name], f.type))
    return table


async def add_file(tier: Tier, table: pa.Table, *, client: str = "app", slot: int = 0,
                   segment: int, bundle: int = 0, ts_ns: int | None = None,
                   keep_local: bool = True) -> FileRow:
    """Write, upload and register one lake file as the uploader would; its row."""
    ts_ns = time.time_ns() if ts_ns is None else ts_ns
    file_id = str(ULID())
    full = with_extras(table, ts_ns=ts_ns, segment=segment, bundle=bundle)
    schema = normalize(full.schema)
    active = tier.data.staging_active / file_name(tier.node_id, ts_ns, file_id, "active")
    stable = tier.data.staging_stable / file_name(tier.node_id, ts_ns, file_id, "stable")

    def write() -> FileFacts:
        f = ActiveFile.create(active, schema, ParquetSettings(), metadata={
            "quiver.file_id": file_id}, time_column=INGESTED_AT)
        f.append(conform(full, schema))
        facts = f.close()
        active.rename(stable)
        return facts

    facts = await anyio.to_thread.run_sync(write)
    key = tier.object_key(client, slot, stable.name, hour_of_ns(ts_ns))
    await tier.store.put_file(key, stable, size=facts.compressed_size,
                              crc32c=facts.crc32c)
    if not keep_local:
        stable.unlink()
    row = FileRow(
        file_id=file_id, client_name=client, uri=tier.store.uri(key), start_ts=facts.start_ts,
        end_ts=facts.end_ts, row_count=facts.rows,
        uncompressed_size=facts.uncompressed_size,
        compressed_size=facts.compressed_size, schema_hash=facts.schema_hash,
        uploaded_at=time.time_ns(), node_id=tier.node_id, source_id=tier.source_id, shard=0,
        slot=slot, object_key=key, first_segment=segment, first_bundle=bundle,
        last_segment=segment, last_bundle=bundle, bundle_count=1,
        crc32c=facts.crc32c, state=FileState.META_REGISTERED,
        local_path=str(stable) if keep_local else "", created_at=ts_ns, updated_at=ts_ns)
    await tier.catalog.register(row, [Coverage(segment_seq=segment, bundle_indexes=(bundle,))])
    return row
