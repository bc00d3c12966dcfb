"""quiverd fsck against real data directories: healthy, damaged, repaired, locked."""

from __future__ import annotations

import fcntl
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from quiverd.acks import format as af
from quiverd.acks.log import AckLogFile
from quiverd.cli import fsck
from quiverd.cli import main as cli
from quiverd.kernel.bundle import Bundle, MetaCodec, make_slot
from quiverd.kernel.errors import AlreadyRunning
from quiverd.segments.files import write_segment
from quiverd.segments.format import encode_segment
from quiverd.segments.open_segment import OpenSegment
from quiverd.wal import format as wf
from quiverd.wal import replay as wr
from quiverd.wal.dump import dump_wal as wr_dump
from quiverd.wal.files import BLOCK, probe_punch_hole, punch_hole

SEGMENT_NAME = f"{1:016d}.qseg"


def table(seq: int) -> pa.Table:
    return pa.table({"x": list(range(seq, seq + 3)), "s": [f"v{seq}"] * 3})


def append_entries(wal: Path, seqs: range) -> list[int]:
    """Append real WAL entries (a data slot plus the metadata slot); returns their offsets."""
    codec = MetaCodec()
    offsets = []
    with open(wal, "ab") as f:
        for seq in seqs:
            offsets.append(f.tell())
            slots = [make_slot(0, table(seq)), codec.encode("app", None)]
            f.write(b"".join(wf.encode_entry(ts_ns=1_000 + seq, sequence=seq, slots=slots)))
    return offsets


def build_data_dir(root: Path, *, wal_entries: int = 5, segment_bundles: int = 3) -> Path:
    """shard-0: a segment holding sequences 1..3, a WAL with 1..5 and a sidecar at 4."""
    shard = root / "shard-0"
    wal_dir, seg_dir = shard / "wal", shard / "segments"
    wal_dir.mkdir(parents=True)
    seg_dir.mkdir()
    wr.create_wal_file(wal_dir / "quiver.wal", wf.DEFAULT_CFG_HASH)
    offsets = append_entries(wal_dir / "quiver.wal", range(1, wal_entries + 1))
    wr.write_sidecar(wal_dir, offsets[segment_bundles], 0)
    segment = OpenSegment()
    for seq in range(1, segment_bundles + 1):
        segment.add(Bundle(client="app", slots=(make_slot(0, table(seq)),),
                           ingestion_ts_ns=1_000 + seq, sequence=seq))
    write_segment(seg_dir / SEGMENT_NAME, encode_segment(segment, max_dictionary_cardinality=1024))
    with AckLogFile.open(shard / "ack.log") as ack:
        ack.append([af.encode(af.SegmentFinalized(segment_seq=1, bundle_count=segment_bundles))])
        ack.sync()
    return root


def fsck_json(capsys: pytest.CaptureFixture[str], root: Path, *,
              repair: bool = False) -> tuple[int, dict[str, Any]]:
    rc = fsck.run_fsck(root, repair=repair, as_json=True)
    return rc, json.loads(capsys.readouterr().out)


def kinds(out: dict[str, Any], key: str = "findings") -> list[str]:
    return [f["kind"] for f in out[key]]


def flip(path: Path, offset: int) -> None:
    os.chmod(path, 0o640)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(raw)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "LOCK"}


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield build_data_dir(tmp_path / "data")


def test_fsck_healthy_dir_exit_0_via_cli_json(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["fsck", str(data_dir), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["healthy"] is True and out["findings"] == []
    checked = out["checked"]
    assert (checked["shards"], checked["wal_files"], checked["segments"]) == (1, 1, 1)
    assert checked["wal_entries"] == 2 and checked["wal_released_bytes"] > 0
    assert (checked["sidecars"], checked["ack_logs"]) == (1, 1)


def test_fsck_human_summary_names_findings(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["fsck", str(data_dir)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("healthy")
    flip(data_dir / "shard-0" / "segments" / SEGMENT_NAME, 100)
    assert cli.main(["fsck", str(data_dir)]) == 1
    out = capsys.readouterr().out
    assert f"FINDING  segment_corrupt  {data_dir / 'shard-0' / 'segments' / SEGMENT_NAME}" in out
    assert "1 finding; `quiverd fsck --repair`" in out


def test_fsck_flipped_segment_byte_exit_1_naming_file(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    segment = data_dir / "shard-0" / "segments" / SEGMENT_NAME
    flip(segment, 100)
    before = snapshot(data_dir)
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and out["healthy"] is False
    [finding] = out["findings"]
    assert finding["path"] == str(segment) and finding["kind"] == "segment_corrupt"
    assert finding["offset"] == segment.stat().st_size - 4  # where the stored CRC lives
    assert finding["message"].startswith("crc mismatch")
    assert snapshot(data_dir) == before  # checking never writes


def test_fsck_torn_wal_tail_is_finding(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wal = data_dir / "shard-0" / "wal" / "quiver.wal"
    good_end = wal.stat().st_size
    append_entries(wal, range(6, 7))
    os.truncate(wal, wal.stat().st_size - 7)
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and kinds(out) == ["wal_torn_tail"]
    assert (out["findings"][0]["path"], out["findings"][0]["offset"]) == (str(wal), good_end)


def test_fsck_repair_quarantines_segment_and_cuts_torn_tail(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = data_dir / "shard-0"
    segment, wal = shard / "segments" / SEGMENT_NAME, shard / "wal" / "quiver.wal"
    flip(segment, 100)
    damaged = segment.read_bytes()
    (shard / "segments" / f"{2:016d}.qseg.tmp").write_bytes(b"half a segment")
    good_end = wal.stat().st_size
    append_entries(wal, range(6, 7))
    torn = wal.read_bytes()[good_end:-7]
    os.truncate(wal, wal.stat().st_size - 7)
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and sorted(kinds(out)) == ["segment_corrupt", "segment_temp", "wal_torn_tail"]

    # Segment 1 held sequences 1..3 and the WAL has released them: repair cannot bring
    # them back, so it says what is lost and exits 1.
    rc, out = fsck_json(capsys, data_dir, repair=True)
    assert rc == 1 and out["healthy"] is False and out["findings"] == []
    assert out["lost"] == [{"shard": 0, "count": 3, "sequences": [[1, 3]],
                            "bundles": [{"segment_seq": 1, "bundle_count": 3}]}]
    events = [r["event"] for r in out["repairs"]]
    assert events.count("file_quarantined") == 2 and "wal_torn_tail" in events
    quarantine = shard / "quarantine"
    assert (quarantine / SEGMENT_NAME).read_bytes() == damaged
    assert (quarantine / f"{2:016d}.qseg.tmp").read_bytes() == b"half a segment"
    assert (quarantine / f"quiver.wal.0.{good_end}.torn").read_bytes() == torn
    assert list((shard / "segments").iterdir()) == [] and wal.stat().st_size == good_end

    assert cli.main(["fsck", str(data_dir)]) == 1  # the loss stays visible
    lines = capsys.readouterr().out.splitlines()
    assert "LOST  shard 0: WAL sequences 1..3 (3 bundles): no segment and no WAL entry " \
        "holds them" in lines
    assert any(line.startswith("LOST  shard 0: segment 1: bundles (0, 1, 0..2);")
               for line in lines)
    assert lines[-1].startswith("3 acknowledged bundles lost (LOST above)")


def test_fsck_repair_without_loss_exits_0(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = data_dir / "shard-0"
    (shard / "wal" / "truncate.offset").unlink()  # the WAL still holds 1..5: nothing released
    flip(shard / "segments" / SEGMENT_NAME, 100)
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and kinds(out) == ["segment_corrupt"] and out["lost"] == []
    rc, out = fsck_json(capsys, data_dir, repair=True)
    assert rc == 0 and out["healthy"] is True and out["lost"] == []
    assert [r["event"] for r in out["repairs"]] == ["file_quarantined"]


def test_fsck_corrupt_wal_entry_repair_leaves_note_and_reports_loss(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wal = data_dir / "shard-0" / "wal" / "quiver.wal"
    sidecar = wf.decode_sidecar((wal.parent / "truncate.offset").read_bytes(), path="")
    raw = bytearray(wal.read_bytes())
    raw[sidecar.truncate_offset + 40] ^= 1  # sequence 4; sequence 5 still follows
    wal.write_bytes(raw)
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and kinds(out) == ["wal_corrupt_entry"]
    assert out["findings"][0]["offset"] == sidecar.truncate_offset
    assert out["lost"] == [{"shard": 0, "count": 1, "sequences": [[4, 4]], "bundles": []}]
    rc, out = fsck_json(capsys, data_dir, repair=True)
    assert rc == 1 and kinds(out, "notes") == ["wal_corrupt_entry"] and out["findings"] == []
    assert "already copied to quarantine" in out["notes"][0]["message"]
    assert out["lost"][0]["sequences"] == [[4, 4]]  # acknowledged, and gone
    assert wal.read_bytes() == raw  # replay skips the entry; it deletes nothing


def test_fsck_wal_length_past_eof_is_damage_not_torn_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = build_data_dir(tmp_path / "data", wal_entries=20, segment_bundles=3)
    wal = root / "shard-0" / "wal" / "quiver.wal"
    rows = [r for r in wr_dump(wal) if r["kind"] == "entry"]
    at = next(r["offset"] for r in rows if r["sequence"] == 6)
    raw = bytearray(wal.read_bytes())
    raw[at : at + 4] = (len(raw) + 1).to_bytes(4, "little")  # entry 6 now ends past EOF
    wal.write_bytes(raw)
    rc, out = fsck_json(capsys, root)
    assert rc == 1 and kinds(out) == ["wal_damage"] and out["findings"][0]["offset"] == at
    assert out["checked"]["wal_entries"] == 16  # 4, 5 and 7..20 are kept
    assert out["lost"] == [{"shard": 0, "count": 1, "sequences": [[6, 6]], "bundles": []}]
    rc, out = fsck_json(capsys, root, repair=True)
    assert rc == 1 and out["findings"] == [] and kinds(out, "notes") == ["wal_damage"]
    assert "wal_torn_tail" not in [r["event"] for r in out["repairs"]]
    assert wal.read_bytes() == raw and out["lost"][0]["sequences"] == [[6, 6]]


def test_fsck_corrupt_sidecar_is_finding_and_repair_moves_it(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sidecar = data_dir / "shard-0" / "wal" / "truncate.offset"
    flip(sidecar, 15)
    damaged = sidecar.read_bytes()
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and kinds(out) == ["wal_sidecar"]
    assert out["checked"]["wal_entries"] == 5  # no usable sidecar: the whole file is live
    rc, out = fsck_json(capsys, data_dir, repair=True)
    assert rc == 0 and not sidecar.exists()
    assert (data_dir / "shard-0" / "quarantine" / "truncate.offset").read_bytes() == damaged


def test_fsck_punched_wal_with_sidecar_is_healthy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not probe_punch_hole(tmp_path):
        pytest.skip("filesystem cannot punch holes")
    root = build_data_dir(tmp_path / "data", wal_entries=80, segment_bundles=60)
    wal = root / "shard-0" / "wal" / "quiver.wal"
    keep = wf.decode_sidecar((wal.parent / "truncate.offset").read_bytes(), path="").truncate_offset
    fd = os.open(wal, os.O_RDWR)
    try:
        punch_hole(fd, BLOCK, keep // BLOCK * BLOCK - BLOCK)  # what WalFiles.release does
    finally:
        os.close(fd)
    assert keep // BLOCK > 1
    rc, out = fsck_json(capsys, root)
    assert rc == 0 and out["findings"] == [] and out["checked"]["wal_entries"] == 20


def test_fsck_ack_log_torn_tail_found_then_repaired(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ack = data_dir / "shard-0" / "ack.log"
    intact = ack.read_bytes()
    ack.write_bytes(intact + af.encode(af.SegmentDeleted(segment_seq=1))[:5])
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 1 and kinds(out) == ["ack_torn_tail"]
    assert out["findings"][0]["offset"] == len(intact)
    assert len(ack.read_bytes()) == len(intact) + 5  # the check replayed a copy
    rc, out = fsck_json(capsys, data_dir, repair=True)
    assert rc == 0 and ack.read_bytes() == intact


def test_fsck_refuses_held_lock(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"4242\n")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # The kernel's record names the real holder (this process), not LOCK's stale pid.
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}\\) running `"):
            fsck.run_fsck(data_dir, repair=True, as_json=True)
        assert cli.main(["fsck", str(data_dir)]) == 1
        err = capsys.readouterr().err
        assert "in use by another quiverd" in err and "hint: stop the daemon" in err
    finally:
        os.close(fd)
    assert fsck.run_fsck(data_dir, repair=False, as_json=True) == 0


@pytest.mark.parametrize("repair", [False, True])
def test_fsck_refuses_directory_that_is_not_a_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], repair: bool
) -> None:
    (tmp_path / "notes.txt").write_text("not quiverd's")
    (tmp_path / "shard-x").mkdir()  # not shard-<n>
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main(["fsck", str(tmp_path), *(["--repair"] if repair else [])]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{tmp_path} is not a quiverd data directory" in captured.err
    assert "\nhint: pass the daemon's data_dir" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no LOCK written


def test_fsck_accepts_data_dir_with_only_lock_or_only_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only_lock, only_shard = tmp_path / "a", tmp_path / "b"
    only_lock.mkdir()
    (only_lock / "LOCK").write_text("")
    (only_shard / "shard-3").mkdir(parents=True)
    for root in (only_lock, only_shard):
        rc, out = fsck_json(capsys, root)
        assert rc == 0 and out["healthy"] is True


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_fsck_progress_on_tty_stderr_only(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tty = _Tty()
    monkeypatch.setattr("sys.stderr", tty)
    rc, out = fsck_json(capsys, data_dir)
    assert rc == 0 and out["healthy"]
    assert "\rfsck: 4/4 files, " in tty.getvalue()  # WAL, segment, sidecar, ack.log


def test_fsck_names_the_process_holding_the_lock_not_the_pid_recorded_in_it(
        data_dir: Path) -> None:
    """A second fsck while one runs (fsck records no pid in LOCK): the message names the
    holder's pid and command line, not the last daemon's pid left in the file."""
    (data_dir / "LOCK").write_text("4242\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(data_dir / "LOCK"), "fsck-like"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(AlreadyRunning) as err:
            fsck.run_fsck(data_dir, repair=False, as_json=True)
        assert f"pid {holder.pid}) running `" in str(err.value), str(err.value)
        assert "fsck-like" in str(err.value) and "4242" not in str(err.value)
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
