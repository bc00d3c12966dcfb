"""WAL replay against real files: torn tails, corruption, sidecars, rotation, dump."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import MetaCodec, Slot, make_slot
from quiverd.kernel.errors import CorruptRecord, FormatMismatch
from quiverd.runtime.loss import Coverage
from quiverd.wal import dump as waldump
from quiverd.wal import format as wf
from quiverd.wal import replay as wr
from quiverd.wal.resync import find_sound_entry

MAX = 1 << 20
FP = b"\x11" * 32


class RecordingLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _add(self, level: str, event: str, **kw: Any) -> None:
        self.events.append((level, event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self._add("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._add("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._add("error", event, **kw)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kw for _, e, kw in self.events if e == event]


def small_entry(seq: int, payload: bytes = b"payload-bytes", entry_type: int = 0) -> bytes:
    slot = Slot(slot=1, fingerprint=FP, row_count=seq, ipc=payload + seq.to_bytes(4, "little"))
    pieces = wf.encode_entry(ts_ns=1000 + seq, sequence=seq, slots=[slot], entry_type=entry_type)
    return b"".join(pieces)


def write_wal(path: Path, entries: list[bytes], cfg: bytes = wf.DEFAULT_CFG_HASH) -> list[int]:
    """Write header + entries; returns each entry's offset."""
    offsets, pos = [], wf.HEADER_LEN
    for e in entries:
        offsets.append(pos)
        pos += len(e)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wf.encode_header(cfg) + b"".join(entries))
    return offsets


def replay(root: Path, log: RecordingLog | None = None, max_entry: int = MAX,
           covered: Coverage | None = None) -> wr.WalState:
    return wr.replay_wal(
        root / "wal", root / "quarantine", cfg_hash=wf.DEFAULT_CFG_HASH,
        max_entry_bytes=max_entry, log=log or RecordingLog(), covered=covered,
    )


def segments_holding(first: int, last: int) -> Coverage:
    """What durable segments holding sequences ``first..last`` tell replay."""
    return Coverage([SimpleNamespace(segment_seq=1, first_sequence=first, last_sequence=last)], 0)


def seqs(state: wr.WalState) -> list[int]:
    return [e.sequence for e in state.entries]


def test_replay_creates_header_for_brand_new_wal(tmp_path: Path) -> None:
    state = replay(tmp_path)
    active = tmp_path / "wal" / "quiver.wal"
    assert active.read_bytes() == wf.encode_header(wf.DEFAULT_CFG_HASH)
    assert state.entries == [] and state.next_sequence == 1 and state.sequence_known
    assert (state.active_generation, state.active_end_offset) == (0, wf.HEADER_LEN)


def test_replay_payloads_identical_to_written(tmp_path: Path) -> None:
    codec = MetaCodec()
    bundles = []
    for seq in range(1, 6):
        table = pa.table({"x": list(range(seq)), "s": ["a" * seq] * seq})
        bundles.append([make_slot(0, table), make_slot(5, table), codec.encode("client-a", None)])
    entries = [
        b"".join(wf.encode_entry(ts_ns=seq * 7, sequence=seq, slots=slots))
        for seq, slots in enumerate(bundles, start=1)
    ]
    offsets = write_wal(tmp_path / "wal" / "quiver.wal", entries)
    state = replay(tmp_path)
    assert seqs(state) == [1, 2, 3, 4, 5] and state.next_sequence == 6
    assert [e.offset for e in state.entries] == offsets
    assert [e.ts_ns for e in state.entries] == [7, 14, 21, 28, 35]
    for entry, slots in zip(state.entries, bundles, strict=True):
        assert [(s.slot, s.fingerprint, s.row_count, bytes(s.ipc)) for s in entry.slots] == \
            [(s.slot, s.fingerprint, s.row_count, bytes(s.ipc)) for s in slots]
        # User slots: views of the mapped file with what the open segment needs, so it
        # can leave their bytes in the WAL; the metadata slot is a copy.
        user, meta = entry.slots[:-1], entry.slots[-1]
        assert all(isinstance(s.ipc, memoryview) and s.batches == 1 for s in user)
        assert all(s.schema.equals(pa.ipc.read_schema(pa.py_buffer(bytes(s.ipc))))
                   for s in user)
        assert type(meta.ipc) is bytes and meta.schema is None
    assert state.active_end_offset == (tmp_path / "wal" / "quiver.wal").stat().st_size


def test_replay_torn_tail_cut_at_every_byte_of_last_entry(tmp_path: Path) -> None:
    good = [small_entry(1), small_entry(2)]
    last = small_entry(3)
    good_end = wf.HEADER_LEN + sum(map(len, good))
    for cut in range(1, len(last)):
        root = tmp_path / str(cut)
        wal = root / "wal" / "quiver.wal"
        write_wal(wal, [*good, last[:cut]])
        log = RecordingLog()
        state = replay(root, log)
        assert seqs(state) == [1, 2], cut
        assert state.torn_tail_bytes == cut and state.next_sequence == 3
        assert wal.stat().st_size == good_end == state.active_end_offset
        assert state.quarantined == [root / "quarantine" / f"quiver.wal.0.{good_end}.torn"]
        assert state.quarantined[0].read_bytes() == last[:cut]
        assert log.named("wal_torn_tail")[0]["offset"] == good_end
        assert log.named("wal_torn_tail")[0]["bytes"] == cut


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(b"\xde\xad\xbe\xef" * 50, id="garbage"),
        pytest.param(b"\0" * 4096, id="zero_filled"),
        pytest.param(struct.pack("<I", 5000) + b"x" * 100, id="length_beyond_eof"),
        pytest.param(struct.pack("<I", 3) + b"abc" + b"\0" * 4, id="length_below_fixed"),
    ],
)
def test_replay_bad_tail_is_quarantined_and_cut(tmp_path: Path, tail: bytes) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    write_wal(wal, [small_entry(1), small_entry(2)])
    good_end = wal.stat().st_size
    wal.write_bytes(wal.read_bytes() + tail)
    state = replay(tmp_path)
    assert seqs(state) == [1, 2] and state.torn_tail_bytes == len(tail)
    assert wal.stat().st_size == good_end
    assert state.quarantined[0].read_bytes() == tail


def test_replay_length_above_max_is_corruption(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    big = small_entry(2, payload=b"B" * 500)
    offsets = write_wal(wal, [small_entry(1), big])
    state = replay(tmp_path, max_entry=200)
    assert seqs(state) == [1] and state.torn_tail_bytes == len(big)
    assert wal.stat().st_size == offsets[1]


def test_replay_interior_crc_flip_skips_entry_and_keeps_successors(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    entries = [small_entry(s) for s in range(1, 6)]
    offsets = write_wal(wal, entries)
    raw = bytearray(wal.read_bytes())
    raw[offsets[2] + 40] ^= 0x20
    wal.write_bytes(raw)
    log = RecordingLog()
    state = replay(tmp_path, log)
    assert seqs(state) == [1, 2, 4, 5] and state.next_sequence == 6
    assert state.corrupt_entries == 1 and state.sequence_gaps == 0
    assert state.torn_tail_bytes == 0 and wal.stat().st_size == len(raw)
    corrupt = tmp_path / "quarantine" / f"quiver.wal.0.{offsets[2]}.corrupt"
    assert state.quarantined == [corrupt]
    assert corrupt.read_bytes() == bytes(raw[offsets[2] : offsets[3]])
    assert log.named("wal_corrupt_entry_skipped")[0]["sequence"] == 3


def test_replay_crc_flip_without_valid_successor_is_torn_tail(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 4)])
    raw = bytearray(wal.read_bytes())
    raw[-1] ^= 0xFF  # the last entry's crc
    wal.write_bytes(raw)
    state = replay(tmp_path)
    assert seqs(state) == [1, 2] and state.corrupt_entries == 0
    assert wal.stat().st_size == offsets[2]


def test_replay_interior_length_past_eof_resyncs_and_keeps_later_entries(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 101)])
    raw = bytearray(wal.read_bytes())
    raw[offsets[29] : offsets[29] + 4] = struct.pack("<I", len(raw))  # entry 30 ends past EOF
    wal.write_bytes(raw)
    skipped = tmp_path / "quarantine" / f"quiver.wal.0.{offsets[29]}.skipped"
    for _ in range(2):  # a rerun finds the same, rewrites the same copy
        log = RecordingLog()
        state = replay(tmp_path, log)
        assert seqs(state) == [*range(1, 30), *range(31, 101)] and state.next_sequence == 101
        assert state.corrupt_entries == 1 and state.lost_sequences == [(30, 30)]
        assert state.torn_tail_bytes == 0 and wal.read_bytes() == raw
        assert state.quarantined == [skipped]
        assert skipped.read_bytes() == raw[offsets[29] : offsets[30]]
        assert log.named("wal_entries_lost") == [{"generation": 0, "resumed_at": offsets[30],
                                                  "entries": 1, "first_sequence": 30,
                                                  "last_sequence": 30}]
        assert not log.named("wal_torn_tail")
    assert [p.name for p in (tmp_path / "quarantine").iterdir()] == [skipped.name]


def test_replay_sidecar_inside_an_entry_keeps_the_entries_after_it(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 11)])
    wr.write_sidecar(tmp_path / "wal", offsets[4] + 7, 0)  # a valid sidecar, inside entry 5
    raw = wal.read_bytes()
    state = replay(tmp_path, covered=segments_holding(1, 4))
    assert seqs(state) == list(range(6, 11)) and state.torn_tail_bytes == 0
    assert state.lost_sequences == [(5, 5)] and state.corrupt_entries == 1
    assert wal.read_bytes() == raw
    state = replay(tmp_path, covered=segments_holding(1, 5))  # a segment holds 5: no loss
    assert seqs(state) == list(range(6, 11))
    assert state.lost_sequences == [] and state.corrupt_entries == 0


def test_replay_damaged_end_of_rotated_file_is_skipped_not_cut(tmp_path: Path) -> None:
    wal_dir = tmp_path / "wal"
    offsets = write_wal(wal_dir / "quiver.wal.0", [small_entry(s) for s in (1, 2, 3)])
    rotated = wal_dir / "quiver.wal.0"
    raw = bytearray(rotated.read_bytes())
    raw[-1] ^= 0xFF  # entry 3's crc: rotation fsynced the file whole, so no torn write
    rotated.write_bytes(raw)
    write_wal(wal_dir / "quiver.wal", [small_entry(4), small_entry(5)])
    log = RecordingLog()
    state = replay(tmp_path, log)
    assert seqs(state) == [1, 2, 4, 5] and state.torn_tail_bytes == 0
    assert state.corrupt_entries == 1 and state.lost_sequences == [(3, 3)]
    assert rotated.read_bytes() == raw and state.rotated[0].size == len(raw)
    copy = tmp_path / "quarantine" / f"quiver.wal.0.{offsets[2]}.skipped"
    assert copy.read_bytes() == raw[offsets[2] :] and not log.named("wal_torn_tail")


def test_replay_skipped_sequences_segments_hold_are_not_lost(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 121)])
    raw = bytearray(wal.read_bytes())
    raw[4096:8192] = bytes(4096)  # a punched hole, walked because the sidecar is lost
    wal.write_bytes(raw)
    size = len(small_entry(1))
    last_before = max(i + 1 for i, off in enumerate(offsets) if off + size <= 4096)
    first_after = next(i + 1 for i, off in enumerate(offsets) if off >= 8192)
    state = replay(tmp_path, covered=segments_holding(1, first_after - 1))
    assert state.corrupt_entries == 0 and state.lost_sequences == []
    assert seqs(state) == [*range(1, last_before + 1), *range(first_after, 121)]
    state = replay(tmp_path, covered=segments_holding(1, 10))  # the WAL released no more
    assert state.lost_sequences == [(last_before + 1, first_after - 1)]
    assert state.corrupt_entries == first_after - 1 - last_before


def test_find_sound_entry_skips_stale_entries_below_after_sequence() -> None:
    garbage = b"\xee" * 50
    data = garbage + small_entry(3) + garbage + small_entry(9)
    stale, fresh = len(garbage), 2 * len(garbage) + len(small_entry(3))
    assert find_sound_entry(data, 0, MAX) == stale
    assert find_sound_entry(data, 0, MAX, after_sequence=5) == fresh
    assert find_sound_entry(data, 0, MAX, after_sequence=9) is None
    assert find_sound_entry(bytes(10_000) + data, 0, MAX, after_sequence=8) == 10_000 + fresh


def test_replay_unknown_entry_type_skipped_by_length(tmp_path: Path) -> None:
    write_wal(
        tmp_path / "wal" / "quiver.wal",
        [small_entry(1), small_entry(0, entry_type=7), small_entry(2),
         small_entry(0, entry_type=1)],
    )
    log = RecordingLog()
    state = replay(tmp_path, log)
    assert seqs(state) == [1, 2] and state.sequence_gaps == 0
    assert [kw["entry_type"] for kw in log.named("wal_unknown_entry_skipped")] == [7, 1]


@pytest.mark.parametrize(
    ("header", "error", "words"),
    [
        (b"QUIVER\0BAD" + struct.pack("<HH", 1, 0) + wf.DEFAULT_CFG_HASH, CorruptRecord, "magic"),
        (b"QUIVER\0WAL" + struct.pack("<HH", 9, 0) + wf.DEFAULT_CFG_HASH, FormatMismatch,
         "unknown WAL version 9"),
        (b"QUIVER\0WAL" + struct.pack("<HH", 1, 1) + wf.DEFAULT_CFG_HASH, FormatMismatch,
         "reserved"),
        (wf.encode_header(wf.cfg_hash("another layout")), FormatMismatch, "cfg hash mismatch"),
        (b"QUIVER\0", CorruptRecord, "shorter than"),
    ],
)
def test_replay_refuses_bad_header_without_rewriting(
    tmp_path: Path, header: bytes, error: type[Exception], words: str
) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    wal.parent.mkdir()
    content = header + small_entry(1) if len(header) == wf.HEADER_LEN else header
    wal.write_bytes(content)
    with pytest.raises(error, match=words):
        replay(tmp_path)
    assert wal.read_bytes() == content


def test_replay_starts_at_sidecar_offset(tmp_path: Path) -> None:
    offsets = write_wal(tmp_path / "wal" / "quiver.wal", [small_entry(s) for s in range(1, 5)])
    wr.write_sidecar(tmp_path / "wal", offsets[2], 0)
    state = replay(tmp_path)
    assert seqs(state) == [3, 4] and (state.start_generation, state.start_offset) == (0, offsets[2])


@pytest.mark.parametrize("damage", ["missing", "corrupt", "out_of_range", "unknown_generation"])
def test_replay_bad_sidecar_falls_back_to_file_start(tmp_path: Path, damage: str) -> None:
    wal_dir = tmp_path / "wal"
    offsets = write_wal(wal_dir / "quiver.wal", [small_entry(s) for s in range(1, 4)])
    sidecar = wal_dir / "truncate.offset"
    if damage == "corrupt":
        raw = bytearray(wf.encode_sidecar(offsets[1], 0))
        raw[15] ^= 1
        sidecar.write_bytes(raw)
    elif damage == "out_of_range":
        wr.write_sidecar(wal_dir, 1 << 40, 0)
    elif damage == "unknown_generation":
        write_wal(wal_dir / "quiver.wal.3", [small_entry(1), small_entry(2), small_entry(3)])
        (wal_dir / "quiver.wal").unlink()
        write_wal(wal_dir / "quiver.wal", [small_entry(4)])
        wr.write_sidecar(wal_dir, offsets[1], 1)
    log = RecordingLog()
    state = replay(tmp_path, log)
    assert seqs(state)[:3] == [1, 2, 3]
    assert state.start_offset == wf.HEADER_LEN
    assert any(e.startswith("wal_sidecar") for _, e, _ in log.events)


def test_replay_rotated_files_in_generation_order(tmp_path: Path) -> None:
    wal_dir = tmp_path / "wal"
    write_wal(wal_dir / "quiver.wal.10", [small_entry(s) for s in (4, 5, 6)])
    write_wal(wal_dir / "quiver.wal.9", [small_entry(s) for s in (1, 2, 3)])
    write_wal(wal_dir / "quiver.wal", [small_entry(s) for s in (7, 8)])
    state = replay(tmp_path)
    assert seqs(state) == list(range(1, 9)) and state.sequence_gaps == 0
    assert [e.generation for e in state.entries] == [9, 9, 9, 10, 10, 10, 11, 11]
    assert state.active_generation == 11 and state.next_sequence == 9
    assert [(f.generation, f.size) for f in state.rotated] == [
        (9, (wal_dir / "quiver.wal.9").stat().st_size),
        (10, (wal_dir / "quiver.wal.10").stat().st_size),
    ]


def test_replay_sidecar_in_rotated_file_skips_older_files(tmp_path: Path) -> None:
    wal_dir = tmp_path / "wal"
    write_wal(wal_dir / "quiver.wal.0", [small_entry(s) for s in (1, 2)])
    offsets = write_wal(wal_dir / "quiver.wal.1", [small_entry(s) for s in (3, 4)])
    write_wal(wal_dir / "quiver.wal", [small_entry(5)])
    wr.write_sidecar(wal_dir, offsets[1], 1)
    state = replay(tmp_path)
    assert seqs(state) == [4, 5] and state.active_generation == 2


def test_replay_active_generation_from_sidecar_when_no_rotated_files(tmp_path: Path) -> None:
    offsets = write_wal(tmp_path / "wal" / "quiver.wal", [small_entry(s) for s in (8, 9)])
    wr.write_sidecar(tmp_path / "wal", offsets[1], 5)
    state = replay(tmp_path)
    assert state.active_generation == 5 and seqs(state) == [9] and state.next_sequence == 10


def test_replay_fully_truncated_wal_reports_unknown_sequence(tmp_path: Path) -> None:
    write_wal(tmp_path / "wal" / "quiver.wal", [small_entry(1)])
    end = (tmp_path / "wal" / "quiver.wal").stat().st_size
    wr.write_sidecar(tmp_path / "wal", end, 0)
    state = replay(tmp_path)
    assert state.entries == [] and not state.sequence_known


def test_replay_logs_sequence_gap_across_rotation(tmp_path: Path) -> None:
    wal_dir = tmp_path / "wal"
    write_wal(wal_dir / "quiver.wal.0", [small_entry(1), small_entry(2)])
    write_wal(wal_dir / "quiver.wal", [small_entry(4)])
    log = RecordingLog()
    state = replay(tmp_path, log)
    assert seqs(state) == [1, 2, 4] and state.sequence_gaps == 1
    assert log.named("wal_sequence_gap") == [
        {"generation": 1, "offset": wf.HEADER_LEN, "expected": 3, "sequence": 4}
    ]


def test_replay_skips_punched_hole_when_sidecar_lost(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    entries = [small_entry(s) for s in range(1, 5)]
    offsets = write_wal(wal, entries)
    raw = bytearray(wal.read_bytes())
    raw[wf.HEADER_LEN : offsets[2]] = bytes(offsets[2] - wf.HEADER_LEN)  # as fallocate punches
    wal.write_bytes(raw)
    state = replay(tmp_path)
    assert seqs(state) == [3, 4] and state.torn_tail_bytes == 0
    assert wal.stat().st_size == len(raw)


def test_replay_quarantine_is_idempotent(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    write_wal(wal, [small_entry(1)])
    intact = wal.read_bytes()
    torn = small_entry(2)[:20]
    for _ in range(2):
        wal.write_bytes(intact + torn)  # as if the first replay died before truncating
        state = replay(tmp_path)
        assert seqs(state) == [1]
    assert [p.name for p in (tmp_path / "quarantine").iterdir()] == [
        f"quiver.wal.0.{len(intact)}.torn"
    ]


def test_replay_empty_active_file_gets_header(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    wal.parent.mkdir()
    wal.write_bytes(b"")
    replay(tmp_path)
    assert wal.read_bytes() == wf.encode_header(wf.DEFAULT_CFG_HASH)


def test_dump_wal_lists_entries_and_torn_tail_without_modifying(tmp_path: Path) -> None:
    wal = tmp_path / "quiver.wal"
    offsets = write_wal(wal, [small_entry(1), small_entry(2), small_entry(3)[:10]])
    raw = bytearray(wal.read_bytes())
    raw[offsets[1] + 30] ^= 1
    wal.write_bytes(raw)
    rows = list(waldump.dump_wal(wal))
    assert rows[0]["kind"] == "header" and rows[0]["cfg_hash_is_default"]
    assert rows[1] == {
        "kind": "entry", "offset": offsets[0], "sequence": 1, "ts_ns": 1001, "entry_type": 0,
        "slots": [1], "rows": 1, "payload_bytes": 17, "bytes": offsets[1] - offsets[0],
        "crc": "ok", "problem": "",
    }
    # Entry 2 (bad CRC) has no sound successor: replay cuts it with the torn entry 3,
    # and the dump (fsck's prediction) says the same.
    assert rows[2]["kind"] == "torn_tail" and rows[2]["offset"] == offsets[1]
    assert rows[2]["bytes"] == len(raw) - offsets[1] and len(rows) == 3
    assert wal.read_bytes() == raw


def test_replay_resyncs_after_block_aligned_hole_when_sidecar_lost(tmp_path: Path) -> None:
    wal = tmp_path / "wal" / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 121)])
    raw = bytearray(wal.read_bytes())
    raw[4096:8192] = bytes(4096)  # what fallocate(PUNCH_HOLE) leaves on 4 KiB blocks
    wal.write_bytes(raw)
    log = RecordingLog()
    state = replay(tmp_path, log)
    before = [i + 1 for i, off in enumerate(offsets) if off + 92 <= 4096]
    after = [i + 1 for i, off in enumerate(offsets) if off >= 8192]
    assert seqs(state) == before + after
    assert state.torn_tail_bytes == 0 and wal.stat().st_size == len(raw)
    assert state.sequence_gaps == 1 and log.named("wal_damage_skipped")
    skipped = tmp_path / "quarantine" / f"quiver.wal.0.{offsets[len(before)]}.skipped"
    resumed = offsets[after[0] - 1]
    assert skipped.read_bytes() == bytes(raw[offsets[len(before)] : resumed])
    assert state.resynced_bytes == resumed - offsets[len(before)]


def _punchable(directory: Path) -> bool:
    from quiverd.wal.files import probe_punch_hole

    return probe_punch_hole(directory)


def test_dump_wal_punched_prefix_with_sidecar_lists_only_live_entries(tmp_path: Path) -> None:
    import os

    from quiverd.wal.files import BLOCK, punch_hole

    if not _punchable(tmp_path):
        pytest.skip("filesystem cannot punch holes")
    wal = tmp_path / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 201)])
    keep = offsets[150]  # sequence 151 is the first entry no segment holds
    wr.write_sidecar(tmp_path, keep, 0)
    fd = os.open(wal, os.O_RDWR)
    try:
        begin, end = BLOCK, keep // BLOCK * BLOCK
        punch_hole(fd, begin, end - begin)
    finally:
        os.close(fd)
    raw = wal.read_bytes()
    assert end - begin >= BLOCK and raw[begin:end] == bytes(end - begin)
    rows = list(waldump.dump_wal(wal))
    assert rows[1] == {"kind": "released", "offset": wf.HEADER_LEN, "bytes": keep - wf.HEADER_LEN,
                       "message": "released to segments (space reclaimed)"}
    entries = rows[2:]
    assert [r["sequence"] for r in entries] == list(range(151, 201))
    assert all(r["kind"] == "entry" and r["crc"] == "ok" for r in entries)
    assert entries[0]["offset"] == keep
    assert wal.read_bytes() == raw


def test_dump_wal_rotated_file_below_sidecar_generation_is_one_released_row(
    tmp_path: Path,
) -> None:
    write_wal(tmp_path / "quiver.wal.0", [small_entry(s) for s in (1, 2)])
    offsets = write_wal(tmp_path / "quiver.wal.1", [small_entry(s) for s in (3, 4)])
    write_wal(tmp_path / "quiver.wal", [small_entry(5)])
    wr.write_sidecar(tmp_path, offsets[1], 1)
    old = list(waldump.dump_wal(tmp_path / "quiver.wal.0"))
    size = (tmp_path / "quiver.wal.0").stat().st_size
    assert [r["kind"] for r in old] == ["header", "released"]
    assert old[1]["bytes"] == size - wf.HEADER_LEN
    current = list(waldump.dump_wal(tmp_path / "quiver.wal.1"))
    assert [r.get("sequence") for r in current if r["kind"] == "entry"] == [4]
    active = list(waldump.dump_wal(tmp_path / "quiver.wal"))  # generation 2: after the sidecar's
    assert [r["kind"] for r in active] == ["header", "entry"]


def test_dump_wal_hole_without_sidecar_is_not_torn_tail(tmp_path: Path) -> None:
    wal = tmp_path / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 121)])
    raw = bytearray(wal.read_bytes())
    raw[4096:8192] = bytes(4096)
    wal.write_bytes(raw)
    rows = list(waldump.dump_wal(wal))
    kinds = [r["kind"] for r in rows]
    assert "torn_tail" not in kinds and "released" not in kinds
    # The entry the hole's start cut begins damage that runs, hole included, up to the
    # next sound entry after it: replay never trusts a damaged entry's length, and the
    # dump walks by replay's rule.
    [cut] = [r for r in rows if r["kind"] == "skipped"]
    assert cut["offset"] in offsets and 4096 - 92 < cut["offset"] < 4096
    resumed = cut["offset"] + cut["bytes"]
    assert resumed in offsets and 8192 <= resumed < 8192 + 92
    entries = [r["sequence"] for r in rows if r["kind"] == "entry"]
    assert entries == [s for s in range(1, 121) if offsets[s - 1] < cut["offset"]
                       or offsets[s - 1] >= resumed]
    assert entries[-1] == 120 and all(r.get("crc", "ok") == "ok" for r in rows)


def test_dump_wal_garbage_before_sound_entry_is_skipped_row(tmp_path: Path) -> None:
    wal = tmp_path / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 4)])
    for length in (b"\xff\xff\xff\x7f", struct.pack("<I", 2)):  # far past EOF; below the header
        raw = bytearray(wal.read_bytes())
        raw[offsets[1] : offsets[1] + 4] = length
        wal.write_bytes(raw)
        rows = list(waldump.dump_wal(wal))
        assert [r["kind"] for r in rows] == ["header", "entry", "skipped", "entry"], length
        assert rows[2]["offset"] == offsets[1] and rows[2]["bytes"] == offsets[2] - offsets[1]
        assert rows[3]["sequence"] == 3 and wal.read_bytes() == raw


def test_dump_wal_damaged_end_of_rotated_file_is_skipped_not_torn(tmp_path: Path) -> None:
    offsets = write_wal(tmp_path / "quiver.wal.0", [small_entry(1), small_entry(2)])
    rotated = tmp_path / "quiver.wal.0"
    rotated.write_bytes(rotated.read_bytes()[:-5])  # rotation fsynced it: damage, not a tear
    write_wal(tmp_path / "quiver.wal", [small_entry(3)])
    rows = list(waldump.dump_wal(rotated))
    assert [r["kind"] for r in rows] == ["header", "entry", "skipped"]
    assert rows[2]["offset"] == offsets[1] and "rotated" in rows[2]["message"]
    active = tmp_path / "quiver.wal"
    active.write_bytes(active.read_bytes()[:-5])
    assert [r["kind"] for r in waldump.dump_wal(active)] == ["header", "torn_tail"]


def test_dump_wal_ignores_sidecar_pointing_past_the_file(tmp_path: Path) -> None:
    wal = tmp_path / "quiver.wal"
    write_wal(wal, [small_entry(s) for s in (1, 2)])
    wr.write_sidecar(tmp_path, 1 << 30, 0)
    rows = list(waldump.dump_wal(wal))
    assert [r["kind"] for r in rows] == ["header", "entry", "entry"]


def test_replay_steps_over_real_punched_holes_unread_when_sidecar_lost(tmp_path: Path) -> None:
    """The holes are found by SEEK_HOLE and never read through the map (on a full tmpfs
    that read is SIGBUS: tests/daemon/test_disk_full_start.py); the live entries after
    them are kept and the skipped sequences are settled by what segments hold."""
    import os

    from quiverd.wal.files import BLOCK, punch_hole

    if not _punchable(tmp_path):
        pytest.skip("filesystem cannot punch holes")
    wal = tmp_path / "wal" / "quiver.wal"
    offsets = write_wal(wal, [small_entry(s) for s in range(1, 201)])
    keep = offsets[150]  # sequence 151 is the first entry no segment holds
    fd = os.open(wal, os.O_RDWR)
    try:
        punch_hole(fd, BLOCK, keep // BLOCK * BLOCK - BLOCK)  # no sidecar beside it
    finally:
        os.close(fd)
    log = RecordingLog()
    state = replay(tmp_path, log, covered=segments_holding(1, 150))
    [skipped] = log.named("wal_holes_skipped")
    assert skipped["offset"] == wf.HEADER_LEN and skipped["resumed_at"] == keep // BLOCK * BLOCK
    assert seqs(state) == list(range(151, 201))
    assert state.lost_sequences == [] and state.corrupt_entries == 0
