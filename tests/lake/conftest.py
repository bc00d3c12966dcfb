"""Catalog fixtures: every catalog test runs on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from quiverd.kernel.config import CatalogConfig
from quiverd.lake.catalog import Catalog, open_catalog
from tests.lake.catalogs import Log, Opener, Target


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """Where the catalog lives: an empty PostgreSQL database or a new SQLite file."""
    if request.param == "postgresql":
        return CatalogConfig(dsn=request.getfixturevalue("pg_catalog_dsn")), tmp_path / "unused"
    return CatalogConfig(), tmp_path / "catalog.sqlite"


@pytest_asyncio.fixture
async def open_more(target: Target) -> AsyncIterator[Opener]:
    """Opens (and starts) more catalogs on the same database; all closed at teardown."""
    opened: list[Catalog] = []

    async def open_one() -> Catalog:
        cat = open_catalog(target[0], target[1], log=Log())
        opened.append(cat)
        await cat.start()
        return cat

    yield open_one
    for cat in opened:
        await cat.close()


@pytest_asyncio.fixture
async def catalog(open_more: Opener) -> Catalog:
    return await open_more()
