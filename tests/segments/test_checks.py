"""Segment checks at two depths (format version 2): the metadata CRC startup relies on,
the whole-file CRC every byte gets later; version 1 files still read (real files)."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import pytest

from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.layout import DataDir
from quiverd.segments.files import scan_segments, segment_info
from quiverd.segments.reader import SegmentReader, verify_segment
from tests.recording import Log
from tests.segments.test_format import as_version_1, assert_round_trip, three_slot_bundles, write


@pytest.fixture
def segment(tmp_path: Path) -> tuple[Path, bytes]:
    path = write(tmp_path / "0000000000000001.qseg", three_slot_bundles())
    return path, path.read_bytes()


def put(path: Path, raw: bytes) -> Path:
    if path.exists():
        os.chmod(path, 0o640)
    path.write_bytes(raw)
    return path


def flipped(raw: bytes, pos: int) -> bytes:
    out = bytearray(raw)
    out[pos] ^= 0x10
    return bytes(out)


def metadata_start(raw: bytes) -> int:
    return struct.unpack("<HIIQIQII", raw[-54:-16])[3]  # directory_offset


def test_v2_flip_in_stream_bytes_passes_metadata_check_and_fails_full_check(
        tmp_path: Path, segment: tuple[Path, bytes]) -> None:
    path, raw = segment
    data_end = metadata_start(raw)
    for pos in sorted(random.Random(2).sample(range(data_end), 40)):
        bad = put(tmp_path / "bad.qseg", flipped(raw, pos))
        with SegmentReader.open(bad, full=False) as reader:  # startup: metadata only
            assert not reader.fully_checked
            assert reader.footer.bundle_count == 13
            with pytest.raises(CorruptRecord, match="crc mismatch"):
                reader.check_file_crc()
        with pytest.raises(CorruptRecord, match="crc mismatch"):
            SegmentReader.open(bad).close()  # full=True: the default


def test_v2_flip_in_directory_manifest_footer_or_trailer_fails_metadata_check(
        tmp_path: Path, segment: tuple[Path, bytes]) -> None:
    path, raw = segment
    # Every byte from the directory to the trailer's CRC (its last 4 bytes are the
    # whole-file CRC, which only the full check reads).
    for pos in range(metadata_start(raw), len(raw) - 4):
        with pytest.raises(CorruptRecord):
            SegmentReader.open(put(tmp_path / "bad.qseg", flipped(raw, pos)), full=False).close()


def test_v2_intact_file_opens_with_either_check(segment: tuple[Path, bytes]) -> None:
    path, raw = segment
    with SegmentReader.open(path, full=False) as reader:
        assert reader.footer.version == 2 and not reader.fully_checked
        reader.check_file_crc()
        assert reader.fully_checked
    assert_round_trip(path, three_slot_bundles())


def test_v1_segment_still_reads_and_always_gets_the_whole_file_crc(
        tmp_path: Path, segment: tuple[Path, bytes]) -> None:
    _, raw = segment
    v1 = as_version_1(raw)
    path = put(tmp_path / "0000000000000002.qseg", v1)
    with SegmentReader.open(path, full=False) as reader:
        assert reader.footer.version == 1 and reader.fully_checked
        assert reader.footer.metadata_crc32c is None
    assert_round_trip(path, three_slot_bundles())
    verify_segment(path)
    with pytest.raises(CorruptRecord, match="crc mismatch"):
        SegmentReader.open(put(path, flipped(v1, 100)), full=False).close()
    assert struct.unpack("<I", v1[-16:-12]) == (34,) and crc32c(v1[:-4]) == struct.unpack(
        "<I", v1[-4:])[0]


def test_scan_segments_trusts_v2_metadata_checks_v1_whole_and_quarantines_bad_metadata(
        tmp_path: Path, segment: tuple[Path, bytes]) -> None:
    _, raw = segment
    shard = DataDir(tmp_path / "data").shard(0)
    for d in shard.directories():
        d.mkdir(parents=True, exist_ok=True)
    # 1: intact v2 with end-marker-free manifest; 2: v2 with a flipped stream byte;
    # 3: v1; 4: v2 with a flipped manifest byte; 5: v1 with a flipped stream byte.
    files = {1: raw, 2: flipped(raw, 100), 3: as_version_1(raw),
             4: flipped(raw, len(raw) - 60), 5: flipped(as_version_1(raw), 100)}
    for seq, data in files.items():
        put(shard.segment(seq), data)
    log = Log()
    scan = scan_segments(shard, log)
    assert [s.segment_seq for s in scan.good] == [1, 2, 3]
    assert scan.quarantined == [4, 5]
    assert scan.unverified == {1, 2}  # v2 files: only their metadata was read
    assert sorted(p.name for p in shard.quarantine_dir.iterdir()) == [
        shard.segment(4).name, shard.segment(5).name]
    assert [e for e, _ in log.events].count("segment_quarantined") == 2
    with SegmentReader.open(shard.segment(1)) as reader:
        assert scan.good[0] == segment_info(shard.segment(1), 1, reader)
    full = scan_segments(shard, Log(), full=True)
    assert [s.segment_seq for s in full.good] == [1, 3] and full.unverified == set()
