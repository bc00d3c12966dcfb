"""StatusView's probes over stand-in parts: every reason /readyz gives, and /livez never
depending on them (tests/daemon/test_probes.py asks a real daemon over HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from quiverd.kernel.config import Config, RetentionConfig
from quiverd.kernel.metrics import Metrics, Value
from quiverd.runtime.status import StatusView
from quiverd_actors.retention_gate import RetentionGate


@dataclass
class FakeWal:
    full: bool = False
    live_bytes: int = 65536
    file_count: int = 2

    def fits(self, nbytes: int) -> bool:
        return not self.full


@dataclass
class FakeShard:
    index: int
    used: int = 0
    cap: int = 0
    recovered: Any = field(default_factory=lambda: SimpleNamespace(wal=FakeWal()))
    unfinished: bool = True
    wal_stats: Any = field(default_factory=lambda: SimpleNamespace(
        disk_full=Value(), appends=Value(), bytes_written=Value()))

    def __post_init__(self) -> None:
        self.gate = RetentionGate(cap_bytes=self.cap, usage=lambda: self.used)

    def usage_bytes(self) -> int:
        return self.used


@dataclass
class FakeParts:
    cfg: Config
    shards: list[Any]
    ingest: Any = True
    lake: Any = None
    staging: Any = None
    stopping: bool = False


def view(tmp_path: Any, shards: list[FakeShard], policy: str = "backpressure",
         **parts: Any) -> tuple[StatusView, FakeParts]:
    cap = sum(s.cap for s in shards)
    cfg = Config(data_dir=str(tmp_path), retention=RetentionConfig(
        size_cap_bytes=cap, size_cap_policy=policy))  # type: ignore[arg-type]
    p = FakeParts(cfg=cfg, shards=list(shards), **parts)
    return StatusView(p, Metrics()), p


def test_status_readiness_ready_when_every_shard_takes_appends(tmp_path: Any) -> None:
    v, _ = view(tmp_path, [FakeShard(0, used=10, cap=100), FakeShard(1, used=99, cap=100)])
    assert v.readiness() == {"status": "ready", "reasons": []}
    assert v.storage()["utilisation_ratio"] == pytest.approx(109 / 200)


@pytest.mark.parametrize(("change", "want"), [
    ("stopping", "stopping: appends are refused with SHUTTING_DOWN"),
    ("starting", "starting: the ingest socket is not served yet"),
    ("recovering", "shard 1: recovering"),
    ("ended", "shard 1: its pipeline has ended"),
    ("at_cap", "shard 1: at its retention size cap (100 of 100 bytes)"),
    ("wal_full", "shard 1: its WAL is full (65536 bytes in 2 files)"),
    ("disk_full", "shard 1: the WAL finds no disk space"),
])
def test_status_readiness_not_ready_names_the_reason(tmp_path: Any, change: str,
                                                     want: str) -> None:
    shard = FakeShard(1, used=10, cap=100)
    v, parts = view(tmp_path, [FakeShard(0, cap=100), shard])
    if change == "stopping":
        parts.stopping = True
    elif change == "starting":
        parts.ingest = None
    elif change == "recovering":
        shard.recovered = None
    elif change == "ended":
        shard.unfinished = False
    elif change == "at_cap":
        shard.used = 100
    elif change == "wal_full":
        shard.recovered.wal.full = True
    else:
        shard.wal_stats.disk_full.set(1)
    ready = v.readiness()
    assert ready["status"] == "not_ready"
    [reason] = ready["reasons"]
    assert reason.startswith(want), reason
    assert v.liveness()["status"] == "alive"  # whatever readiness says


def test_status_readiness_drop_oldest_over_the_cap_is_still_ready(tmp_path: Any) -> None:
    # Under drop_oldest the writer never holds appends at the cap: the gc deletes instead.
    v, _ = view(tmp_path, [FakeShard(0, used=150, cap=100)], policy="drop_oldest")
    assert v.readiness()["status"] == "ready"
    assert v.storage()["utilisation_ratio"] == 1.5


def test_status_storage_without_a_cap_is_over_the_filesystem(tmp_path: Any) -> None:
    v, _ = view(tmp_path, [FakeShard(0, used=4096)])
    storage = v.storage()
    assert storage["cap_bytes"] == 0 and storage["filesystem_bytes"] > 0
    assert storage["utilisation_ratio"] == 4096 / storage["filesystem_bytes"]
    assert 0 < storage["free_bytes"] <= storage["filesystem_bytes"]
