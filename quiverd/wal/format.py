"""WAL byte layout (SPEC §3): header, entry frames and the truncate sidecar. Sans-IO.

All integers little-endian; every CRC is CRC-32C.

File header, 30 bytes::

    0   magic[10]  b"QUIVER\\0WAL"
    10  u16        version = 1
    12  u16        reserved = 0
    14  [16]       segment_cfg_hash = SHA-256(slot layout contract)[:16]

Entry (offsets relative to the entry start)::

    0   u32  entry_len          bytes from entry_type to the end of the last payload
    4   u8   entry_type         0 = RecordBundle, 1 = checkpoint (reserved), others skipped
    5   i64  ingestion_ts_nanos
    13  u64  per_core_sequence
    21  u64  slot_bitmap        bit n = slot n present
    29  per set bit, ascending: u16 payload_type_id, [32] schema_fingerprint,
                                u32 row_count, u32 payload_len, payload_len bytes
    4+entry_len  u32 crc32c     over entry_type .. end of the last payload

Truncate sidecar ``truncate.offset``, 32 bytes::

    0   magic[8]  b"QUIVER\\0T"
    8   u16       version = 1
    10  u16       reserved = 0
    12  u64       truncate_offset      first byte still needed ...
    20  u64       rotation_generation  ... in the WAL file of this generation
    28  u32       crc32c over bytes 0..28
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

from quiverd.kernel.bundle import FINGERPRINT_LEN, MAX_SLOTS, Slot
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import CorruptRecord, FormatMismatch

Buffer = bytes | bytearray | memoryview

MAGIC = b"QUIVER\0WAL"
VERSION = 1
CFG_HASH_LEN = 16
_HEADER = struct.Struct("<10sHH16s")
HEADER_LEN = len(MAGIC) + 2 + 2 + CFG_HASH_LEN
assert _HEADER.size == HEADER_LEN == 30

ENTRY_RECORD_BUNDLE = 0
ENTRY_CHECKPOINT = 1  # reserved
# A commit record: its sequence field is the highest sequence an fdatasync had covered
# when it was written (the synced frontier); no slots, no sequence of its own. SPEC §3.
ENTRY_COMMIT = 2
KNOWN_ENTRY_TYPES = frozenset({ENTRY_RECORD_BUNDLE})  # the types that carry a bundle

LEN_PREFIX_LEN = 4
CRC_LEN = 4
_LEN = struct.Struct("<I")
_FIXED = struct.Struct("<BqQQ")
ENTRY_FIXED_LEN = 1 + 8 + 8 + 8  # entry_type, ts, sequence, slot_bitmap
_SLOT_META = struct.Struct("<H32sII")
SLOT_META_LEN = 2 + FINGERPRINT_LEN + 4 + 4
ENTRY_OVERHEAD_LEN = LEN_PREFIX_LEN + ENTRY_FIXED_LEN + CRC_LEN
MAX_ENTRY_LEN = 0xFFFF_FFFF  # entry_len is a u32
assert _FIXED.size == ENTRY_FIXED_LEN and _SLOT_META.size == SLOT_META_LEN

SIDECAR_MAGIC = b"QUIVER\0T"
SIDECAR_VERSION = 1
_SIDECAR_BODY = struct.Struct("<8sHHQQ")
SIDECAR_LEN = len(SIDECAR_MAGIC) + 2 + 2 + 8 + 8 + CRC_LEN
assert _SIDECAR_BODY.size + CRC_LEN == SIDECAR_LEN == 32

# The contract the cfg hash covers: how slots map to payloads. Tuning knobs are
# deliberately absent so changing them never invalidates a healthy WAL.
LAYOUT_V1 = (
    "quiverd slot layout v1: 64 slots; slots 0..62 carry producer data with "
    "payload_type_id = slot id; slot 63 is the bundle metadata slot with "
    "payload_type_id 0xFFFF (one row: client utf8, job_id utf8?, partition u32?, "
    "attempt u32?, row_offset u64?); each payload is one Arrow IPC stream "
    "(schema + batches + EOS); schema_fingerprint = SHA-256 of the canonical "
    "serialized Arrow schema without metadata; checksums CRC-32C"
)


def cfg_hash(layout: str) -> bytes:
    """128-bit digest of a slot layout contract: SHA-256, first 16 bytes."""
    return hashlib.sha256(layout.encode()).digest()[:CFG_HASH_LEN]


DEFAULT_CFG_HASH = cfg_hash(LAYOUT_V1)


class Header(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    cfg_hash: bytes


class Sidecar(msgspec.Struct, frozen=True, kw_only=True):
    truncate_offset: int
    rotation_generation: int


class DecodedEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One framed entry. ``slots`` are memoryview slices of the input buffer.

    ``crc_ok`` is the checksum verdict; ``problem`` is non-empty when the CRC
    matched but the body contradicts itself (a writer bug, not a torn write).
    Bodies are parsed only for known types with a good CRC; otherwise
    ``slots`` is empty so callers skip the entry by ``total_len``.
    """

    offset: int
    total_len: int
    entry_type: int
    ts_ns: int
    sequence: int
    slot_bitmap: int
    slots: tuple[Slot, ...]
    crc_ok: bool
    problem: str = ""

    @property
    def sound(self) -> bool:
        return self.crc_ok and not self.problem


def encode_header(cfg_hash: bytes) -> bytes:
    if len(cfg_hash) != CFG_HASH_LEN:
        raise ValueError(f"cfg hash must be {CFG_HASH_LEN} bytes, got {len(cfg_hash)}")
    return _HEADER.pack(MAGIC, VERSION, 0, cfg_hash)


def decode_header(buf: Buffer, *, path: str, expected_cfg_hash: bytes | None) -> Header:
    """Validate a WAL header; ``expected_cfg_hash=None`` skips the hash check (dump)."""
    if len(buf) < HEADER_LEN:
        raise CorruptRecord(
            path, 0, f"file is {len(buf)} bytes, shorter than the {HEADER_LEN}-byte WAL header"
        )
    magic, version, reserved, found_hash = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptRecord(path, 0, f"wrong magic {magic!r}, expected {MAGIC!r}: not a WAL")
    if version != VERSION:
        raise FormatMismatch(path, 10, f"unknown WAL version {version}, this build reads {VERSION}")
    if reserved != 0:
        raise FormatMismatch(path, 12, f"reserved header field is {reserved:#x}, must be 0")
    if expected_cfg_hash is not None and found_hash != expected_cfg_hash:
        raise FormatMismatch(
            path, 14,
            f"segment cfg hash mismatch: file has {found_hash.hex()}, "
            f"this build expects {expected_cfg_hash.hex()}",
        )
    return Header(version=version, cfg_hash=found_hash)


def entry_size(slots: Sequence[Slot]) -> int:
    """Total on-disk bytes of an entry holding ``slots``, length prefix and CRC included."""
    return ENTRY_OVERHEAD_LEN + sum(SLOT_META_LEN + len(s.ipc) for s in slots)


def encode_entry(
    *, ts_ns: int, sequence: int, slots: Sequence[Slot], entry_type: int = ENTRY_RECORD_BUNDLE
) -> list[Buffer]:
    """The pieces of one entry, in order, for writev; payloads are passed through uncopied."""
    bitmap = _check_slots(slots)
    entry_len = entry_size(slots) - LEN_PREFIX_LEN - CRC_LEN
    if entry_len > MAX_ENTRY_LEN:
        raise ValueError(f"entry of {entry_len} bytes does not fit a u32 length")
    fixed = _FIXED.pack(entry_type, ts_ns, sequence, bitmap)
    metas = [
        _SLOT_META.pack(s.type_id, s.fingerprint, s.row_count, len(s.ipc)) for s in slots
    ]
    # The prefix, fixed header and first slot meta are small: one piece saves a writev iovec.
    head = _LEN.pack(entry_len) + fixed + (metas[0] if metas else b"")
    crc = crc32c(memoryview(head)[LEN_PREFIX_LEN:])
    pieces: list[Buffer] = [head]
    for i, s in enumerate(slots):
        if i > 0:
            crc = crc32c(metas[i], crc)
            pieces.append(metas[i])
        crc = crc32c(s.ipc, crc)
        pieces.append(s.ipc)
    pieces.append(_LEN.pack(crc))
    return pieces


def encode_commit(*, base: int, synced_through: int, ts_ns: int) -> bytes:
    """A commit record (``ENTRY_COMMIT``, ``wal.commits``): every entry in
    ``(base, synced_through]`` was covered by an fdatasync that returned before this
    record was written. ``base`` (in the slot_bitmap field: a commit has no slots) is
    the last sequence when the writer started."""
    body = _FIXED.pack(ENTRY_COMMIT, ts_ns, synced_through, base)
    return _LEN.pack(ENTRY_FIXED_LEN) + body + _LEN.pack(crc32c(body))


COMMIT_LEN = ENTRY_OVERHEAD_LEN  # 33 bytes: a commit record has no slots


def _check_slots(slots: Sequence[Slot]) -> int:
    bitmap = 0
    previous = -1
    for s in slots:
        if not previous < s.slot < MAX_SLOTS:
            raise ValueError(f"slots must be unique, ascending, in 0..{MAX_SLOTS - 1}: {s.slot}")
        if len(s.fingerprint) != FINGERPRINT_LEN:
            raise ValueError(f"slot {s.slot}: fingerprint must be {FINGERPRINT_LEN} bytes")
        if not 0 <= s.type_id <= 0xFFFF or not 0 <= s.row_count <= 0xFFFF_FFFF:
            raise ValueError(f"slot {s.slot}: payload_type_id or row_count out of range")
        previous = s.slot
        bitmap |= 1 << s.slot
    return bitmap


def decode_entry(buf: Buffer, offset: int, *, max_entry_bytes: int, path: str = "") -> DecodedEntry:
    """Decode the entry at ``offset`` without copying payloads.

    Raises CorruptRecord when the frame cannot be trusted: fewer than 4 bytes
    left, a zero/too-small length, a length above ``max_entry_bytes`` or past
    the end of ``buf``. Every length is checked before it is used.
    """
    view = memoryview(buf).cast("B")
    size = len(view)
    if size - offset < LEN_PREFIX_LEN:
        raise CorruptRecord(path, offset, f"{size - offset} bytes left, too few for a length")
    (entry_len,) = _LEN.unpack_from(view, offset)
    if entry_len < ENTRY_FIXED_LEN:
        raise CorruptRecord(path, offset, f"entry length {entry_len} below the fixed header")
    if entry_len > max_entry_bytes:
        raise CorruptRecord(path, offset, f"entry length {entry_len} above max {max_entry_bytes}")
    total_len = LEN_PREFIX_LEN + entry_len + CRC_LEN
    if offset + total_len > size:
        raise CorruptRecord(
            path, offset, f"entry of {total_len} bytes ends {offset + total_len - size} past EOF"
        )
    body = view[offset + LEN_PREFIX_LEN : offset + LEN_PREFIX_LEN + entry_len]
    (stored_crc,) = _LEN.unpack_from(view, offset + LEN_PREFIX_LEN + entry_len)
    crc_ok = crc32c(body) == stored_crc
    entry_type, ts_ns, sequence, bitmap = _FIXED.unpack_from(body, 0)
    slots: tuple[Slot, ...] = ()
    problem = ""
    if crc_ok and entry_type in KNOWN_ENTRY_TYPES:
        slots, problem = _decode_slots(body, bitmap)
    return DecodedEntry(
        offset=offset, total_len=total_len, entry_type=entry_type, ts_ns=ts_ns,
        sequence=sequence, slot_bitmap=bitmap, slots=slots, crc_ok=crc_ok, problem=problem,
    )


def _decode_slots(body: memoryview, bitmap: int) -> tuple[tuple[Slot, ...], str]:
    slots: list[Slot] = []
    pos = ENTRY_FIXED_LEN
    # Only the set bits, lowest first (ascending slot order): a bundle sets two or three
    # of the 64, and walking all 64 was most of this function's time at read-back.
    rest = bitmap & ((1 << MAX_SLOTS) - 1)
    while rest:
        low = rest & -rest
        rest ^= low
        slot_id = low.bit_length() - 1
        if pos + SLOT_META_LEN > len(body):
            return (), f"slot {slot_id} metadata runs past the entry"
        type_id, fp, rows, payload_len = _SLOT_META.unpack_from(body, pos)
        pos += SLOT_META_LEN
        if pos + payload_len > len(body):
            return (), f"slot {slot_id} payload of {payload_len} bytes runs past the entry"
        slots.append(
            Slot(
                slot=slot_id, fingerprint=fp, row_count=rows, ipc=body[pos : pos + payload_len],
                payload_type_id=-1 if type_id == slot_id else type_id,
            )
        )
        pos += payload_len
    if pos != len(body):
        return (), f"{len(body) - pos} bytes after the last slot payload"
    return tuple(slots), ""


def encode_sidecar(truncate_offset: int, rotation_generation: int) -> bytes:
    body = _SIDECAR_BODY.pack(
        SIDECAR_MAGIC, SIDECAR_VERSION, 0, truncate_offset, rotation_generation
    )
    return body + _LEN.pack(crc32c(body))


def decode_sidecar(buf: Buffer, *, path: str) -> Sidecar:
    if len(buf) != SIDECAR_LEN:
        raise CorruptRecord(path, 0, f"sidecar is {len(buf)} bytes, expected {SIDECAR_LEN}")
    magic, version, reserved, offset, generation = _SIDECAR_BODY.unpack_from(buf, 0)
    if magic != SIDECAR_MAGIC:
        raise CorruptRecord(path, 0, f"wrong sidecar magic {magic!r}, expected {SIDECAR_MAGIC!r}")
    if version != SIDECAR_VERSION:
        raise CorruptRecord(path, 8, f"unknown sidecar version {version}")
    if reserved != 0:
        raise CorruptRecord(path, 10, f"sidecar reserved field is {reserved:#x}, must be 0")
    (stored,) = _LEN.unpack_from(buf, _SIDECAR_BODY.size)
    computed = crc32c(memoryview(buf)[: _SIDECAR_BODY.size])
    if stored != computed:
        raise CorruptRecord(path, 28, f"sidecar crc {stored:#010x} != computed {computed:#010x}")
    return Sidecar(truncate_offset=offset, rotation_generation=generation)
