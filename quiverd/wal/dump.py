"""``quiverd wal dump``: a read-only listing of one WAL file.

Header, then every entry (offset, sequence, ts, slots, rows, CRC ok/bad); the
prefix already released to segments (per the sidecar) as one row; holes and
damage as rows of their own, resynchronized the way replay does (a length beyond
the end of the file is damage too: the listing goes on at the next sound entry);
only damage with nothing sound after it in the active file is a torn tail, which
ends the listing. Never modifies the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quiverd.kernel import layout
from quiverd.kernel.bundle import MAX_SLOTS
from quiverd.kernel.errors import CorruptRecord
from quiverd.wal import commits as walcommits
from quiverd.wal import format as wf
from quiverd.wal.inventory import live_start
from quiverd.wal.resync import NONZERO, next_step


def dump_wal(path: Path) -> Iterator[dict[str, Any]]:
    """Rows describing a WAL file for ``quiverd wal dump``; never modifies the file.

    Bytes a valid sidecar beside the file releases are one ``released`` row, not
    entries: they may be a punched hole. Damage followed by a sound entry is a
    ``hole`` row (all zeros) or a ``skipped`` row; damage with no sound entry
    after it is a ``torn_tail`` in the active file and a ``skipped`` row in a
    rotated one (fsynced whole before rotation: no torn write), as in replay.
    """
    raw = Path(path).read_bytes()
    try:
        header = wf.decode_header(raw, path=str(path), expected_cfg_hash=None)
    except CorruptRecord as exc:
        yield {"kind": "error", "offset": exc.offset, "message": str(exc)}
        return
    yield {
        "kind": "header", "path": str(path), "version": header.version,
        "cfg_hash": header.cfg_hash.hex(),
        "cfg_hash_is_default": header.cfg_hash == wf.DEFAULT_CFG_HASH, "bytes": len(raw),
    }
    pos = live_start(Path(path), len(raw))
    if pos > wf.HEADER_LEN:
        whole = "whole file" if pos == len(raw) else "space reclaimed"
        yield {"kind": "released", "offset": wf.HEADER_LEN, "bytes": pos - wf.HEADER_LEN,
               "message": f"released to segments ({whole})"}
        # As replay: the file's first record and the one of the first live entry's batch.
        for at in sorted({wf.HEADER_LEN, pos - wf.COMMIT_LEN}):
            if (record := walcommits.decode_at(raw, at)) is not None:
                yield {"kind": "commit", "offset": at, "base": record[0],
                       "synced_through": record[1], "bytes": wf.COMMIT_LEN,
                       "message": "commit record in the released prefix"}
    # Walked by replay's own rule (``next_step``), so that fsck, which reads these rows,
    # predicts exactly the entries replay keeps and the sequences it loses.
    last: int | None = None  # sequence of the last sound entry: a successor's is higher
    skipped = 0  # bad entries skipped since it
    while pos < len(raw):
        step = next_step(raw, pos, max_entry_bytes=len(raw), last_sequence=last,
                         skipped=skipped, after_sequence=last, path=str(path))
        if step.kind == "tail":
            yield _tail_row(Path(path), pos, len(raw) - pos, step.reason) | {
                "commits": walcommits.found_in(raw, pos)}
            return
        if step.kind == "skip":
            yield from _skipped_rows(raw, pos, step.end, step.reason)
        else:
            e = step.entry
            assert e is not None
            yield _entry_row(e)
            if step.kind == "corrupt" and not _commit_shaped(e):
                skipped += 1  # a damaged record used no sequence
            elif e.entry_type in wf.KNOWN_ENTRY_TYPES:
                last, skipped = e.sequence, 0
        pos = step.end


def _commit_shaped(e: wf.DecodedEntry) -> bool:
    return e.entry_type == wf.ENTRY_COMMIT and e.total_len == wf.COMMIT_LEN


def _tail_row(path: Path, pos: int, nbytes: int, reason: str) -> dict[str, Any]:
    if layout.rotated_generation(path.name) is None:
        return {"kind": "torn_tail", "offset": pos, "bytes": nbytes, "message": reason}
    return {"kind": "skipped", "offset": pos, "bytes": nbytes,
            "message": f"damaged bytes at the end of a rotated file, which was fsynced "
                       f"whole (no torn write): {reason}"}


def _entry_row(e: wf.DecodedEntry) -> dict[str, Any]:
    parsed = e.sound and e.entry_type in wf.KNOWN_ENTRY_TYPES
    if e.entry_type == wf.ENTRY_COMMIT and e.sound:  # sequence: synced through; bitmap: base
        return {"kind": "commit", "offset": e.offset, "base": e.slot_bitmap,
                "synced_through": e.sequence, "ts_ns": e.ts_ns, "bytes": e.total_len,
                "message": (f"commit record: {e.slot_bitmap + 1}..{e.sequence} synced"
                            if e.sequence > e.slot_bitmap else
                            f"commit record: a writer began after sequence {e.slot_bitmap}")}
    return {
        "kind": "entry", "offset": e.offset, "sequence": e.sequence, "ts_ns": e.ts_ns,
        "entry_type": e.entry_type,
        "slots": [n for n in range(MAX_SLOTS) if e.slot_bitmap >> n & 1],
        "rows": sum(s.row_count for s in e.slots) if parsed else None,
        "payload_bytes": sum(len(s.ipc) for s in e.slots) if parsed else None,
        "bytes": e.total_len, "crc": "ok" if e.crc_ok else "bad", "problem": e.problem,
    }


def _skipped_rows(raw: bytes, pos: int, resync: int, reason: str) -> Iterator[dict[str, Any]]:
    """A leading zero run is a punched hole; what follows it up to ``resync`` is damage
    (or, right after a hole, the tail of an entry the hole's edge cut)."""
    match = NONZERO.search(raw, pos, resync)
    data_at = resync if match is None else match.start()
    if data_at > pos:
        yield {"kind": "hole", "offset": pos, "bytes": data_at - pos,
               "message": f"zeroed bytes (a punched hole), sound entry at {resync}"}
    if data_at < resync:
        yield {"kind": "skipped", "offset": data_at, "bytes": resync - data_at,
               "message": f"damaged bytes, sound entry at {resync}: {reason}",
               "commits": walcommits.found_in(raw, data_at, resync)}
