"""FlushPolicy.after_write as a table: every row of quiverd/wal/flush.py's docstring."""

from __future__ import annotations

import math

import pytest

from quiverd.wal.flush import Action, FlushPolicy

INTERVAL = FlushPolicy("interval", interval_s=0.025, flush_bytes=1 << 20)
NO_BYTES = FlushPolicy("interval", interval_s=0.025, flush_bytes=0)
ALWAYS = FlushPolicy("always", interval_s=0.025, flush_bytes=1 << 20)
NEVER = FlushPolicy("never", interval_s=0.025, flush_bytes=1 << 20)

# policy, unsynced entries, unsynced bytes, age s, writer idle, closing -> action, wait
TABLE = [
    (NEVER, 3, 100, 0.0, False, False, Action.ACK, math.inf),
    (NEVER, 0, 0, 0.0, True, False, Action.ACK, math.inf),
    (ALWAYS, 0, 0, 0.0, True, False, Action.WAIT, math.inf),
    (INTERVAL, 0, 0, 9.0, True, True, Action.WAIT, math.inf),
    (ALWAYS, 1, 10, 0.0, False, False, Action.SYNC, math.inf),
    (INTERVAL, 1, 10, 0.0, True, False, Action.SYNC, math.inf),  # idle: the group is done
    (INTERVAL, 1, 10, 0.0, False, True, Action.SYNC, math.inf),  # closing: nothing more comes
    (INTERVAL, 9, 1 << 20, 0.0, False, False, Action.SYNC, math.inf),  # flush_bytes reached
    (INTERVAL, 9, (1 << 20) - 1, 0.0, False, False, Action.WAIT, 0.025),
    (NO_BYTES, 9, 1 << 30, 0.0, False, False, Action.WAIT, 0.025),  # 0: no byte threshold
    (INTERVAL, 2, 10, 0.010, False, False, Action.WAIT, 0.015),  # the rest of the interval
    (INTERVAL, 2, 10, 0.025, False, False, Action.SYNC, math.inf),  # interval over
    (INTERVAL, 2, 10, 5.0, False, False, Action.SYNC, math.inf),
]


@pytest.mark.parametrize(("policy", "entries", "nbytes", "age", "idle", "closing", "action",
                          "wait"), TABLE)
def test_flush_policy_after_write(policy, entries, nbytes, age, idle, closing, action, wait):
    got = policy.after_write(unsynced_entries=entries, unsynced_bytes=nbytes,
                             unsynced_age_s=age, writer_idle=idle, closing=closing)
    assert got.action is action
    assert got.wait_s == pytest.approx(wait)


def test_flush_policy_of_config_reads_the_wal_section():
    from quiverd.kernel.config import WalConfig

    p = FlushPolicy.of(WalConfig(flush_policy="interval", flush_interval_ms=40, flush_bytes=7))
    assert (p.policy, p.interval_s, p.flush_bytes, p.syncs) == ("interval", 0.04, 7, True)
    assert not FlushPolicy.of(WalConfig(flush_policy="never")).syncs
