"""``list_files(newest_first=True)``: the latest file of a (client, slot), on SQLite and
PostgreSQL (the Spark reader takes an empty selection's schema from it)."""

from __future__ import annotations

import pytest

from quiverd.lake.catalog import Catalog
from tests.lake.test_catalog import row


@pytest.mark.asyncio
async def test_catalog_list_files_newest_first_orders_by_start_then_id_descending(
        catalog: Catalog) -> None:
    for r in [row("B", start_ts=10, end_ts=20), row("A", start_ts=10, end_ts=12),
              row("D", start_ts=30, end_ts=40), row("C", client="c2", start_ts=50, end_ts=60)]:
        await catalog.insert_file(r)
    newest = await catalog.list_files(client="c1", newest_first=True)
    assert [f.file_id for f in newest] == ["D", "B", "A"]
    latest = await catalog.list_files(client="c1", newest_first=True, limit=1, until_ns=30)
    assert [f.file_id for f in latest] == ["B"]
