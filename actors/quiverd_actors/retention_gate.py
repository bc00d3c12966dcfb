"""The retention gate: one per shard, closed while the shard is over its size cap.

Written by the gc_sweeper (``refresh`` after every sweep), read by the
wal_writer before each append: under ``backpressure`` producers wait for it to
open (or get AT_CAPACITY under ``at_capacity = "reject"``). ``usage`` is the
shard's measure (WAL + segments + ack.log bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio


@dataclass
class RetentionGate:
    cap_bytes: int  # 0: no cap, the gate never closes
    usage: Callable[[], int]
    closed: bool = False
    opened: anyio.Event = field(default_factory=anyio.Event)

    def over(self) -> bool:
        return self.cap_bytes > 0 and self.usage() >= self.cap_bytes

    def excess_bytes(self) -> int:
        """Bytes to free before the shard is under its cap again (0 when it is)."""
        return self.usage() - self.cap_bytes + 1 if self.over() else 0

    def refresh(self) -> None:
        self.closed = self.over()
        if not self.closed:
            self.opened.set()
            self.opened = anyio.Event()
