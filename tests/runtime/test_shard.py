"""Shard helpers (quiverd.runtime.shard): the free-space reserve WAL appends leave."""

from __future__ import annotations

from quiverd.kernel.config import loads
from quiverd.runtime.shard import wal_disk_reserve_bytes

MiB = 1 << 20


def test_shard_reserve_covers_one_segment_per_shard_by_default() -> None:
    cfg = loads('data_dir = "/d"\n')
    # 8 MiB metadata + 2 x (32 MiB target + 1 MiB flush_bytes + 16 MiB batch)
    assert wal_disk_reserve_bytes(cfg, 2) == 8 * MiB + 2 * 49 * MiB


def test_shard_reserve_never_exceeds_the_wal_or_a_tenth_of_the_disk() -> None:
    cfg = loads('data_dir = "/d"\n[segment]\ntarget_size_bytes = 1099511627776\n'
                '[wal]\nmax_size_bytes = 1073741824\n')
    assert wal_disk_reserve_bytes(cfg, 2) == 8 * MiB + 2 * (1024 + 1 + 16) * MiB
    assert wal_disk_reserve_bytes(cfg, 2, fs_bytes=1000 * MiB) == 100 * MiB
    assert wal_disk_reserve_bytes(cfg, 2, fs_bytes=10 * MiB) == 16 * MiB  # floor: 2 x 8 MiB
