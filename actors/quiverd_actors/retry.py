"""Retry pacing for writes that wait for the disk: one per thing that retries.

    write fails ──▶ failed(event)   the first failure of an episode logs ``event``
                    pause()         50 ms, 100 ms, ... capped at 2 s (bounded), and
                                    returns early when ``stop`` is set
    write works ──▶ succeeded(event) ends the episode with one info event

Used by the wal_writer (disk full, deferred releases) and the finalizer (segment
writes). Not a timer loop: each pause is one bounded wait between two attempts.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio

from quiverd.kernel.logs import Logger

FIRST_RETRY_S = 0.05
MAX_RETRY_S = 2.0


class Retry:
    def __init__(self, log: Logger, *, first_s: float = FIRST_RETRY_S,
                 max_s: float = MAX_RETRY_S) -> None:
        self.log, self.first_s, self.max_s = log, first_s, max_s
        self.since: float | None = None  # monotonic start of the current episode
        self.failures = 0
        self.delay = first_s  # the next pause

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, event: str, *, repeat: bool = False, **fields: Any) -> None:
        """Count a failure. Logs ``event`` for the first of an episode, and with
        ``repeat`` again at the 2nd, 4th, 8th ... (a long episode stays visible in
        a number of lines that grows only with its logarithm)."""
        if self.since is None:
            self.since, self.failures, self.delay = time.monotonic(), 0, self.first_s
        self.failures += 1
        n = self.failures
        if n == 1 or (repeat and n & (n - 1) == 0):
            self.log.warning(event, failures=n, retry_in_ms=round(self.delay * 1000), **fields)

    async def pause(self, stop: anyio.Event | None = None) -> None:
        """Wait the current delay (less if ``stop`` is set), then double it."""
        with anyio.move_on_after(self.delay):
            if stop is None:
                await anyio.sleep_forever()
            else:
                await stop.wait()
        self.backoff()

    def pause_blocking(self, stop: threading.Event) -> None:
        """``pause`` for a thread (the WAL's writer): returns early when ``stop`` is set."""
        stop.wait(self.delay)
        self.backoff()

    def backoff(self) -> None:
        self.delay = min(self.delay * 2, self.max_s)

    def succeeded(self, event: str, **fields: Any) -> None:
        """End the episode (if one is on) with one info event."""
        if self.since is None:
            return
        self.log.info(event, failed_s=round(time.monotonic() - self.since, 3),
                      failures=self.failures, **fields)
        self.since, self.failures, self.delay = None, 0, self.first_s
