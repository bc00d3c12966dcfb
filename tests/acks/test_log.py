"""ack.log on disk: torn tails, flipped bytes, compaction, the replay bound."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import structlog

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile, compact, replay_ack_log, scan_ack_log
from quiverd.acks.state import AckState
from quiverd.kernel import fs
from quiverd.kernel.errors import CorruptRecord, FormatMismatch, NoSpace

LOG = structlog.get_logger("test")


def build_log(path: Path) -> tuple[AckState, list[bytes]]:
    """A small history: two subscribers, three segments, a few outcomes."""
    state = AckState()
    frames: list[bytes] = []

    def commit(rec: fmt.Record | None) -> None:
        assert rec is not None
        frames.append(fmt.encode(rec))
        state.apply(rec)

    commit(state.add_subscriber("a"))
    commit(state.add_subscriber("b"))
    for seq in (1, 2, 3):
        commit(state.segment_finalized(seq, 2))
    for seq, idx in ((1, 0), (1, 1), (2, 1)):
        commit(state.record_outcome("a", seq, idx, fmt.ACK))
    commit(state.record_outcome("b", 1, 1, fmt.NACK))
    commit(state.record_outcome("b", 3, 0, fmt.ACK))
    with AckLogFile.open(path) as f:
        f.append(frames)
        f.sync()
    return state, frames


def replay(path: Path, **kw: object) -> AckState:
    return replay_ack_log(path, path.parent / "quarantine", log=LOG, **kw)  # type: ignore[arg-type]


def quarantined(path: Path) -> list[bytes]:
    qdir = path.parent / "quarantine"
    return [p.read_bytes() for p in sorted(qdir.iterdir())] if qdir.exists() else []


def test_replay_missing_file_empty_state(tmp_path: Path) -> None:
    state = replay(tmp_path / "ack.log")
    assert state.checkpoint_record() == AckState().checkpoint_record()


def test_replay_equals_live_state(tmp_path: Path) -> None:
    live, _ = build_log(tmp_path / "ack.log")
    assert replay(tmp_path / "ack.log").checkpoint_record() == live.checkpoint_record()


def test_replay_torn_tail_at_every_byte_of_last_record(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    _, frames = build_log(path)
    full = path.read_bytes()
    good_end = len(full) - len(frames[-1])
    expected = AckState()
    for rec_bytes in frames[:-1]:
        dec = fmt.RecordScanner()
        dec.feed(rec_bytes)
        frame = dec.next()
        assert isinstance(frame, fmt.Frame)
        rec = fmt.decode_record(frame.record_type, frame.body)
        assert rec is not None
        expected.apply(rec)
    for cut in range(good_end + 1, len(full)):
        case = tmp_path / f"case{cut}"
        case.mkdir()
        torn = case / "ack.log"
        torn.write_bytes(full[:cut])
        report = scan_ack_log(torn, case / "quarantine", log=LOG)
        assert report.state.checkpoint_record() == expected.checkpoint_record(), cut
        assert torn.stat().st_size == good_end == report.valid_end
        assert report.truncated_bytes == cut - good_end
        assert quarantined(torn) == [full[good_end:cut]]
        # Replaying the repaired file again is clean and changes nothing.
        again = scan_ack_log(torn, case / "quarantine", log=LOG)
        assert again.truncated_bytes == 0 and len(quarantined(torn)) == 1


def test_replay_flipped_byte_with_valid_successor_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    live, frames = build_log(path)
    data = bytearray(path.read_bytes())
    # The second-to-last record is b's NACK; flip a byte inside its body.
    start = len(data) - len(frames[-1]) - len(frames[-2])
    data[start + 6] ^= 0x40
    path.write_bytes(bytes(data))
    report = scan_ack_log(path, tmp_path / "quarantine", log=LOG)
    assert report.corrupt_records == 1 and report.truncated_bytes == 0
    assert quarantined(path) == [bytes(data[start : start + len(frames[-2])])]
    assert report.state.nack_count("b", 1, 1) == 0  # the lost record
    assert report.state.gap_set("b") == {(3, 0)}  # its successor survived
    assert path.stat().st_size == len(data)


def test_replay_flipped_byte_in_last_record_is_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    _, frames = build_log(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    report = scan_ack_log(path, tmp_path / "quarantine", log=LOG)
    assert report.corrupt_records == 0 and report.truncated_bytes == len(frames[-1])
    assert report.state.gap_set("b") == set()


def test_replay_zero_filled_tail_truncated(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    live, _ = build_log(path)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00" * 4096)  # a preallocated or half-flushed tail after power loss
    report = scan_ack_log(path, tmp_path / "quarantine", log=LOG)
    assert report.state.checkpoint_record() == live.checkpoint_record()
    assert path.stat().st_size == size and report.truncated_bytes == 4096


def test_replay_length_above_max_is_torn_tail_not_allocation(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    build_log(path)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write((0xFFFF_FFF0).to_bytes(4, "little") + b"\x01" * 10)
    report = scan_ack_log(path, tmp_path / "quarantine", log=LOG, max_record_len=1 << 20)
    assert report.valid_end == size and path.stat().st_size == size


def test_replay_unknown_type_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    live, _ = build_log(path)
    with open(path, "ab") as f:
        f.write(fmt.encode_frame(99, b"from a newer build"))
        f.write(fmt.encode(fmt.SegmentFinalized(segment_seq=4, bundle_count=1)))
    report = scan_ack_log(path, tmp_path / "quarantine", log=LOG)
    assert report.unknown_records == 1
    assert report.state.live_segments() == {1: 2, 2: 2, 3: 2, 4: 1}


def test_replay_crc_valid_malformed_record_refuses(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    build_log(path)
    with open(path, "ab") as f:
        offset = f.tell()
        f.write(fmt.encode_frame(fmt.OUTCOME, b"\x00" * 5))
    with pytest.raises(CorruptRecord) as info:
        replay(path)
    assert info.value.offset == offset


@pytest.mark.parametrize("header", [b"QUIVER\0WAL\x01\x00\x00\x00", b"QUIV"])
def test_replay_bad_header_refuses(tmp_path: Path, header: bytes) -> None:
    (tmp_path / "ack.log").write_bytes(header)
    with pytest.raises(CorruptRecord):
        replay(tmp_path / "ack.log")


def test_replay_unknown_version_refuses(tmp_path: Path) -> None:
    (tmp_path / "ack.log").write_bytes(b"QUIVER\0ACK\x02\x00\x00\x00")
    with pytest.raises(FormatMismatch):
        replay(tmp_path / "ack.log")


def test_compaction_replay_equal_before_and_after(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    live, _ = build_log(path)
    before = replay(path).checkpoint_record()
    size = compact(path, live)
    assert size == path.stat().st_size < 200
    assert replay(path).checkpoint_record() == before == live.checkpoint_record()
    assert not (tmp_path / "ack.log.tmp").exists()


def test_compaction_atomic_crash_before_rename_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    live, _ = build_log(path)
    old = path.read_bytes()

    class Crash(Exception):
        pass

    def hook(step: str) -> None:
        if step == "tmp_fsynced":
            raise Crash

    from quiverd.kernel.durable import atomic_write

    with pytest.raises(Crash):
        atomic_write(path, fmt.encode_header() + fmt.encode(live.checkpoint_record()), hook=hook)
    assert path.read_bytes() == old
    assert replay(path).checkpoint_record() == live.checkpoint_record()


def test_appender_compact_reopens_and_keeps_appending(tmp_path: Path) -> None:
    path = tmp_path / "ack.log"
    live, _ = build_log(path)
    with AckLogFile.open(path) as f:
        assert f.bytes_since_compaction == 0
        f.compact(live)
        rec = live.segment_finalized(4, 1)
        f.append([fmt.encode(rec)])
        f.sync()
        live.apply(rec)
        assert f.size == path.stat().st_size
    assert replay(path).checkpoint_record() == live.checkpoint_record()


def test_replay_bound_records_since_checkpoint(tmp_path: Path) -> None:
    """With compaction at a threshold, replay never applies more than threshold bytes."""
    path = tmp_path / "ack.log"
    threshold = 2000
    state = AckState()
    most_since = 0

    with AckLogFile.open(path) as f:

        def commit(records: Sequence[fmt.Record]) -> None:
            f.append([fmt.encode(r) for r in records])
            f.sync()
            for r in records:
                state.apply(r)

        commit([state.add_subscriber("a")])
        for seq in range(300):
            commit([state.segment_finalized(seq, 1)])
            out = state.record_outcome("a", seq, 0, fmt.ACK)
            assert out is not None
            # The gc deletes what every mark covers, so the checkpoint stays small.
            commit([out] + [state.segment_deleted(s) for s in state.deletable_segments()])
            report = scan_ack_log(path, tmp_path / "q", log=LOG)
            most_since = max(most_since, report.records_since_checkpoint)
            assert report.state.checkpoint_record() == state.checkpoint_record()
            if f.should_compact(threshold):
                assert f.compact(state) < 200
            assert f.size <= threshold + 200
    # Every record is at least 17 bytes framed, so the count is bounded too.
    assert 0 < most_since <= threshold // 17 + 3


def test_sync_error_propagates(tmp_path: Path) -> None:
    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    class FailingFdatasync(fs.FileSystem):
        fdatasync = staticmethod(fail)

    # The file captures the seam when it opens: the failing one must be active then.
    previous = fs.install(FailingFdatasync())
    try:
        with AckLogFile.open(tmp_path / "ack.log") as f:
            f.append([fmt.encode(fmt.SegmentDeleted(segment_seq=1))])
            with pytest.raises(OSError):
                f.sync()
    finally:
        fs.install(previous)


@contextmanager
def full_disk_log(short_dir: Path) -> Iterator[tuple[Path, AckState, bytes, Path]]:
    """ack.log with a small history on a 1 MiB tmpfs, then the disk filled by a ballast
    file: (path, state, the log's bytes, ballast)."""
    from tests.daemon.mounts import fill, mounted_tmpfs

    mnt = short_dir / "m"
    mnt.mkdir()
    with mounted_tmpfs(mnt, 1024 * 1024):
        path = mnt / "ack.log"
        state, _ = build_log(path)
        ballast = mnt / "ballast"
        before = path.read_bytes()
        fill(ballast)
        yield path, state, before, ballast


def test_append_no_space_cut_back_then_retried(short_dir: Path) -> None:
    """A write that finds the disk full leaves ack.log as it was (NoSpace, retryable);
    the same records go in once space returns, and replay sees each once."""
    with full_disk_log(short_dir) as (path, state, before, ballast):
        big = [fmt.encode(state.record_outcome("b", 3, 1, fmt.ACK) or pytest.fail())] * 2000
        with AckLogFile.open(path) as f:
            with pytest.raises(NoSpace):
                f.append(big)
            assert f.size == len(before) and path.read_bytes() == before
            ballast.unlink()
            f.append(big[:1])
            f.sync()
        assert replay(path).nack_count("b", 1, 1) == 1  # the old history, intact
        assert path.read_bytes()[:len(before)] == before


def test_compact_no_space_leaves_the_log_whole_and_no_temp_file(short_dir: Path) -> None:
    with full_disk_log(short_dir) as (path, state, before, ballast):
        with AckLogFile.open(path) as f:
            with pytest.raises(NoSpace):
                f.compact(state)
            assert path.read_bytes() == before and sorted(
                p.name for p in path.parent.iterdir()) == ["ack.log", "ballast"]  # no .tmp
            ballast.unlink()
            f.compact(state)  # space back: it works, and appends go on
            f.append([fmt.encode(state.record_outcome("b", 3, 1, fmt.ACK) or pytest.fail())])
            f.sync()
        assert replay(path).nack_count("b", 1, 1) == 1
