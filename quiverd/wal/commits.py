"""Commit records (SPEC §3, entry type 2): how far the WAL was synced, for replay. Pure.

A crash tears unsynced writes: the disk may keep a later entry of a batch whole and
lose an earlier one, so replay finds damage *between* sound entries that was never
acknowledged. Damage to an entry an fdatasync had covered (bit rot, a bad sector) is
loss. Replay tells the two apart by the commit records the writer leaves::

    [C(base, S)][entry S+1][entry S+2]...      C: every entry in (base, S] was covered
                                                  by an fdatasync that had returned

``base`` is the last sequence when the writer's life began (a restart): a life
vouches only for its own entries, never for damage an earlier life left behind.

A damaged sequence ``k`` is

- *lost* when some commit record has ``base < k <= S``: it was synced;
- *never acknowledged* when commit records of a life that wrote ``k`` exist
  (``base < k``) and none covers it: no fdatasync that covered it had returned when
  the last record that survived was written;
- *lost* otherwise (no record speaks for it: a WAL from before commit records).

The writer prefixes each write batch with a record whenever the frontier moved (and the
first batch of each file), writes one when it goes idle after a sync, and one, synced,
when it stops; so damage to a synced entry is called never acknowledged only if the
crash also took the record written after its sync (the same window in which a damaged
last entry is a torn tail).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable

from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.ranges import Ranges
from quiverd.kernel.ranges import complement as _complement
from quiverd.kernel.ranges import merge as _merge
from quiverd.wal import format as wf

Buffer = bytes | bytearray | memoryview

# entry_len = 25 (no slots) then entry_type 2: a commit record's first five bytes.
_COMMIT_START = re.compile(re.escape(struct.pack("<IB", wf.ENTRY_FIXED_LEN, wf.ENTRY_COMMIT)))


def decode_at(data: Buffer, pos: int) -> tuple[int, int] | None:
    """``(base, synced_through)`` of a sound commit record at ``pos``, else None."""
    if pos < 0 or pos + wf.COMMIT_LEN > len(data):
        return None
    try:
        e = wf.decode_entry(data, pos, max_entry_bytes=wf.ENTRY_FIXED_LEN)
    except CorruptRecord:  # undecodable bytes are simply no record
        return None
    if not e.sound or e.entry_type != wf.ENTRY_COMMIT or e.total_len != wf.COMMIT_LEN:
        return None
    return e.slot_bitmap, e.sequence


def found_in(data: Buffer, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """Every sound commit record inside ``data[start:end]`` (damage being skipped)."""
    end = len(data) if end is None else end
    out = []
    for m in _COMMIT_START.finditer(data, start, end):
        if m.start() + wf.COMMIT_LEN <= end and (rec := decode_at(data, m.start())):
            out.append(rec)
    return out


def split_unsynced(damaged: Iterable[tuple[int, int]],
                   commits: Iterable[tuple[int, int]]) -> tuple[Ranges, Ranges]:
    """``damaged`` sequence ranges as (lost, never acknowledged); see the module doc."""
    records = list(commits)
    if not records:
        return _merge(damaged), []
    covered = _merge((base + 1, synced) for base, synced in records if synced > base)
    first_known = min(base for base, _ in records) + 1  # a commit-recording life wrote it
    lost: Ranges = []
    never: Ranges = []
    for lo, hi in _merge(damaged):
        if lo < first_known:
            lost.append((lo, min(hi, first_known - 1)))
            lo = first_known
        if lo > hi:
            continue
        unsynced = _complement(covered, lo, hi)
        never.extend(unsynced)
        lost.extend(_complement(unsynced, lo, hi))
    return _merge(lost), _merge(never)
