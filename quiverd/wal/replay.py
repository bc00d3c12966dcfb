"""WAL replay and dump: blocking file-level functions, run from worker threads.

Directory layout (SPEC §2, names from ``quiverd.kernel.layout``)::

    wal_dir/quiver.wal          active file, generation = active_generation
    wal_dir/quiver.wal.<gen>    rotated files, <gen> increasing, never renamed again
    wal_dir/truncate.offset     sidecar: (truncate_offset, rotation_generation) = the first
                                byte still needed, in the file of that generation

Replay reads the files in generation order from the sidecar position and applies
SPEC §3: torn tails are copied to quarantine then cut off; a bad entry with a valid
successor is quarantined, counted and skipped; unknown entry types are skipped by
length. Bytes are never dropped without a copy in ``quarantine_dir``.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any, Protocol

import msgspec

from quiverd.kernel import layout
from quiverd.kernel.bundle import Slot
from quiverd.kernel.durable import atomic_write
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.quarantine import keep_bytes
from quiverd.wal import format as wf

_NONZERO = re.compile(rb"[^\x00]")
_ZERO_LEN = bytes(wf.LEN_PREFIX_LEN)
_U32 = struct.Struct("<I")


class Logger(Protocol):
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...


class ReplayedEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A RecordBundle entry read back; ``slots`` own their payload bytes."""

    generation: int
    offset: int
    sequence: int
    ts_ns: int
    slots: tuple[Slot, ...]


class WalFile(msgspec.Struct, frozen=True, kw_only=True):
    generation: int
    path: Path
    size: int


class WalState(msgspec.Struct, kw_only=True):
    entries: list[ReplayedEntry]
    next_sequence: int
    sequence_known: bool  # False: a sidecar exists but no entry follows it; see replay_wal
    active_generation: int
    active_path: Path
    active_end_offset: int
    rotated: list[WalFile]
    start_generation: int
    start_offset: int
    corrupt_entries: int = 0
    torn_tail_bytes: int = 0
    sequence_gaps: int = 0
    resynced_bytes: int = 0  # skipped over damage (or a punched hole) to a later sound entry
    quarantined: list[Path] = msgspec.field(default_factory=list)


def create_wal_file(path: Path, cfg_hash: bytes) -> None:
    """A fresh WAL file holding only its header, created atomically and durably."""
    atomic_write(path, wf.encode_header(cfg_hash))


def write_sidecar(wal_dir: Path, truncate_offset: int, rotation_generation: int) -> None:
    atomic_write(layout.sidecar(wal_dir), wf.encode_sidecar(truncate_offset, rotation_generation))


def replay_wal(
    wal_dir: Path, quarantine_dir: Path, *, cfg_hash: bytes, max_entry_bytes: int, log: Logger
) -> WalState:
    """Recover one shard's WAL; raises CorruptRecord/FormatMismatch on any bad header.

    ``next_sequence`` is the last replayed sequence + 1, or 1 when no entry was
    found. When a sidecar exists but nothing follows it, the WAL no longer holds
    the last sequence: ``sequence_known`` is False and the caller must supply
    the floor from elsewhere.
    """
    wal_dir.mkdir(parents=True, exist_ok=True)
    active = layout.active_wal(wal_dir)
    created = not active.exists() or active.stat().st_size == 0
    if created:
        # An empty file has no header to protect: only then may we write one.
        create_wal_file(active, cfg_hash)
    inv = wal_inventory(wal_dir)
    active_gen, sidecar = inv.active_generation, inv.sidecar
    brand_new = created and len(inv.files) == 1
    if created:
        log.info("wal_created", path=str(active), generation=active_gen)
    if inv.sidecar_state != "ok":
        level = log.info if inv.sidecar_state == "missing" else log.warning
        level(f"wal_sidecar_{inv.sidecar_state}", path=str(layout.sidecar(wal_dir)),
              error=inv.sidecar_problem)
    chain = list(inv.files.items())
    for _, path in chain:
        with open(path, "rb") as f:
            wf.decode_header(f.read(wf.HEADER_LEN), path=str(path), expected_cfg_hash=cfg_hash)
    start_gen, start_off = (
        (sidecar.rotation_generation, sidecar.truncate_offset) if sidecar
        else (chain[0][0], wf.HEADER_LEN)
    )
    scan = _Scan(quarantine_dir, max_entry_bytes, log)
    sizes: dict[int, int] = {}
    for gen, path in chain:
        if gen < start_gen:
            sizes[gen] = path.stat().st_size
        else:
            first = start_off if gen == start_gen else wf.HEADER_LEN
            sizes[gen] = scan.replay_file(path, gen, first)
    last = scan.last_seq
    state = WalState(
        entries=scan.entries,
        next_sequence=1 if last is None else last + 1,
        sequence_known=(last is not None or brand_new
                        or inv.sidecar_state in ("missing", "corrupt")),
        active_generation=active_gen, active_path=active, active_end_offset=sizes[active_gen],
        rotated=[WalFile(generation=g, path=p, size=sizes[g]) for g, p in chain[:-1]],
        start_generation=start_gen, start_offset=start_off,
        corrupt_entries=scan.corrupt, torn_tail_bytes=scan.torn_bytes,
        sequence_gaps=scan.gaps, resynced_bytes=scan.resynced_bytes, quarantined=scan.quarantined,
    )
    log.info(
        "wal_replayed", entries=len(state.entries), next_sequence=state.next_sequence,
        active_generation=active_gen, corrupt_entries=scan.corrupt,
        torn_tail_bytes=scan.torn_bytes,
    )
    return state


class _Scan:
    """Replay state carried across files so sequence checks span rotations."""

    def __init__(self, quarantine_dir: Path, max_entry_bytes: int, log: Logger) -> None:
        self.quarantine_dir = quarantine_dir
        self.max_entry_bytes = max_entry_bytes
        self.log = log
        self.entries: list[ReplayedEntry] = []
        self.last_seq: int | None = None
        self.skipped = 0  # corrupt entries since the last good one: each used one sequence
        self.corrupt = 0
        self.torn_bytes = 0
        self.gaps = 0
        self.resynced_bytes = 0
        self.quarantined: list[Path] = []

    def replay_file(self, path: Path, gen: int, start: int) -> int:
        """Replay one file from ``start``; returns its size after any tail cut."""
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        pos = 0
        while pos < len(data):
            try:
                entry = wf.decode_entry(
                    data, pos, max_entry_bytes=self.max_entry_bytes, path=str(path)
                )
            except CorruptRecord as exc:
                resync = None if _runs_past_eof(data, pos) else self._resync(
                    path, gen, start, data, pos
                )
                if resync is None:
                    return self._cut_tail(path, gen, start, data, pos, str(exc))
                pos = resync
                continue
            if not entry.sound:
                if not self._successor_ok(data, pos + entry.total_len):
                    # Nothing after it: a damaged last entry is a torn tail, no search.
                    at_end = pos + entry.total_len == len(data)
                    resync = None if at_end else self._resync(path, gen, start, data, pos)
                    if resync is None:
                        return self._cut_tail(path, gen, start, data, pos, _why(entry))
                    pos = resync
                    continue
                self._quarantine_corrupt(path, gen, start + pos, data, entry)
            elif entry.entry_type in wf.KNOWN_ENTRY_TYPES:
                self._accept(entry, gen, start)
            else:
                self.log.info(
                    "wal_unknown_entry_skipped", path=str(path), offset=start + pos,
                    entry_type=entry.entry_type,
                )
            pos += entry.total_len
        return start + len(data)

    def _accept(self, entry: wf.DecodedEntry, gen: int, start: int) -> None:
        if self.last_seq is not None and entry.sequence != self.last_seq + 1 + self.skipped:
            self.gaps += 1
            self.log.error(
                "wal_sequence_gap", generation=gen, offset=start + entry.offset,
                expected=self.last_seq + 1 + self.skipped, sequence=entry.sequence,
            )
        self.last_seq = entry.sequence
        self.skipped = 0
        # Copy out of the file buffer: the file may be truncated or deleted later.
        slots = tuple(msgspec.structs.replace(s, ipc=bytes(s.ipc)) for s in entry.slots)
        self.entries.append(
            ReplayedEntry(
                generation=gen, offset=start + entry.offset, sequence=entry.sequence,
                ts_ns=entry.ts_ns, slots=slots,
            )
        )

    def _successor_ok(self, data: bytes, pos: int) -> bool:
        """Does a sound entry continue the sequence right after a damaged one?"""
        try:
            nxt = wf.decode_entry(data, pos, max_entry_bytes=self.max_entry_bytes)
        except CorruptRecord:
            return False
        if not nxt.sound:
            return False
        if nxt.entry_type not in wf.KNOWN_ENTRY_TYPES or self.last_seq is None:
            return True
        return nxt.sequence == self.last_seq + 2 + self.skipped

    def _resync(self, path: Path, gen: int, start: int, data: bytes, pos: int) -> int | None:
        """Offset of the next sound entry after damage at ``pos``, or None (a torn tail).

        With the sidecar lost, replay can walk into a punched hole (zeroed 4 KiB
        blocks of released entries) mid-entry; the intact entries after it must
        survive. Skipped non-zero bytes are quarantined.
        """
        resync = find_sound_entry(data, pos + 1, self.max_entry_bytes)
        if resync is None:
            return None
        skipped = memoryview(data)[pos:resync]
        if _NONZERO.search(skipped) is not None:
            self._quarantine(gen, start + pos, "skipped", skipped)
        self.resynced_bytes += resync - pos
        self.log.warning("wal_damage_skipped", path=str(path), offset=start + pos,
                         bytes=resync - pos, resumed_at=start + resync)
        return resync

    def _quarantine_corrupt(
        self, path: Path, gen: int, offset: int, data: bytes, entry: wf.DecodedEntry
    ) -> None:
        pos = entry.offset
        chunk = memoryview(data)[pos : pos + entry.total_len]
        target = self._quarantine(gen, offset, "corrupt", chunk)
        self.corrupt += 1
        self.skipped += 1
        self.log.error(
            "wal_corrupt_entry_skipped", path=str(path), offset=offset, bytes=entry.total_len,
            sequence=entry.sequence, reason=_why(entry), quarantine=str(target),
        )

    def _cut_tail(
        self, path: Path, gen: int, start: int, data: bytes, pos: int, reason: str
    ) -> int:
        """Copy ``data[pos:]`` to quarantine (durably) before truncating the file there."""
        offset = start + pos
        cut = len(data) - pos
        target = self._quarantine(gen, offset, "torn", memoryview(data)[pos:])
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.torn_bytes += cut
        self.log.warning(
            "wal_torn_tail", path=str(path), offset=offset, bytes=cut, reason=reason,
            quarantine=str(target),
        )
        return offset

    def _quarantine(self, gen: int, offset: int, kind: str, chunk: memoryview) -> Path:
        # Named by generation and offset, so a replay interrupted and rerun rewrites
        # the same file instead of piling up copies.
        name = layout.wal_quarantine_name(gen, offset, kind)
        target = keep_bytes(chunk, self.quarantine_dir, name)
        self.quarantined.append(target)
        return target


def find_sound_entry(data: bytes, cand: int, max_entry_bytes: int) -> int | None:
    """First sound RecordBundle entry at or after ``cand``, searched byte by byte.

    The search gives up after ``max_entry_bytes`` offsets past the last zero
    run: an intact entry must start within one entry length of the damage.
    Zero runs are jumped over whole (a hole may be far longer than an entry),
    and cheap checks (type byte, length bounds) reject most offsets before a CRC.
    """
    size = len(data)
    budget_end = cand + max_entry_bytes
    while cand + wf.ENTRY_OVERHEAD_LEN <= size and cand <= budget_end:
        if data[cand : cand + wf.LEN_PREFIX_LEN] == _ZERO_LEN:
            match = _NONZERO.search(data, cand)
            if match is None:
                return None
            # A non-zero length prefix starts at most 3 bytes before its first non-zero byte.
            cand = max(cand + 1, match.start() - (wf.LEN_PREFIX_LEN - 1))
            budget_end = cand + max_entry_bytes
            continue
        if data[cand + wf.LEN_PREFIX_LEN] == wf.ENTRY_RECORD_BUNDLE:
            (entry_len,) = _U32.unpack_from(data, cand)
            if (
                wf.ENTRY_FIXED_LEN <= entry_len <= max_entry_bytes
                and cand + entry_len + wf.LEN_PREFIX_LEN + wf.CRC_LEN <= size
                and wf.decode_entry(data, cand, max_entry_bytes=max_entry_bytes).sound
            ):
                return cand
        cand += 1
    return None


def _runs_past_eof(data: bytes, pos: int) -> bool:
    """A classic torn write: a plausible length whose entry the file does not finish."""
    if len(data) - pos < wf.LEN_PREFIX_LEN:
        return True
    (entry_len,) = _U32.unpack_from(data, pos)
    return entry_len > 0 and pos + wf.LEN_PREFIX_LEN + entry_len + wf.CRC_LEN > len(data)


def _why(entry: wf.DecodedEntry) -> str:
    return entry.problem or "crc mismatch"


class WalInventory(msgspec.Struct, frozen=True, kw_only=True):
    """The files of one WAL directory and the sidecar, as replay will see them."""

    files: dict[int, Path]  # generation -> path; the active file only if it exists
    active_generation: int
    sidecar: wf.Sidecar | None  # None when missing, corrupt or pointing nowhere
    sidecar_state: str  # ok | missing | corrupt | out_of_range
    sidecar_problem: str = ""  # why a present sidecar is unusable

    def generation_of(self, path: Path) -> int | None:
        if layout.is_active_wal(path.name):
            return self.active_generation
        return layout.rotated_generation(path.name)


def wal_inventory(wal_dir: Path) -> WalInventory:
    """Read-only: generations and the usable sidecar (same rules as ``replay_wal``)."""
    rotated = {
        gen: p for p in wal_dir.iterdir() if (gen := layout.rotated_generation(p.name)) is not None
    } if wal_dir.is_dir() else {}
    sidecar: wf.Sidecar | None = None
    state, problem = "missing", ""
    sidecar_path = layout.sidecar(wal_dir)
    if sidecar_path.exists():
        try:
            sidecar = wf.decode_sidecar(sidecar_path.read_bytes(), path=str(sidecar_path))
            state = "ok"
        except CorruptRecord as exc:
            state, problem = "corrupt", str(exc)
    active_gen = max(max(rotated) + 1 if rotated else 0,
                     sidecar.rotation_generation if sidecar else 0)
    files = dict(sorted(rotated.items()))
    if layout.active_wal(wal_dir).exists():
        files[active_gen] = layout.active_wal(wal_dir)
    if sidecar is not None:
        target = files.get(sidecar.rotation_generation)
        if target is None or not wf.HEADER_LEN <= sidecar.truncate_offset <= target.stat().st_size:
            problem = (f"sidecar points at generation {sidecar.rotation_generation} offset "
                       f"{sidecar.truncate_offset}, which no WAL file holds: replay ignores it")
            state, sidecar = "out_of_range", None
    return WalInventory(files=files, active_generation=active_gen, sidecar=sidecar,
                     sidecar_state=state, sidecar_problem=problem)


def live_start(path: Path, size: int) -> int:
    """First byte of ``path`` a valid sidecar beside it still needs (``size``: none)."""
    inv = wal_inventory(path.parent)
    gen = inv.generation_of(path)
    sidecar = inv.sidecar
    if sidecar is None or gen is None or gen > sidecar.rotation_generation:
        return wf.HEADER_LEN
    if gen < sidecar.rotation_generation:
        return size
    return min(sidecar.truncate_offset, size)
