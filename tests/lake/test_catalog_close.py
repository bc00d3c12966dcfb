"""``Catalog.close`` at a daemon's stop, on both backends: it runs in a cancelled scope.

The daemon's root task group is cancelled when its pipelines have drained, so every
``async with open_catalog(...)`` leaves through a cancelled scope. A close that awaited
unshielded was cancelled at once and left its connections open: only the process's
exit closed them, which an in-process daemon (tests/inprocess.py) does not have.
"""

from __future__ import annotations

import os

import anyio
import asyncpg
import pytest

from quiverd.lake.catalog import open_catalog
from tests.lake.catalogs import Log, Target


@pytest.mark.asyncio
async def test_catalog_close_in_a_cancelled_scope_releases_its_connections(
        target: Target) -> None:
    config, path = target
    catalog = open_catalog(config, path, log=Log())
    await catalog.start()
    assert await catalog.job_decisions(["j"]) == {}  # a pooled connection in use once
    assert await _connections(target) >= 1
    with anyio.CancelScope() as scope:
        scope.cancel()  # what the daemon's root scope is when Staging's catalog closes
        await catalog.close()
    assert await _connections(target) == 0


async def _connections(target: Target) -> int:
    """Descriptors of this process on the SQLite file, or the database's other sessions."""
    config, path = target
    if not config.dsn:
        # This test's file (and its -wal, -shm) only: under xdist the worker has run
        # other tests whose readers keep a catalog.sqlite of their own open.
        return sum(p.startswith(str(path.resolve())) for p in _open_paths())
    probe = await asyncpg.connect(config.dsn)
    try:
        n: int = await probe.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()")
        return n
    finally:
        await probe.close()


def _open_paths() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return out
