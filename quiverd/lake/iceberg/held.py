"""Which compacted lake files an Iceberg snapshot still holds (the janitor keeps those).

A compaction's replace snapshot removes the old files from the table's current state,
but older snapshots keep referencing them until ``expire`` drops those snapshots
(``[lake.iceberg] keep_snapshots_s`` after they stopped being current): an engine
reading the table as of an older snapshot (time travel, a query planned before the
replace) still opens them. So the janitor deletes a compacted object only when no
unexpired snapshot of its table references it: the same snapshots expiry keeps, so a
reader that loaded the table within the window finds every file. Unknown (the catalog
or the store cannot be read) means held.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from quiverd.lake.iceberg.names import catalog_uri, table_name
from quiverd.lake.iceberg.projection import Projection
from quiverd.lake.model import FileRow
from quiverd.lake.tier import Tier


async def held_ids(referenced: Callable[[str], Awaitable[set[str]]],
                   location_of: Callable[[str], str], rows: list[FileRow]) -> set[str]:
    """Ids of ``rows`` whose object an unexpired snapshot of its table references.
    ``referenced(table)`` gives the locations a table's snapshots hold (one metadata
    read per table); ``location_of`` maps an object key to such a location
    (``ObjectStore.location``)."""
    by_table: dict[str, list[FileRow]] = defaultdict(list)
    for row in rows:
        by_table[table_name(row.client_name, row.slot)].append(row)
    held: set[str] = set()
    for table, group in by_table.items():
        locations = await referenced(table)
        held.update(r.file_id for r in group if location_of(r.object_key) in locations)
    return held


def snapshot_holds(tier: Tier) -> Callable[[list[FileRow]], Awaitable[set[str]]]:
    """``held`` for a janitor sweep outside the daemon (``quiverd janitor``): opens the
    projection's catalog for the call, in worker threads; any failure holds every row."""
    cfg = tier.cfg

    def open_projection() -> Projection:
        return Projection(catalog_uri=catalog_uri(cfg.catalog, Path(cfg.data_dir)),
                          warehouse=tier.store.location(""),
                          io_properties=tier.store.iceberg_io_properties(),
                          cfg=cfg.lake.iceberg)

    async def held(rows: list[FileRow]) -> set[str]:
        try:
            projection = await anyio.to_thread.run_sync(open_projection)
            try:
                return await held_ids(
                    lambda table: anyio.to_thread.run_sync(projection.referenced_locations,
                                                           table),
                    tier.store.location, rows)
            finally:
                await anyio.to_thread.run_sync(projection.close)
        except Exception as exc:  # noqa: BLE001 - unknown means keep
            tier.log.warning("iceberg_references_unknown", files=len(rows), error=str(exc),
                             hint="compacted objects are kept until the Iceberg catalog "
                             "answers")
            return {r.file_id for r in rows}

    return held
