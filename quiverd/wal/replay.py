"""WAL replay and dump: blocking file-level functions, run from worker threads.

Directory layout (SPEC §2, names from ``quiverd.kernel.layout``)::

    wal_dir/quiver.wal          active file, generation = active_generation
    wal_dir/quiver.wal.<gen>    rotated files, <gen> increasing, never renamed again
    wal_dir/truncate.offset     sidecar: (truncate_offset, rotation_generation) = the first
                                byte still needed, in the file of that generation

Replay reads the files in generation order from the sidecar position and applies
SPEC §3: a bad entry with a valid successor is quarantined, counted and skipped; bytes
that are no entry at all (a length below the header, above the maximum or beyond the
end of the file) are skipped up to the next sound entry (``resync``), so every later
valid entry is kept; only damage with no sound entry after it in the active file is a
torn tail, copied to quarantine then cut off. Rotated files were fsynced whole before
rotation: damage at their end is skipped, never cut. Unknown entry types are skipped by
length. Bytes are never dropped without a copy in ``quarantine_dir``.

Every skip is accounted for: the sequences between the last entry before it and the
first after it that ``covered`` (durable segments, the DELETED marker) does not hold
are lost, counted in ``corrupt_entries`` and listed in ``lost_sequences``.

The pass over the files is ``scan.Scan``. On a full disk replay still finishes: a torn
tail with no space for its copy stays where it is (``WalFiles`` cuts it before its first
append), a new active file stays empty until it can get its header, and punched holes
(the sidecar lost) are stepped over unread.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from quiverd.kernel import fs, layout
from quiverd.kernel.durable import atomic_write, fsync_dir
from quiverd.wal import format as wf
from quiverd.wal.disk import NO_SPACE
from quiverd.wal.inventory import wal_inventory
from quiverd.wal.scan import Coverage, Logger, ReplayedEntry, Scan

__all__ = ["Coverage", "Logger", "ReplayedEntry", "WalFile", "WalState", "create_wal_file",
           "replay_wal", "write_sidecar"]


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
    # Sequences skipped damage held and no segment holds: acknowledged entries now lost.
    lost_sequences: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # Damage between sound entries no commit record vouches for as synced: a torn
    # unsynced write, never acknowledged (``quiverd.wal.commits``); not loss.
    never_acked: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # A torn tail whose copy found no space stays in the active file past
    # active_end_offset: the first append cuts it (copy to this target first).
    deferred_cut_target: Path | None = None


def create_wal_file(path: Path, cfg_hash: bytes) -> None:
    """A fresh WAL file holding only its header, created atomically and durably."""
    atomic_write(path, wf.encode_header(cfg_hash))


def write_sidecar(wal_dir: Path, truncate_offset: int, rotation_generation: int) -> None:
    atomic_write(layout.sidecar(wal_dir), wf.encode_sidecar(truncate_offset, rotation_generation))


def replay_wal(
    wal_dir: Path, quarantine_dir: Path, *, cfg_hash: bytes, max_entry_bytes: int, log: Logger,
    covered: Coverage | None = None,
) -> WalState:
    """Recover one shard's WAL; raises CorruptRecord/FormatMismatch on any bad header.

    ``next_sequence`` is the last replayed sequence + 1, or 1 when no entry was
    found. When a sidecar exists but nothing follows it, the WAL no longer holds
    the last sequence: ``sequence_known`` is False and the caller must supply
    the floor from elsewhere. ``covered`` tells which skipped sequences are not
    lost (and where the live part starts); without it every skipped one is.
    """
    fs.active().mkdir(wal_dir)
    active = layout.active_wal(wal_dir)
    created = not active.exists() or active.stat().st_size == 0
    # An empty file has no header to protect: only then may we write one.
    header_pending = created and not _create_active(active, cfg_hash, log)
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
        if header_pending and path == active:
            continue
        with open(path, "rb") as f:
            wf.decode_header(f.read(wf.HEADER_LEN), path=str(path), expected_cfg_hash=cfg_hash)
    start_gen, start_off = (
        (sidecar.rotation_generation, sidecar.truncate_offset) if sidecar
        else (chain[0][0], wf.HEADER_LEN)
    )
    scan = Scan(quarantine_dir, max_entry_bytes, log, covered)
    sizes: dict[int, int] = {}
    for gen, path in chain:
        if gen < start_gen or (header_pending and gen == active_gen):
            sizes[gen] = path.stat().st_size
        else:
            first = start_off if gen == start_gen else wf.HEADER_LEN
            sizes[gen] = scan.replay_file(path, gen, first, active=gen == active_gen)
    scan.finish()
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
        lost_sequences=scan.lost, never_acked=scan.never_acked,
        deferred_cut_target=scan.deferred_cut_target,
    )
    log.info(
        "wal_replayed", entries=len(state.entries), next_sequence=state.next_sequence,
        active_generation=active_gen, corrupt_entries=scan.corrupt,
        torn_tail_bytes=scan.torn_bytes, resynced_bytes=scan.resynced_bytes,
    )
    return state


def _create_active(active: Path, cfg_hash: bytes, log: Logger) -> bool:
    """Write the header of a new (or empty) active file; False: no space, left empty.

    A new shard on a 100 % full disk still starts: its active file stays empty (an
    inode, no data block) and ``WalFiles`` writes the header before its first append.
    """
    seam = fs.active()
    try:
        create_wal_file(active, cfg_hash)
        return True
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        seam.unlink(layout.tmp_path(active), missing_ok=True)
    fd = seam.open(active, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    seam.close(fd)
    fsync_dir(active.parent)
    log.warning("wal_header_deferred", path=str(active), error="no space left on device",
                hint="the header is written before the first append, once space returns")
    return False
