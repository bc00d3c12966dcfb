"""Indexer: registered lake files in, zone maps in the catalog and local eviction out.

    catalog ──file_id (NOTIFY quiver_files / in-process event)──▶ indexer
        ├─ zone maps (min/max/null count of the time column and lake.index.zone_map_columns)
        │  from the Parquet footer, recorded in the catalog; state Indexed. The footer is
        │  the writer's (lake.footers, handed over by the uploader) when this daemon
        │  still holds it, else read from the local copy (a restart, a compaction)
        └─ eviction: the local Stable copy is deleted (lake.delete_after_upload) or kept
           lake.local_retention_s; state Evicted. The object stays authoritative.

Bloom filters for ``lake.index.bloom_filter_columns`` are written into the Parquet
file by the uploader (a Parquet file cannot gain them after its footer is written);
the indexer lists them in the row's ``indexes``. Only this node's files (same source
id) are indexed here: the file is still on local disk, and another node indexes its
own. A periodic scan catches what a notification missed (a restart, a dropped
PostgreSQL connection).
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from quiverd.kernel import fs
from quiverd.kernel.errors import CatalogUnavailable, LakeError
from quiverd.kernel.faults import Hook
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.catalog import StateConflict
from quiverd.lake.footers import Footers
from quiverd.lake.model import INGESTED_AT, FileRow, FileState
from quiverd.lake.parquet import zone_maps
from quiverd.lake.tier import Tier

SCAN_INTERVAL_S = 30.0
SCAN_LIMIT = 1000


class Indexer:
    def __init__(self, tier: Tier, *, limiter: anyio.CapacityLimiter, log: Logger,
                 metrics: Metrics, time_column: str, hook: Hook | None = None,
                 footers: Footers | None = None) -> None:
        self.tier, self.limiter, self.log, self.m = tier, limiter, log, metrics
        self.hook = hook
        self.footers = footers  # the uploader's footers, reader "indexer"
        self.time_column = time_column
        self.columns = list(dict.fromkeys([time_column, INGESTED_AT,
                                           *tier.cfg.lake.index.zone_map_columns]))
        self.wake = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._listen)
            task_status.started()
            while True:
                try:
                    await self.sweep()
                except (CatalogUnavailable, LakeError, OSError) as exc:
                    self.log.warning("lake_indexer_sweep_failed", error=str(exc))
                with anyio.move_on_after(SCAN_INTERVAL_S):
                    await self.wake.wait()
                self.wake = anyio.Event()

    async def _listen(self) -> None:
        """Wake the sweep on each registration (ours or, with PostgreSQL, anyone's)."""
        while True:
            try:
                async for _file_id in self.tier.catalog.notifications():
                    self.wake.set()
            except CatalogUnavailable as exc:
                self.log.warning("lake_notifications_lost", error=str(exc),
                                 hint="indexing falls back to the periodic scan")
            await anyio.sleep(SCAN_INTERVAL_S)

    async def sweep(self) -> int:
        """Index every registered, unindexed file of this source; evict what is due."""
        catalog = self.tier.catalog
        rows = await catalog.list_files(source_id=self.tier.source_id,
                                        states=[FileState.META_REGISTERED], limit=SCAN_LIMIT)
        for row in rows:
            await self.index(row)
        await self.evict_due()
        return len(rows)

    async def index(self, row: FileRow) -> None:
        started = anyio.current_time()
        path = Path(row.local_path) if row.local_path else None
        if path is None or not await anyio.to_thread.run_sync(path.exists):
            self.log.warning("lake_index_skipped", file_id=row.file_id,
                             reason="no local copy", uri=row.uri)
            return
        footer = self.footers.peek(row.file_id) if self.footers is not None else b""
        maps = await anyio.to_thread.run_sync(zone_maps, path, self.columns, footer,
                                              limiter=self.limiter)
        try:
            await self.tier.catalog.record_index(row.file_id, maps, sorted(set(row.indexes)))
        except StateConflict:
            self._footer_done(row)
            return  # replaced by compaction since it was listed: nothing to index
        self._footer_done(row)  # kept while recording may fail: the sweep indexes again

        self.m.lake_transitions.labels(FileState.INDEXED.value).inc()
        self.log.info("lake_file_indexed", file_id=row.file_id, client=row.client_name,
                      uri=row.uri, rows=row.row_count, bytes=row.compressed_size,
                      zone_maps=len(maps), indexes=row.indexes,
                      footer="writer" if footer else "file",
                      duration_ms=round((anyio.current_time() - started) * 1000, 2))
        await self._fault("indexed")
        if self.tier.cfg.lake.delete_after_upload:
            await self.evict(row)

    async def evict_due(self) -> None:
        """Local copies past lake.local_retention_s (when not deleted right after upload)."""
        lake = self.tier.cfg.lake
        if lake.delete_after_upload:
            return
        cutoff = time.time_ns() - lake.local_retention_s * 1_000_000_000
        rows = await self.tier.catalog.list_files(source_id=self.tier.source_id,
                                                  states=[FileState.INDEXED], limit=SCAN_LIMIT)
        for row in rows:
            if row.local_path and row.uploaded_at <= cutoff:
                await self.evict(row)

    async def evict(self, row: FileRow) -> None:
        """Local copy gone, row Evicted: only while the row is still registered as
        indexed (compaction may have replaced it meanwhile; then the row stays
        Compacted and the janitor removes the copy as a stale staging file)."""
        started = anyio.current_time()
        moved = await self.tier.catalog.set_state_if(
            row.file_id, FileState.EVICTED, (FileState.META_REGISTERED, FileState.INDEXED),
            local_path="")
        if not moved:
            self.log.info("lake_evict_skipped", file_id=row.file_id, reason="no longer live")
            return
        if row.local_path:
            await anyio.to_thread.run_sync(_unlink, Path(row.local_path))
        self.m.lake_transitions.labels(FileState.EVICTED.value).inc()
        self.log.info("lake_file_evicted", file_id=row.file_id, client=row.client_name,
                      uri=row.uri, rows=row.row_count, bytes=row.compressed_size,
                      duration_ms=round((anyio.current_time() - started) * 1000, 2))
        await self._fault("evicted")

    def _footer_done(self, row: FileRow) -> None:
        if self.footers is not None:
            self.footers.done(row.file_id, "indexer")

    async def _fault(self, step: str) -> None:
        if self.hook is not None:
            await anyio.to_thread.run_sync(self.hook, step)


def _unlink(path: Path) -> None:
    fs.active().unlink(path, missing_ok=True)


__all__ = ["Indexer"]
