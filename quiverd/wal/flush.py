"""When the WAL's syncer fdatasyncs: one pure decision, asked after every change.

The syncer thread (``quiverd.wal.pipeline``) holds the entries written but not yet
covered by an fdatasync. Whenever a write lands, a sync returns or a deadline passes
it asks ``FlushPolicy.after_write`` what to do with them:

    policy     unsynced   writer idle / closing   bytes >= flush_bytes   age >= interval
    never      any        -                       -                      -      ACK (no sync)
    any        none       -                       -                      -      WAIT (forever)
    always     some       -                       -                      -      SYNC
    interval   some       yes                     -                      -      SYNC
    interval   some       no                      yes                    -      SYNC
    interval   some       no                      no                     yes    SYNC
    interval   some       no                      no                     no     WAIT (the rest)

"Writer idle" means nothing is queued or being written: the group is as large as
it will get, so waiting for the timer would only add latency. Under load the
writer is rarely idle and groups are bounded by ``flush_bytes`` or the interval,
while the writes go on during the sync. Tested as a table in
tests/wal/test_flush_policy.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from quiverd.kernel.config import WalConfig


class Action(Enum):
    SYNC = "sync"  # fdatasync now, then acknowledge everything it covered
    WAIT = "wait"  # ask again after ``wait_s`` or the next write, whichever is first
    ACK = "ack"  # acknowledge without a sync (flush_policy = "never": tests, benches)


@dataclass(frozen=True)
class Decision:
    action: Action
    wait_s: float = math.inf


SYNC = Decision(Action.SYNC)
ACK = Decision(Action.ACK)
WAIT_FOREVER = Decision(Action.WAIT)


@dataclass(frozen=True)
class FlushPolicy:
    policy: Literal["interval", "always", "never"]
    interval_s: float
    flush_bytes: int  # 0: no byte threshold

    @classmethod
    def of(cls, cfg: WalConfig) -> FlushPolicy:
        return cls(cfg.flush_policy, cfg.flush_interval_ms / 1000, cfg.flush_bytes)

    @property
    def syncs(self) -> bool:
        return self.policy != "never"

    def after_write(self, *, unsynced_entries: int, unsynced_bytes: int,
                    unsynced_age_s: float, writer_idle: bool, closing: bool = False
                    ) -> Decision:
        """What to do with the ``unsynced_entries`` written and not yet synced, the
        oldest written ``unsynced_age_s`` ago. ``closing``: no more writes will come."""
        if self.policy == "never":
            return ACK
        if unsynced_entries == 0:
            return WAIT_FOREVER
        if self.policy == "always" or writer_idle or closing:
            return SYNC
        if 0 < self.flush_bytes <= unsynced_bytes:
            return SYNC
        left = self.interval_s - unsynced_age_s
        return SYNC if left <= 0 else Decision(Action.WAIT, left)
