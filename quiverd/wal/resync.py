"""Finding the next sound WAL entry after damage (SPEC §3 resync). Sans-IO: pure over bytes.

Replay and ``wal dump`` call this when the bytes at an offset are no entry they can
trust (a length below the fixed header, above the maximum, or beyond the end of the
file; a bad CRC with no valid successor). Every later sound entry must survive, so the
search runs to the end of the buffer. A candidate start ``c`` is checked cheapest
first, the CRC last::

    c+0   u32 entry_len     >= ENTRY_FIXED_LEN, <= max_entry_bytes, ends inside the buffer
    c+4   u8  entry_type    0 (RecordBundle)
    c+13  u64 sequence      > after_sequence when that is known (sequences only grow)
    c+21  u64 slot_bitmap   its slot metas and payloads add up to exactly entry_len
    c+4+entry_len  u32 crc32c

A regular expression finds the type bytes (C speed): the 4 bytes before one must be a
length >= 25 and, when ``after_sequence`` is known, the top 5 bytes of the sequence
must be those of a sequence in ``(after_sequence, after_sequence + 2**24)``. The buffer
is searched in windows so that zero runs (punched holes) are jumped at once.
"""

from __future__ import annotations

import re
import struct
from functools import lru_cache
from typing import Literal, NamedTuple

from quiverd.kernel.errors import CorruptRecord
from quiverd.wal import format as wf

Buffer = bytes | bytearray | memoryview

NONZERO = re.compile(rb"[^\x00]")
WINDOW_BYTES = 16 * 1024  # searched per regex call; a window starting in zeros is jumped
ZERO_PROBE_BYTES = 64  # this many zeros at a window start: a hole, jump to its end
_ZERO_PROBE = bytes(ZERO_PROBE_BYTES)
SEQUENCE_AT = wf.LEN_PREFIX_LEN + 1 + 8  # entry_len, entry_type, ingestion_ts
_TYPE_AT = wf.LEN_PREFIX_LEN
_LOOKAHEAD = SEQUENCE_AT + 8 - _TYPE_AT  # bytes from the type byte to the sequence's end
SEQUENCE_SPAN = 1 << 24  # sequences a regex accepts above after_sequence
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U64_MAX = (1 << 64) - 1
_SEQ_BITMAP = struct.Struct("<QQ")
assert SEQUENCE_AT == 13 and _LOOKAHEAD == 17 and _SEQ_BITMAP.size == 16

# The 4 bytes before the type byte read as a u32 >= 25 (ENTRY_FIXED_LEN).
_LENGTH_OK = (rb"(?<=(?:[\x19-\xff][\x00-\xff]{3}|[\x00-\xff][\x01-\xff][\x00-\xff]{2}"
              rb"|[\x00-\xff]{2}[\x01-\xff][\x00-\xff]|[\x00-\xff]{3}[\x01-\xff])\x00)")
assert wf.ENTRY_FIXED_LEN == 0x19


class Step(NamedTuple):
    """What the bytes at one offset are, and where the walk goes on (``next_step``).

    ``entry``: a sound entry (of any type); ``corrupt``: a whole entry with a bad CRC
    whose successor is sound and continues the sequence (skip just it); ``skip``:
    damage up to ``end``, the next sound entry; ``tail``: nothing sound follows.
    """

    kind: Literal["entry", "corrupt", "skip", "tail"]
    end: int  # where the walk goes on (``tail``: the end of the buffer)
    entry: wf.DecodedEntry | None  # ``entry``/``corrupt``, and a ``tail`` that parsed
    reason: str  # why the bytes are damage ("" for a sound entry)


def next_step(data: Buffer, pos: int, *, max_entry_bytes: int, last_sequence: int | None,
              skipped: int, after_sequence: int | None, path: str = "") -> Step:
    """The one rule replay and ``wal dump`` (hence fsck's loss prediction) both walk by.

    ``last_sequence`` is the last sound entry's, ``skipped`` the bad entries skipped
    since it (each used a sequence), ``after_sequence`` the lowest sequence a resync
    may not go back to (the last one seen, or what segments hold).
    """
    try:
        entry = wf.decode_entry(data, pos, max_entry_bytes=max_entry_bytes, path=path)
    except CorruptRecord as exc:
        # A length beyond the file is damage like any other: only when no sound entry
        # follows is it a torn write.
        return _resynced(data, pos, max_entry_bytes, after_sequence, str(exc), None)
    end = pos + entry.total_len
    if entry.sound:
        return Step("entry", end, entry, "")
    reason = entry.problem or "crc mismatch"
    if _successor_ok(data, end, max_entry_bytes, last_sequence, skipped):
        return Step("corrupt", end, entry, reason)
    if end == len(data):
        return Step("tail", len(data), entry, reason)  # a damaged last entry: no search
    # The length itself may be what is damaged: never trust it to find the successor.
    return _resynced(data, pos, max_entry_bytes, after_sequence, reason, entry)


def _resynced(data: Buffer, pos: int, max_entry_bytes: int, after_sequence: int | None,
              reason: str, entry: wf.DecodedEntry | None) -> Step:
    resync = find_sound_entry(data, pos + 1, max_entry_bytes, after_sequence=after_sequence)
    if resync is None:
        return Step("tail", len(data), entry, reason)
    return Step("skip", resync, None, reason)


def _successor_ok(data: Buffer, pos: int, max_entry_bytes: int, last_sequence: int | None,
                  skipped: int) -> bool:
    """Does a sound entry continue the sequence right after a damaged one?"""
    try:
        nxt = wf.decode_entry(data, pos, max_entry_bytes=max_entry_bytes)
    except CorruptRecord:
        return False
    if not nxt.sound:
        return False
    if nxt.entry_type not in wf.KNOWN_ENTRY_TYPES or last_sequence is None:
        return True
    return nxt.sequence == last_sequence + 2 + skipped


def find_sound_entry(data: Buffer, cand: int, max_entry_bytes: int, *,
                     after_sequence: int | None = None) -> int | None:
    """Offset of the first sound RecordBundle entry at or after ``cand``, or None.

    With ``after_sequence`` only entries whose sequence is above it count: a sound
    entry with an older sequence is a stale copy (inside a payload, say), never the
    successor the damage hides.
    """
    size = len(data)
    pattern = _pattern(after_sequence)
    pos = cand
    while pos + wf.ENTRY_OVERHEAD_LEN <= size:
        if data[pos : pos + ZERO_PROBE_BYTES] == _ZERO_PROBE:
            match = NONZERO.search(data, pos)
            if match is None:
                return None
            # A non-zero length prefix starts at most 3 bytes before its first non-zero byte.
            pos = max(pos + 1, match.start() - (wf.LEN_PREFIX_LEN - 1))
            continue
        window_end = min(size, pos + WINDOW_BYTES)
        endpos = min(size, window_end + _TYPE_AT + _LOOKAHEAD)
        for m in pattern.finditer(data, pos + _TYPE_AT, endpos):
            start = m.start() - _TYPE_AT
            if start >= window_end:
                break
            if _plausible(data, start, max_entry_bytes, after_sequence) and wf.decode_entry(
                data, start, max_entry_bytes=max_entry_bytes
            ).sound:
                return start
        pos = window_end
    return None


def _pattern(after_sequence: int | None) -> re.Pattern[bytes]:
    if after_sequence is None:
        return _compiled(None)
    lo, hi = (min(after_sequence + n, _U64_MAX) for n in (1, SEQUENCE_SPAN))
    tops = {_U64.pack(lo)[3:], _U64.pack(hi)[3:]}
    return _compiled(tuple(sorted(tops)))


@lru_cache(maxsize=16)
def _compiled(tops: tuple[bytes, ...] | None) -> re.Pattern[bytes]:
    # After the type byte: 8 bytes of timestamp, then the sequence (u64 little-endian).
    if tops is None:
        sequence = rb".{8}.{6}\x00\x00"  # below 2**48: far more than any shard writes
    else:
        sequence = rb".{8}...(?:" + b"|".join(re.escape(t) for t in tops) + rb")"
    return re.compile(rb"(?s)\x00" + _LENGTH_OK + rb"(?=" + sequence + rb")")


def _plausible(data: Buffer, start: int, max_entry_bytes: int,
               after_sequence: int | None) -> bool:
    """Everything but the CRC: length bounds, sequence, slot metas adding up to the length."""
    (entry_len,) = _U32.unpack_from(data, start)
    end = start + wf.LEN_PREFIX_LEN + entry_len
    if not wf.ENTRY_FIXED_LEN <= entry_len <= max_entry_bytes or end + wf.CRC_LEN > len(data):
        return False
    sequence, bitmap = _SEQ_BITMAP.unpack_from(data, start + SEQUENCE_AT)
    if after_sequence is not None and sequence <= after_sequence:
        return False
    pos = start + wf.LEN_PREFIX_LEN + wf.ENTRY_FIXED_LEN
    for _ in range(bitmap.bit_count()):
        if pos + wf.SLOT_META_LEN > end:
            return False
        (payload_len,) = _U32.unpack_from(data, pos + wf.SLOT_META_LEN - 4)
        pos += wf.SLOT_META_LEN + payload_len
    return pos == end
