"""Retirement decisions (runtime.retirement) on real AckStates, leases and gates.

The shards are real ack state (``AckState``) with a segment table of sizes, a real
``RetentionGate`` and ``StreamLeases``; the remove is the ack.log record
``subscribers.remove`` makes, applied. Time without a consumer is set by moving the
times the retirement last saw a consumer back (what a long-running daemon's clock would have done).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from quiverd.acks.retired import RetiredMarks
from quiverd.acks.state import AckState
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import Config, RetentionConfig
from quiverd.kernel.metrics import Metrics
from quiverd.net.consumers import SubscriberHub
from quiverd.runtime.retirement import Retirement
from quiverd_actors.retention_gate import RetentionGate

MiB = 1 << 20
SEGMENT_BYTES = 1 * MiB


@dataclass
class Segments:
    sizes: dict[int, int] = field(default_factory=dict)

    def bytes_from(self, segment_seq: int) -> int:
        return sum(n for seq, n in self.sizes.items() if seq >= segment_seq)


@dataclass
class FakeShard:
    acks: AckState = field(default_factory=AckState)
    segments: Segments = field(default_factory=Segments)
    dispatcher: Any = field(default_factory=lambda: type("D", (), {"sessions": []})())
    changes: Changes = field(default_factory=Changes)
    over_cap: Changes = field(default_factory=Changes)
    used: int = 0

    def __post_init__(self) -> None:
        self.gate = RetentionGate(cap_bytes=8 * MiB, usage=lambda: self.used)

    def add(self, name: str) -> None:
        self.acks.apply(self.acks.add_subscriber(name))

    def write(self, segments: int) -> None:
        for _ in range(segments):
            seq = self.acks.segment_floor
            self.acks.apply(self.acks.segment_finalized(seq, 4))
            self.segments.sizes[seq] = SEGMENT_BYTES
            self.used += SEGMENT_BYTES


def setup(tmp_path: Path, *, exempt: set[str] | None = None, disk_bytes: int = 0,
          **retention: Any) -> tuple[Retirement, FakeShard, SubscriberHub]:
    retention.setdefault("size_cap_bytes", 8 * MiB)
    cfg = Config(data_dir=str(tmp_path), retention=RetentionConfig(**retention))
    shard, hub = FakeShard(), SubscriberHub()

    async def remove(name: str) -> None:
        shard.acks.apply(shard.acks.remove_subscriber(name))

    shards: list[Any] = [shard]
    r = Retirement(cfg, shards, hub, RetiredMarks(tmp_path / "retired.json"), remove=remove,
                   exempt=exempt or set(), metrics=Metrics(), log=structlog.get_logger("t"),
                   disk_bytes=disk_bytes)
    return r, shard, hub


def ack(shard: FakeShard, name: str, bundle_index: int) -> None:
    record = shard.acks.record_outcome(name, 0, bundle_index, 1)
    assert record is not None
    shard.acks.apply(record)


def names(shard: FakeShard) -> list[str]:
    return [s.name for s in shard.acks.registry]


def test_retirement_lag_waits_for_the_grace_even_at_the_cap(tmp_path):
    r, shard, _ = setup(tmp_path, retire_grace_s=60.0)
    shard.add("exp")
    shard.write(8)  # 8 MiB: past half the 8 MiB cap, at the cap
    anyio.run(r.check)
    assert names(shard) == ["exp"]  # without a consumer for less than the grace
    r.last_live["exp"] -= 60  # a consumer that comes back within it keeps the subscriber
    anyio.run(r.check)
    assert names(shard) == []
    assert "its lag reached 8388608 bytes" in (r.refusal("exp") or "")
    assert r.retired.by_label("reason") == {"lag_bytes": 1}


def test_retirement_below_the_lag_or_with_a_consumer_keeps_the_subscriber(tmp_path):
    r, shard, hub = setup(tmp_path, retire_grace_s=0.0)
    shard.add("below")
    shard.add("attached")
    shard.add("leased")
    shard.write(4)
    for i in range(4):  # "below" acked its first segment: 3 MiB behind
        ack(shard, "below", i)
    shard.dispatcher.sessions = [type("S", (), {"name": "attached", "closed": False})()]
    hub.leases.take("leased", "a query", pid=os.getpid())  # a running Spark driver
    anyio.run(r.check)
    assert names(shard) == ["below", "attached", "leased"]
    hub.leases.release("leased", "a query")  # the query stopped: the lease goes with it
    anyio.run(r.check)
    assert names(shard) == ["below", "attached"]


def test_retirement_idle_needs_lag_and_spares_the_exempt(tmp_path):
    r, shard, _ = setup(tmp_path, retire_idle_s=10, retire_after_lag_bytes=0,
                        exempt={"uploader"})
    for name in ("caught_up", "behind", "uploader"):
        shard.add(name)
    shard.write(1)
    for i in range(4):
        ack(shard, "caught_up", i)
    anyio.run(r.check)
    assert names(shard) == ["caught_up", "behind", "uploader"]
    for name in r.last_live:  # eleven seconds without a consumer, for all of them
        r.last_live[name] -= 11
    anyio.run(r.check)
    assert names(shard) == ["caught_up", "uploader"]
    [m] = list(r.marks)
    assert m.name == "behind" and m.reason == "idle" and m.idle_s >= 10
    assert (tmp_path / "retired.json").exists()


def test_retirement_counts_a_new_subscribers_time_from_its_registration(tmp_path):
    r, shard, _ = setup(tmp_path, retire_idle_s=10, retire_grace_s=10.0)
    shard.add("early")
    shard.write(8)
    anyio.run(r.check)  # the daemon's first check: "early" is seen
    r.last_live["early"] -= 11  # eleven seconds later...
    shard.add("late")  # ...an operator adds "late" before starting its consumer
    shard.write(8)
    anyio.run(r.check)
    assert names(shard) == ["late"]  # "early" is retired, "late" has its whole grace


def test_retirement_mark_is_void_once_readded_and_cleared(tmp_path):
    r, shard, _ = setup(tmp_path, retire_grace_s=0.0)
    shard.add("exp")
    shard.write(4)
    anyio.run(r.check)
    assert r.status()[0]["name"] == "exp"
    shard.add("exp")  # `quiverd subscribers add exp`
    assert r.refusal("exp") is None and r.status() == []
    anyio.run(r.readded, "exp")
    assert r.marks.get("exp") is None
    assert b'"retired":[]' in (tmp_path / "retired.json").read_bytes()


def test_retirement_lag_limit_without_a_cap_is_half_the_disk(tmp_path):
    r, shard, _ = setup(tmp_path, size_cap_bytes=0, disk_bytes=10 * MiB, retire_grace_s=0.0)
    assert r.lag_limit_bytes == 5 * MiB
    shard.add("exp")
    shard.write(4)
    anyio.run(r.check)
    assert names(shard) == ["exp"]
    shard.write(1)
    anyio.run(r.check)
    assert names(shard) == []
    explicit, _, _ = setup(tmp_path, size_cap_bytes=0, disk_bytes=10 * MiB,
                           retire_after_lag_bytes=0)
    assert explicit.lag_limit_bytes == 0  # 0 = never, whatever the disk
    dropping, _, _ = setup(tmp_path, size_cap_policy="drop_oldest")
    assert dropping.lag_limit_bytes == 0  # the cap drops for it: ingest never waits
    set_, _, _ = setup(tmp_path, size_cap_policy="drop_oldest", retire_after_lag_bytes=MiB)
    assert set_.lag_limit_bytes == MiB


def test_retirement_off_with_both_limits_zero(tmp_path):
    r, _, _ = setup(tmp_path, retire_after_lag_bytes=0, retire_idle_s=0)
    assert not r.enabled
    started = time.monotonic()
    anyio.run(r.run)  # returns at once
    assert time.monotonic() - started < 1.0
