"""Files the Iceberg projection cannot hold are said where a user looks: one log line per
file (id, rows, reason), the status (files and rows per table) and the table's
properties (``quiverd.skipped-*.<source id>``), on the real Projector, catalog and store."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from quiverd.kernel.config import CatalogConfig, IcebergConfig
from quiverd.lake.iceberg import Projection, catalog_uri
from tests.lake.helpers import add_file, open_test_tier
from tests.lake.iceberg_model import LocalProjection, new_projector

NS_COLUMN = pa.array([1_000_000_000_000_000_001] * 7, pa.timestamp("ns", tz="UTC"))


@pytest.mark.asyncio
async def test_iceberg_skipped_files_are_named_in_log_status_and_table(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, iceberg=IcebergConfig(linger_ms=0)) as tier:
        projection = LocalProjection(Projection(
            catalog_uri=catalog_uri(CatalogConfig(), tmp_path), io_properties={},
            warehouse=tier.store.location(""), cfg=IcebergConfig()))
        try:
            projector = new_projector(tier, projection)
            good = await add_file(tier, pa.table({"id": pa.array(range(5), pa.int64())}),
                                  client="web", segment=1)
            bad = await add_file(tier, pa.table({"id": pa.array(range(7), pa.int64()),
                                                 "t": NS_COLUMN}), client="web", segment=2)
            for row in (good, bad):
                projector.registered(row)
            await projector.round_once()
            status = projector.status()
            assert status["files_skipped"] == 1
            assert status["skipped"] == {"quiver.web": {"files": 1, "rows": 7}}
            [(_, line)] = [e for e in projector.log.events  # type: ignore[attr-defined]
                           if e[0] == "iceberg_file_skipped"]
            assert line["file_id"] == bad.file_id and line["rows"] == 7
            assert "timestamp[ns" in line["reason"] and line["table"] == "quiver.web"
            props = _properties(tmp_path, tier.store.location(""))
            sid = tier.source_id
            assert props[f"quiverd.skipped-files.{sid}"] == "1"
            assert props[f"quiverd.skipped-rows.{sid}"] == "7"
            assert props[f"quiverd.skipped-file-ids.{sid}"] == bad.file_id
            # A later pass (a restart forgets the verdicts) finds the same, logs it again
            # once, and leaves the table as it is.
            again = new_projector(tier, projection)
            again.nudge()
            await again.round_once()
            assert again.status()["skipped"] == {"quiver.web": {"files": 1, "rows": 7}}
            assert _properties(tmp_path, tier.store.location(""))[
                f"quiverd.skipped-rows.{sid}"] == "7"
        finally:
            projection.projection.close()


def _properties(root: Path, warehouse: str) -> dict[str, str]:
    catalog = SqlCatalog("quiverd", uri=catalog_uri(CatalogConfig(), root), warehouse=warehouse)
    try:
        return dict(catalog.load_table(("quiver", "web")).metadata.properties)
    finally:
        catalog.engine.dispose()
