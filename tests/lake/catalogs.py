"""What the catalog tests share (their fixtures are in conftest.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from quiverd.kernel.config import CatalogConfig
from quiverd.lake.catalog import Catalog, Notifications
from tests.recording import Log

__all__ = ["Log", "Opener", "Target", "heard_until_closed"]

Target = tuple[CatalogConfig, Path]
Opener = Callable[[], Awaitable[Catalog]]


async def heard_until_closed(catalog: Catalog, feed: Notifications,
                             trigger: Callable[[], Awaitable[object]]) -> list[str]:
    """What ``feed`` delivers for ``trigger``, draining until ``catalog.close()`` ends it."""
    received: list[str] = []
    got_one = anyio.Event()

    async def drain() -> None:
        async for item in feed:
            received.append(item)
            got_one.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            await trigger()
            await got_one.wait()
            await catalog.close()  # drain's loop ends: the task group can exit
    return received
