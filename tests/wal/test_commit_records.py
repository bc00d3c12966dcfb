"""Commit records (SPEC §3, ``quiverd.wal.commits``): damage replay finds between sound
entries is loss only where a record shows an fdatasync had covered it.

Each test writes a real WAL with WalFiles, tears or damages entries the way a crash or
bit rot would (bytes overwritten in place, later entries left whole), and replays it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quiverd.kernel.layout import ACTIVE_WAL as ACTIVE
from quiverd.runtime.loss import Coverage, find_loss
from quiverd.wal import commits
from quiverd.wal import format as walformat
from quiverd.wal.files import WalFiles
from quiverd.wal.replay import WalState, replay_wal
from tests.wal.test_files import HASH, MAX_ENTRY, Log, make_dirs, open_wal, slots


def write(wal: WalFiles, first: int, n: int, *, sync: bool) -> None:
    """Entries ``first..first+n-1`` in one batch (one writev), synced or not."""
    entries = []
    for seq in range(first, first + n):
        s = slots(seq)
        entries.append((seq, (seq * 10, s), walformat.entry_size(s)))
    assert wal.fitting_prefix([e[2] for e in entries]) == n
    wal.append(entries, sync=sync)


def offsets(d: Path) -> dict[int, tuple[int, int]]:
    """(offset, length) of each sound bundle entry in the active file, by sequence."""
    raw = (d / "wal" / ACTIVE).read_bytes()
    out, pos = {}, walformat.HEADER_LEN
    while pos < len(raw):
        e = walformat.decode_entry(raw, pos, max_entry_bytes=MAX_ENTRY)
        if e.entry_type == walformat.ENTRY_RECORD_BUNDLE:
            out[e.sequence] = (pos, e.total_len)
        pos += e.total_len
    return out


def tear(d: Path, seq: int, where: dict[int, tuple[int, int]] | None = None) -> None:
    """Overwrite the middle of entry ``seq`` (its frame stays, its CRC fails)."""
    at, length = (where or offsets(d))[seq]
    with open(d / "wal" / ACTIVE, "r+b") as f:
        f.seek(at + length // 2)
        f.write(b"\x5a" * 64)


def replay(d: Path) -> WalState:
    """As recovery replays (no segments here: coverage is empty)."""
    return replay_wal(d / "wal", d / "q", cfg_hash=HASH, max_entry_bytes=MAX_ENTRY, log=Log(),
                      covered=Coverage([], 0))


def lost(state: WalState) -> list[tuple[int, int]]:
    return find_loss(segments=[], deleted_sequence=0,
                     wal_sequences=(e.sequence for e in state.entries), gone={},
                     never_acked=state.never_acked).sequences


@pytest.fixture
def d(tmp_path: Path) -> Path:
    return make_dirs(tmp_path)


def test_a_torn_unsynced_entry_between_sound_ones_is_not_loss(d: Path) -> None:
    wal = open_wal(d)
    write(wal, 1, 2, sync=True)  # 1..2 acked
    write(wal, 3, 3, sync=False)  # 3..5 written, the power goes before their fdatasync
    wal.close()
    tear(d, 3)  # the disk kept 4 and 5 whole, tore 3
    state = replay(d)
    assert [e.sequence for e in state.entries] == [1, 2, 4, 5]
    assert (state.lost_sequences, state.never_acked) == ([], [(3, 3)])
    assert lost(state) == []


def test_damage_to_a_synced_entry_is_loss(d: Path) -> None:
    wal = open_wal(d)
    write(wal, 1, 3, sync=True)
    write(wal, 4, 1, sync=True)  # its batch records that 1..3 were synced
    wal.close()
    tear(d, 2)
    state = replay(d)
    assert (state.lost_sequences, state.never_acked) == ([(2, 2)], [])
    assert lost(state) == [(2, 2)]


def test_the_last_batch_is_vouched_for_by_the_idle_and_the_closing_record(d: Path) -> None:
    """No batch follows the last one: the record written once the writer is idle (or,
    synced, when it stops) is what makes damage to it loss, not a torn write."""
    for closing in (False, True):
        root = d / ("closing" if closing else "idle")
        make_dirs(root.mkdir() or root)
        wal = open_wal(root)
        write(wal, 1, 3, sync=True)
        assert wal.commit_idle(sync=closing)
        assert not wal.commit_idle()  # nothing moved since: no second record
        wal.close()
        tear(root, 2)
        state = replay(root)
        assert (state.lost_sequences, state.never_acked) == ([(2, 2)], []), closing


def test_a_wal_without_records_reports_every_skipped_entry_lost(d: Path) -> None:
    """A WAL from before commit records (or written under flush policy "never"): no
    record speaks for the damage, so it is loss, as it always was."""
    wal = open_wal(d)
    wal.commits = False
    write(wal, 1, 2, sync=True)
    write(wal, 3, 3, sync=False)
    wal.close()
    tear(d, 3)
    state = replay(d)
    assert (state.lost_sequences, state.never_acked) == ([(3, 3)], [])


def test_a_later_life_never_vouches_for_damage_an_earlier_one_left(d: Path) -> None:
    """After a restart the new writer's records cover only its own entries: the torn
    entry of the first life stays never acknowledged at every later start."""
    wal = open_wal(d)
    write(wal, 1, 2, sync=True)
    write(wal, 3, 3, sync=False)
    wal.close()
    tear(d, 3)
    for life in range(2):
        state = replay(d)
        assert (state.lost_sequences, state.never_acked) == ([], [(3, 3)]), life
        wal = WalFiles.open(d / "wal", state, cfg_hash=HASH, max_size_bytes=1 << 30,
                            max_chunks=10, log=Log())
        # As recovery does: the new life vouches for nothing replay found torn.
        wal.begin(state.next_sequence - 1,
                  vouch_above=max((hi for _, hi in state.never_acked), default=0))
        first = state.next_sequence
        write(wal, first, 2, sync=True)
        write(wal, first + 2, 1, sync=True)
        wal.commit_idle(sync=True)
        wal.close()


def test_the_record_right_before_the_first_live_entry_is_read(d: Path) -> None:
    """A release puts the replay start at a batch's first entry, just after its record
    (and never punches that record out)."""
    wal = open_wal(d)
    write(wal, 1, 2, sync=True)
    write(wal, 3, 4, sync=False)  # its record says 1..2 were synced
    where = offsets(d)
    wal.release(2)
    wal.close()
    tear(d, 4, where)
    state = replay(d)
    assert state.start_offset == where[3][0]
    assert (state.lost_sequences, state.never_acked) == ([], [(4, 4)])


def test_records_inside_skipped_damage_still_count(d: Path) -> None:
    """Damage that hides a record (a resync skips over it) must not hide that the
    entries before it were synced."""
    wal = open_wal(d)
    write(wal, 1, 2, sync=True)
    write(wal, 3, 1, sync=True)  # record: 1..2 synced
    write(wal, 4, 1, sync=True)  # record: 1..3 synced
    write(wal, 5, 1, sync=True)
    wal.close()
    at3, _ = offsets(d)[3]
    at4, len4 = offsets(d)[4]
    # Entry 3's length and entry 4 are shredded, the record between them left whole.
    with open(d / "wal" / ACTIVE, "r+b") as f:
        f.seek(at3)
        f.write(b"\xff" * 8)
        f.seek(at4 + 8)
        f.write(b"\xff" * (len4 - 16))
    raw = (d / "wal" / ACTIVE).read_bytes()
    assert (0, 3) in commits.found_in(raw, at3, at4 + len4)
    state = replay(d)
    assert [e.sequence for e in state.entries] == [1, 2, 5]
    assert (state.lost_sequences, state.never_acked) == ([(3, 4)], [])


def test_split_unsynced() -> None:
    split = commits.split_unsynced
    assert split([(2, 3)], []) == ([(2, 3)], [])  # no record: loss
    assert split([(2, 3), (9, 12)], [(0, 1), (0, 10)]) == ([(2, 3), (9, 10)], [(11, 12)])
    # Records of a life that began at 4 say nothing of 2..3 (an earlier life's damage).
    assert split([(2, 3), (6, 8)], [(4, 6)]) == ([(2, 3), (6, 6)], [(7, 8)])


def test_records_cost_33_bytes_per_batch_and_capacity_counts_them(d: Path) -> None:
    wal = open_wal(d)
    size = walformat.entry_size(slots(1))
    write(wal, 1, 1, sync=True)
    before = wal.end_offset
    write(wal, 2, 1, sync=True)
    assert wal.end_offset - before == size + walformat.COMMIT_LEN
    write(wal, 3, 1, sync=False)  # the frontier moved by 2's sync: a record again
    end = wal.end_offset
    write(wal, 4, 1, sync=False)  # nothing synced since: no record
    assert wal.end_offset - end == size
    assert os.path.getsize(d / "wal" / ACTIVE) == wal.end_offset
    wal.close()


def test_a_fresh_wal_whose_first_batches_tore_reports_no_loss(d: Path) -> None:
    """The crash-state tool's case: nothing was ever synced, the first batch tore and a
    later one survived. The life's first record was synced on its own before it."""
    wal = open_wal(d)
    write(wal, 1, 4, sync=False)
    write(wal, 5, 2, sync=False)
    wal.close()
    where = offsets(d)
    for seq in range(1, 5):
        tear(d, seq, where)
    state = replay(d)
    assert [e.sequence for e in state.entries] == [5, 6]
    assert (state.lost_sequences, state.never_acked) == ([], [(1, 4)])
    assert lost(state) == []


@pytest.mark.parametrize("synced", [False, True])
def test_fsck_predicts_what_replay_reports(tmp_path: Path, synced: bool) -> None:
    """``quiverd fsck`` walks the WAL by replay's rule: torn unsynced entries are no
    LOST line; damage to synced ones is."""
    from quiverd.cli.fsck import _Progress, check_data_dir

    shard = tmp_path / "shard-0"
    for sub in ("wal", "q", "segments", "quarantine"):
        (shard / sub).mkdir(parents=True)
    wal = open_wal(shard)
    write(wal, 1, 2, sync=True)
    write(wal, 3, 3, sync=synced)
    write(wal, 6, 1, sync=True)  # its record: 1..5 synced, if they were
    wal.close()
    tear(shard, 3)
    report, _ = check_data_dir([shard], _Progress(None))
    assert [(s.sequences, s.count) for s in report.lost] == ([([(3, 3)], 1)] if synced else [])
