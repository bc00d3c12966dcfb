"""The pending-bytes budget: bytes received but not yet durable, across all connections.

A BUNDLE frame's header announces its length; the connection takes that many
bytes of budget *before* the frame buffer is allocated and gives them back when
the bundle's ACK or ERROR comes back from the WAL writer (or the connection
ends without submitting it). A connection that finds the budget spent stops
reading until earlier bundles are answered: memory held for frames is bounded
by ``ingest.max_pending_bytes`` whatever the peers do.

Waiters are served first come, first served, so a large frame is not starved
by a stream of small ones. There is at most one waiter per connection, so the
queue is bounded by ``ingest.max_connections``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import anyio


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    granted: anyio.Event = field(default_factory=anyio.Event)


class ByteBudget:
    def __init__(self, total_bytes: int) -> None:
        if total_bytes < 1:
            raise ValueError(f"budget of {total_bytes} bytes")
        self.total_bytes = total_bytes
        self.available = total_bytes
        self._waiters: deque[_Waiter] = deque()

    @property
    def held(self) -> int:
        return self.total_bytes - self.available

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` now if they are free and nobody queues before us."""
        self._check(nbytes)
        if self._waiters or nbytes > self.available:
            return False
        self.available -= nbytes
        return True

    async def take(self, nbytes: int) -> None:
        """Take ``nbytes``, waiting in line for them. Cancellation takes nothing."""
        if self.try_take(nbytes):
            return
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                self.release(nbytes)  # granted just as we were cancelled: hand it on
            else:
                self._waiters.remove(waiter)
                self._grant()  # a big waiter leaving the head may unblock smaller ones
            raise

    def release(self, nbytes: int) -> None:
        self._check(nbytes)
        self.available += nbytes
        assert self.available <= self.total_bytes, "released more budget than was taken"
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._waiters[0].nbytes <= self.available:
            waiter = self._waiters.popleft()
            self.available -= waiter.nbytes
            waiter.granted.set()

    def _check(self, nbytes: int) -> None:
        # Callers size the budget to hold the largest frame, so this is a bug, not input.
        assert 0 <= nbytes <= self.total_bytes, f"{nbytes} bytes exceed the whole budget"
