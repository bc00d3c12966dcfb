"""A change counter actors wait on: state changes travel as notifications, not polling."""

from __future__ import annotations

import anyio


class Changes:
    """``notify()`` bumps the version and wakes every ``wait_beyond`` caller."""

    def __init__(self) -> None:
        self.version = 0
        self._event = anyio.Event()

    def notify(self) -> None:
        self.version += 1
        self._event.set()
        self._event = anyio.Event()

    async def wait_beyond(self, version: int) -> None:
        while self.version == version:
            await self._event.wait()
