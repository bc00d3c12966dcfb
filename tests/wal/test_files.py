"""WalFiles on real files: rotation, capacity, release, hole punching, rewrite fallback.

Every test ends by replaying the directory with the real replay code, so what the
writer did must be what recovery reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import MetaCodec, make_slot
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.layout import ACTIVE_WAL as ACTIVE
from quiverd.wal import format as walformat
from quiverd.wal.files import WalFiles
from quiverd.wal.replay import replay_wal

HASH = walformat.DEFAULT_CFG_HASH
MAX_ENTRY = 1 << 20


class Log:
    def __getattr__(self, name: str):  # info/warning/error: accept anything
        return lambda *a, **k: None


def slots(tag: int, rows: int = 200):
    table = pa.table({"tag": [tag] * rows, "s": [f"{tag:040d}"] * rows})
    return (make_slot(0, table), MetaCodec().encode("c", None))


def open_wal(d: Path, *, max_size: int = 1 << 30, chunks: int = 10) -> WalFiles:
    state = replay_wal(d / "wal", d / "q", cfg_hash=HASH, max_entry_bytes=MAX_ENTRY, log=Log())
    return WalFiles.open(d / "wal", state, cfg_hash=HASH, max_size_bytes=max_size,
                         max_chunks=chunks, log=Log())


def append(wal: WalFiles, first_seq: int, n: int) -> None:
    for seq in range(first_seq, first_seq + n):
        s = slots(seq)
        assert wal.fits(walformat.entry_size(s))
        wal.append([(seq, (seq * 10, s), walformat.entry_size(s))], sync=True)


def replayed(d: Path) -> list[int]:
    state = replay_wal(d / "wal", d / "q", cfg_hash=HASH, max_entry_bytes=MAX_ENTRY, log=Log())
    return [e.sequence for e in state.entries]


def make_dirs(tmp_path: Path) -> Path:
    (tmp_path / "wal").mkdir()
    (tmp_path / "q").mkdir()
    return tmp_path


def test_wal_rotates_at_chunk_size_and_replays_across_files(tmp_path):
    d = make_dirs(tmp_path)
    entry = walformat.entry_size(slots(1))
    wal = open_wal(d, max_size=entry * 40, chunks=10)  # chunk = 4 entries
    append(wal, 1, 20)
    wal.close()
    rotated = sorted(p.name for p in (d / "wal").glob(f"{ACTIVE}.*"))
    assert len(rotated) >= 4
    assert replayed(d) == list(range(1, 21))


def test_wal_refuses_past_max_chunks_until_release_deletes_rotated_files(tmp_path):
    d = make_dirs(tmp_path)
    entry = walformat.entry_size(slots(1))
    wal = open_wal(d, max_size=entry * 8, chunks=2)  # two files of ~4 entries
    seq = 1
    while wal.fits(entry):
        append(wal, seq, 1)
        seq += 1
    assert wal.file_count == 2 and not wal.fits(entry)  # backpressure, never a drop
    assert wal.release(seq - 2)  # all but the last entry are in a durable segment
    assert wal.file_count == 1 and wal.fits(entry)
    append(wal, seq, 1)
    wal.close()
    assert replayed(d) == [seq - 1, seq]  # released entries are not replayed


def test_release_punches_the_active_prefix_and_replay_starts_at_the_sidecar(tmp_path):
    d = make_dirs(tmp_path)
    wal = open_wal(d)
    assert wal.punch_supported  # the startup probe on this filesystem
    append(wal, 1, 60)
    before = os.stat(d / "wal" / ACTIVE).st_blocks
    wal.release(50)
    after = os.stat(d / "wal" / ACTIVE).st_blocks
    assert after < before * 0.4  # the released prefix no longer takes disk space
    assert os.stat(d / "wal" / ACTIVE).st_size == wal.end_offset  # size kept (KEEP_SIZE)
    append(wal, 61, 2)
    wal.close()
    assert replayed(d) == list(range(51, 63))


def test_release_without_hole_punching_rewrites_the_live_tail(tmp_path):
    d = make_dirs(tmp_path)
    entry = walformat.entry_size(slots(1))
    wal = open_wal(d, max_size=entry * 100, chunks=2)
    wal.punch_supported = False  # the filesystem said EOPNOTSUPP at the probe
    append(wal, 1, 40)
    size_before = os.stat(d / "wal" / ACTIVE).st_size
    wal.release(35)
    size_after = os.stat(d / "wal" / ACTIVE).st_size
    assert size_after < size_before / 4  # rewritten: header + 5 live entries
    append(wal, 41, 3)
    wal.close()
    assert replayed(d) == list(range(36, 44))


def test_sequence_continues_after_every_entry_was_released(tmp_path):
    d = make_dirs(tmp_path)
    wal = open_wal(d)
    append(wal, 1, 5)
    wal.release(5)
    wal.close()
    state = replay_wal(d / "wal", d / "q", cfg_hash=HASH, max_entry_bytes=MAX_ENTRY, log=Log())
    assert state.entries == []
    # The WAL alone cannot know the next sequence; recovery takes it from segments.
    assert not state.sequence_known or state.next_sequence == 6


def test_read_back_returns_the_user_slots_of_unreleased_entries_across_rotation(tmp_path):
    d = make_dirs(tmp_path)
    entry = walformat.entry_size(slots(1))
    wal = open_wal(d, max_size=entry * 100, chunks=4)  # rotates every ~25 entries
    append(wal, 1, 60)
    assert wal.file_count > 1
    got = wal.read_back([3, 30, 59])
    for seq in (3, 30, 59):
        assert set(got[seq]) == {0}  # the metadata slot is not the open segment's
        assert bytes(got[seq][0]) == bytes(slots(seq)[0].ipc)
    wal.release(40)
    with pytest.raises(KeyError, match="not in the WAL"):
        wal.read_back([12])
    wal.close()


def test_read_back_still_finds_entries_after_the_active_file_was_rewritten(tmp_path):
    d = make_dirs(tmp_path)
    wal = open_wal(d)
    wal.punch_supported = False
    append(wal, 1, 40)
    wal.release(35)  # rewrite: the live tail moves to a new file, offsets shift
    got = wal.read_back([36, 40])
    assert bytes(got[40][0]) == bytes(slots(40)[0].ipc)
    wal.close()


def test_read_back_refuses_an_entry_damaged_since_it_was_written(tmp_path):
    d = make_dirs(tmp_path)
    wal = open_wal(d)
    append(wal, 1, 3)
    offset = wal._locate([2])[2][1]
    with open(d / "wal" / ACTIVE, "r+b") as f:
        f.seek(offset + 200)
        byte = f.read(1)
        f.seek(offset + 200)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptRecord, match="WAL entry 2 read back"):
        wal.read_back([1, 2])
    wal.close()
