"""WalFiles.append on a real full filesystem: a batch cut short keeps its whole entries.

A small tmpfs (tests/daemon/mounts.py, root only) fills part-way through one batch.
The kernel writes what fits (a short writev), then refuses the rest with ENOSPC:
the entries that reached the file whole stay, ``WalNoSpace.written`` counts them,
the bytes of the cut one are gone, and replay reads exactly those entries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import MetaCodec, make_slot
from quiverd.kernel.layout import ACTIVE_WAL
from quiverd.wal import format as walformat
from quiverd.wal.files import EntryToWrite, WalFiles, WalNoSpace
from quiverd.wal.replay import WalState, replay_wal
from tests.daemon.mounts import fill, mounted_tmpfs

HASH = walformat.DEFAULT_CFG_HASH
MAX_ENTRY = 1 << 20
PAGE = 4096  # tmpfs allocates whole pages
BATCH = 8


class Log:
    def __getattr__(self, level: str):  # info/warning/error: accept anything
        return lambda *a, **k: None


def entry(seq: int) -> EntryToWrite:
    """~10 KiB: a few pages, so a page-granular tmpfs cuts inside an entry."""
    table = pa.table({"tag": [seq] * 200, "s": [f"{seq:040d}"] * 200})
    slots = (make_slot(0, table), MetaCodec().encode("c", None))
    return (seq, (seq * 10, slots), walformat.entry_size(slots))


ENTRY_BYTES = entry(1)[2]


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "fs", 1 << 20) as where:
        (where / "wal").mkdir()
        (where / "q").mkdir()
        yield where


def replay(fs: Path) -> WalState:
    return replay_wal(fs / "wal", fs / "q", cfg_hash=HASH, max_entry_bytes=MAX_ENTRY, log=Log())


def free_bytes(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def test_wal_append_cut_short_by_enospc_keeps_the_entries_written_whole(fs):
    wal = WalFiles.open(fs / "wal", replay(fs), cfg_hash=HASH, max_size_bytes=1 << 30,
                        max_chunks=4, log=Log())
    try:
        # Room for 3.5 entries: the batch of 8 is cut inside its 4th entry.
        fill(fs / "ballast", free_bytes(fs) - (7 * ENTRY_BYTES) // 2)
        room = free_bytes(fs) + (-wal.end_offset % PAGE)  # + the header page's tail
        with pytest.raises(WalNoSpace) as info:
            wal.append([entry(seq) for seq in range(1, BATCH + 1)], sync=False)
        kept = info.value.written
        # Exactly the entries that fit whole: none of them refused, none torn.
        assert kept * ENTRY_BYTES <= room < (kept + 1) * ENTRY_BYTES, (kept, room)
        assert 0 < kept < BATCH
        end = walformat.HEADER_LEN + kept * ENTRY_BYTES
        assert (wal.end_offset, wal.unreleased_entries) == (end, kept)
        assert os.path.getsize(fs / "wal" / ACTIVE_WAL) == end  # the cut entry's bytes gone
        wal.sync()
        state = replay(fs)
        assert [e.sequence for e in state.entries] == list(range(1, kept + 1))
        assert (state.torn_tail_bytes, state.corrupt_entries) == (0, 0)

        # Space back: the rest follows right behind them, no gap, no torn bytes between.
        os.unlink(fs / "ballast")
        wal.append([entry(seq) for seq in range(kept + 1, BATCH + 1)], sync=True)
    finally:
        wal.close()
    state = replay(fs)
    assert [e.sequence for e in state.entries] == list(range(1, BATCH + 1))
    assert (state.torn_tail_bytes, state.corrupt_entries) == (0, 0)
