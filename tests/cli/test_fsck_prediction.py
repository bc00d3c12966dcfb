"""fsck's loss prediction is what replay then does: the same WAL walk, compared case by case.

Each damage pattern is applied to one data directory, copied: ``quiverd fsck --json``
predicts the lost sequences on one copy, daemon recovery (``recover_shard``) replays
the other; the two must name the same sequences.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quiverd.cli import fsck
from quiverd.kernel.config import Config
from quiverd.kernel.layout import DataDir
from quiverd.runtime.recovery import recover_shard
from quiverd.wal.dump import dump_wal
from tests.cli.test_fsck import build_data_dir, fsck_json


class Log:
    def __getattr__(self, level: str) -> Any:
        return lambda *a, **k: None


def offsets(wal: Path) -> dict[int, tuple[int, int]]:
    """sequence -> (offset, bytes) of every entry."""
    return {r["sequence"]: (r["offset"], r["bytes"]) for r in dump_wal(wal)
            if r["kind"] == "entry"}


def bad_crc(raw: bytearray, at: dict[int, tuple[int, int]]) -> None:
    off, n = at[6]
    raw[off + n - 10] ^= 0x40  # a payload byte of 6; 7 follows, sound


def torn_tail(raw: bytearray, at: dict[int, tuple[int, int]]) -> None:
    off, n = at[12]
    del raw[off + n // 2:]  # the last entry half written


def impossible_length(raw: bytearray, at: dict[int, tuple[int, int]]) -> None:
    off, _ = at[6]
    raw[off:off + 4] = (0xFFFF_FFF0).to_bytes(4, "little")


def length_spans_successors(raw: bytearray, at: dict[int, tuple[int, int]]) -> None:
    """Entry 6's length grows to end exactly where entry 9 does: sound 7, 8, 9 inside it."""
    off, _ = at[6]
    end9 = at[9][0] + at[9][1]
    raw[off:off + 4] = (end9 - off - 4 - 4).to_bytes(4, "little")  # len prefix, crc


def length_into_successor(raw: bytearray, at: dict[int, tuple[int, int]]) -> None:
    """Entry 6's length points into the middle of entry 10."""
    off, _ = at[6]
    mid10 = at[10][0] + at[10][1] // 2
    raw[off:off + 4] = (mid10 - off - 4 - 4).to_bytes(4, "little")


def two_bad_crcs(raw: bytearray, at: dict[int, tuple[int, int]]) -> None:
    for seq in (6, 7):
        off, n = at[seq]
        raw[off + n - 10] ^= 0x40


DAMAGE: dict[str, Callable[[bytearray, dict[int, tuple[int, int]]], None]] = {
    "bad_crc": bad_crc, "torn_tail": torn_tail, "impossible_length": impossible_length,
    "length_spans_successors": length_spans_successors,
    "length_into_successor": length_into_successor, "two_bad_crcs": two_bad_crcs,
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_fsck_predicts_exactly_the_sequences_replay_loses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    root = build_data_dir(tmp_path / "a", wal_entries=12, segment_bundles=3)
    wal = root / "shard-0" / "wal" / "quiver.wal"
    raw = bytearray(wal.read_bytes())
    DAMAGE[name](raw, offsets(wal))
    wal.write_bytes(raw)
    replayed = tmp_path / "b"
    shutil.copytree(root, replayed)
    rc, out = fsck_json(capsys, root)
    predicted = [tuple(r) for loss in out["lost"] for r in loss["sequences"]]
    shard = DataDir(replayed).shard(0)
    rec = recover_shard(0, shard, Config(data_dir=str(replayed), shards=1), {}, Log())
    rec.wal.close()
    rec.ack_file.close()
    assert predicted == [tuple(r) for r in rec.lost_sequences], name
    assert (rc == fsck.EXIT_UNHEALTHY) == bool(rec.lost_sequences) or name == "torn_tail"
