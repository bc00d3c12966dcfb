"""Byte-exact vectors for the WAL header, entry frame and truncate sidecar.

Expected bytes are written out by hand with struct.pack, independent of the codec.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from quiverd.kernel.bundle import META_PAYLOAD_TYPE, META_SLOT, Slot
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord, FormatMismatch
from quiverd.wal import format as wf

HASH = bytes(range(16))
FP_A = b"\xaa" * 32
FP_M = b"\x55" * 32


def _slots() -> list[Slot]:
    return [
        Slot(slot=0, fingerprint=FP_A, row_count=3, ipc=b"abcde"),
        Slot(slot=META_SLOT, fingerprint=FP_M, row_count=1, ipc=b"\x01\x02",
             payload_type_id=META_PAYLOAD_TYPE),
    ]


def _expected_entry() -> bytes:
    body = (
        struct.pack("<B", 0)
        + struct.pack("<q", 1_700_000_000_123_456_789)
        + struct.pack("<Q", 42)
        + struct.pack("<Q", (1 << 0) | (1 << 63))
        + struct.pack("<H", 0) + FP_A + struct.pack("<I", 3) + struct.pack("<I", 5) + b"abcde"
        + struct.pack("<H", 0xFFFF) + FP_M + struct.pack("<I", 1) + struct.pack("<I", 2)
        + b"\x01\x02"
    )
    return struct.pack("<I", len(body)) + body + struct.pack("<I", crc32c(body))


def test_crc32c_known_answer() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"56789", crc32c(b"1234")) == 0xE3069283
    assert crc32c(memoryview(b"123456789")) == 0xE3069283


def test_header_encode_byte_exact() -> None:
    expected = b"QUIVER\x00WAL" + struct.pack("<HH", 1, 0) + HASH
    assert wf.encode_header(HASH) == expected
    assert len(expected) == wf.HEADER_LEN == 30
    assert wf.decode_header(expected, path="p", expected_cfg_hash=HASH).version == 1


def test_cfg_hash_is_sha256_prefix() -> None:
    assert wf.cfg_hash("x") == hashlib.sha256(b"x").digest()[:16]
    assert wf.DEFAULT_CFG_HASH == hashlib.sha256(wf.LAYOUT_V1.encode()).digest()[:16]


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        (b"QUIVER\x00WAX" + struct.pack("<HH", 1, 0) + HASH, CorruptRecord, "wrong magic"),
        (b"QUIVER\x00WAL" + struct.pack("<HH", 2, 0) + HASH, FormatMismatch, "unknown WAL version"),
        (b"QUIVER\x00WAL" + struct.pack("<HH", 1, 7) + HASH, FormatMismatch, "reserved"),
        (b"QUIVER\x00WAL" + struct.pack("<HH", 1, 0) + b"\0" * 16, FormatMismatch, "cfg hash"),
        (b"QUIVER\x00WAL\x01", CorruptRecord, "shorter than the 30-byte"),
    ],
)
def test_header_decode_rejects_with_specific_message(
    raw: bytes, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words) as info:
        wf.decode_header(raw, path="/x/quiver.wal", expected_cfg_hash=HASH)
    assert type(info.value) is error


def test_entry_encode_byte_exact() -> None:
    pieces = wf.encode_entry(ts_ns=1_700_000_000_123_456_789, sequence=42, slots=_slots())
    assert b"".join(pieces) == _expected_entry()
    assert wf.entry_size(_slots()) == len(_expected_entry())


def test_entry_encode_passes_payloads_through_uncopied() -> None:
    payload = bytearray(b"x" * 1000)
    slot = Slot(slot=2, fingerprint=FP_A, row_count=1, ipc=memoryview(payload))
    pieces = wf.encode_entry(ts_ns=0, sequence=1, slots=[slot])
    assert len(pieces) == 3  # head (prefix + fixed + meta), payload, crc
    assert pieces[1] is slot.ipc
    assert len(pieces[0]) == 4 + wf.ENTRY_FIXED_LEN + wf.SLOT_META_LEN
    assert len(pieces[2]) == 4


def test_entry_encode_empty_bundle_byte_exact() -> None:
    body = struct.pack("<BqQQ", 0, -5, 9, 0)
    expected = struct.pack("<I", 25) + body + struct.pack("<I", crc32c(body))
    assert b"".join(wf.encode_entry(ts_ns=-5, sequence=9, slots=[])) == expected


def test_entry_encode_rejects_unordered_slots() -> None:
    with pytest.raises(ValueError, match="ascending"):
        wf.encode_entry(ts_ns=0, sequence=1, slots=list(reversed(_slots())))


def test_entry_decode_round_trip_zero_copy() -> None:
    buf = b"junk" + _expected_entry()
    entry = wf.decode_entry(buf, 4, max_entry_bytes=1 << 20)
    assert entry.crc_ok and entry.sound
    assert (entry.offset, entry.total_len) == (4, len(_expected_entry()))
    assert (entry.entry_type, entry.ts_ns, entry.sequence) == (0, 1_700_000_000_123_456_789, 42)
    assert entry.slot_bitmap == 1 | 1 << 63
    assert isinstance(entry.slots[0].ipc, memoryview)
    decoded = [
        Slot(slot=s.slot, fingerprint=s.fingerprint, row_count=s.row_count, ipc=bytes(s.ipc),
             payload_type_id=s.payload_type_id)
        for s in entry.slots
    ]
    assert decoded == _slots()


def test_entry_decode_flags_crc_mismatch() -> None:
    raw = bytearray(_expected_entry())
    raw[40] ^= 0x01
    entry = wf.decode_entry(raw, 0, max_entry_bytes=1 << 20)
    assert not entry.crc_ok and entry.slots == ()


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 28, 60])
def test_entry_decode_truncated_is_corrupt(cut: int) -> None:
    with pytest.raises(CorruptRecord):
        wf.decode_entry(_expected_entry()[:cut], 0, max_entry_bytes=1 << 20)


def test_entry_decode_length_above_max_is_corrupt_without_allocation() -> None:
    raw = struct.pack("<I", 0xFFFF_FFF0) + b"\0" * 30
    with pytest.raises(CorruptRecord, match="above max"):
        wf.decode_entry(raw, 0, max_entry_bytes=1 << 20)
    with pytest.raises(CorruptRecord, match="past EOF"):
        wf.decode_entry(raw, 0, max_entry_bytes=0xFFFF_FFFF)


def test_entry_decode_unknown_type_has_no_slots() -> None:
    body = struct.pack("<BqQQ", 9, 1, 2, 1) + b"opaque"
    raw = struct.pack("<I", len(body)) + body + struct.pack("<I", crc32c(body))
    entry = wf.decode_entry(raw, 0, max_entry_bytes=1 << 20)
    assert entry.crc_ok and entry.entry_type == 9 and entry.slots == ()
    assert entry.total_len == len(raw)


def test_entry_decode_inconsistent_body_with_good_crc_is_a_problem() -> None:
    body = struct.pack("<BqQQ", 0, 1, 2, 1) + b"\0" * 10  # bitmap says slot 0, no meta fits
    raw = struct.pack("<I", len(body)) + body + struct.pack("<I", crc32c(body))
    entry = wf.decode_entry(raw, 0, max_entry_bytes=1 << 20)
    assert entry.crc_ok and not entry.sound and "slot 0" in entry.problem


def test_sidecar_encode_byte_exact() -> None:
    body = b"QUIVER\x00T" + struct.pack("<HHQQ", 1, 0, 4096, 7)
    expected = body + struct.pack("<I", crc32c(body))
    assert wf.encode_sidecar(4096, 7) == expected
    assert len(expected) == wf.SIDECAR_LEN == 32
    assert wf.decode_sidecar(expected, path="s") == wf.Sidecar(
        truncate_offset=4096, rotation_generation=7
    )


@pytest.mark.parametrize(
    ("index", "words"),
    [(0, "magic"), (8, "version"), (10, "reserved"), (12, "crc"), (31, "crc")],
)
def test_sidecar_decode_rejects_damage(index: int, words: str) -> None:
    raw = bytearray(wf.encode_sidecar(4096, 7))
    raw[index] ^= 0x01
    with pytest.raises(CorruptRecord, match=words):
        wf.decode_sidecar(raw, path="s")


def test_sidecar_decode_rejects_wrong_length() -> None:
    with pytest.raises(CorruptRecord, match="expected 32"):
        wf.decode_sidecar(wf.encode_sidecar(1, 2)[:31], path="s")
