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
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Protocol

import msgspec
import pyarrow as pa

from quiverd.kernel import layout
from quiverd.kernel.bundle import META_SLOT, Slot, stream_facts
from quiverd.kernel.durable import atomic_write, fsync_dir, with_path
from quiverd.kernel.quarantine import keep_bytes
from quiverd.wal import format as wf
from quiverd.wal.disk import NO_SPACE
from quiverd.wal.inventory import wal_inventory
from quiverd.wal.resync import NONZERO, next_step


class Logger(Protocol):
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...


class Coverage(Protocol):
    """The WAL sequences other files hold: durable segments and the DELETED marker."""

    @property
    def high(self) -> int:
        """The highest sequence they hold (0: none); the WAL's live part starts above it."""
        ...

    def unheld(self, first: int, last: int) -> list[tuple[int, int]]:
        """The ranges of ``first..last`` none of them holds, ascending."""
        ...


class ReplayedEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A RecordBundle entry read back. User slots are views over the file's read-only
    memory map with their schema and batch count filled in (the open segment needs no
    more: the finalizer reads the bytes back from the WAL); the metadata slot is a copy.
    A slot whose IPC stream does not even open carries no facts: the open segment then
    decodes it itself and reports it as it did before."""

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
    # Sequences skipped damage held and no segment holds: acknowledged entries now lost.
    lost_sequences: list[tuple[int, int]] = msgspec.field(default_factory=list)
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
    wal_dir.mkdir(parents=True, exist_ok=True)
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
    scan = _Scan(quarantine_dir, max_entry_bytes, log, covered)
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
        lost_sequences=scan.lost, deferred_cut_target=scan.deferred_cut_target,
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
    try:
        create_wal_file(active, cfg_hash)
        return True
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        layout.tmp_path(active).unlink(missing_ok=True)
    fd = os.open(active, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.close(fd)
    fsync_dir(active.parent)
    log.warning("wal_header_deferred", path=str(active), error="no space left on device",
                hint="the header is written before the first append, once space returns")
    return False


class _Scan:
    """Replay state carried across files so sequence checks span rotations."""

    def __init__(self, quarantine_dir: Path, max_entry_bytes: int, log: Logger,
                 covered: Coverage | None) -> None:
        self.quarantine_dir = quarantine_dir
        self.max_entry_bytes = max_entry_bytes
        self.log = log
        self.covered = covered
        self.entries: list[ReplayedEntry] = []
        self.last_seq: int | None = None
        self.skipped = 0  # corrupt entries since the last good one: each used one sequence
        self.damaged = False  # bytes skipped since the last good entry: settled by the next
        self.corrupt = 0
        self.torn_bytes = 0
        self.gaps = 0
        self.resynced_bytes = 0
        self.quarantined: list[Path] = []
        self.lost: list[tuple[int, int]] = []
        self.deferred_cut_target: Path | None = None

    def replay_file(self, path: Path, gen: int, start: int, *, active: bool) -> int:
        """Replay one file from ``start``; returns its size after any tail cut.

        The file is memory-mapped, not read: a WAL of several GiB costs page cache, not
        a copy in the daemon's memory, and each byte is touched once (the CRC pass).
        """
        data = _map_from(path, start)
        pos = 0
        while pos < len(data):
            step = next_step(data, pos, max_entry_bytes=self.max_entry_bytes,
                             last_sequence=self.last_seq, skipped=self.skipped,
                             after_sequence=self._after(), path=str(path))
            if step.kind == "tail":
                if active:
                    return self._cut_tail(path, gen, start, data, pos, step.reason)
                self._skip_tail(path, gen, start, data, pos, step.reason)
                break
            if step.kind == "skip":
                self._skip(path, gen, start, data, pos, step.end)
            elif step.kind == "corrupt":
                assert step.entry is not None
                self._quarantine_corrupt(path, gen, start + pos, data, step.entry)
            else:
                assert step.entry is not None
                self._take(path, gen, start, step.entry)
            pos = step.end
        return start + len(data)

    def _after(self) -> int | None:
        """The sequence a resync must find an entry above (sequences only grow)."""
        if self.last_seq is not None:
            return self.last_seq
        return self.covered.high if self.covered is not None else None

    def _take(self, path: Path, gen: int, start: int, entry: wf.DecodedEntry) -> None:
        if entry.entry_type in wf.KNOWN_ENTRY_TYPES:
            self._accept(entry, gen, start)
        else:
            self.log.info(
                "wal_unknown_entry_skipped", path=str(path), offset=start + entry.offset,
                entry_type=entry.entry_type,
            )

    def _accept(self, entry: wf.DecodedEntry, gen: int, start: int) -> None:
        if self.damaged:
            self._settle(entry.sequence, gen, start + entry.offset)
        if self.last_seq is not None and entry.sequence != self.last_seq + 1 + self.skipped:
            self.gaps += 1
            self.log.error(
                "wal_sequence_gap", generation=gen, offset=start + entry.offset,
                expected=self.last_seq + 1 + self.skipped, sequence=entry.sequence,
            )
        self.last_seq = entry.sequence
        self.skipped = 0
        # The metadata slot is copied (tiny, decoded later); user slots stay views of
        # the map, with what the open segment needs from them.
        slots = tuple(msgspec.structs.replace(s, ipc=bytes(s.ipc)) if s.slot == META_SLOT
                      else _with_facts(s) for s in entry.slots)
        self.entries.append(
            ReplayedEntry(
                generation=gen, offset=start + entry.offset, sequence=entry.sequence,
                ts_ns=entry.ts_ns, slots=slots,
            )
        )

    def _settle(self, sequence: int, gen: int, offset: int) -> None:
        """Damage was skipped before the entry of ``sequence``: which sequences did it hold?

        They lie between the last sequence before the damage (or, at the start of the
        live part, the highest one segments hold) and ``sequence``; those no segment
        holds are lost. Without either bound only the bad entries seen can be counted.
        """
        prev = self.last_seq if self.last_seq is not None else (
            self.covered.high if self.covered is not None else None)
        self.damaged = False
        if prev is None or sequence <= prev + 1:
            self.corrupt += self.skipped if prev is None else 0
            return
        first, last = prev + 1, sequence - 1
        lost = [(first, last)] if self.covered is None else self.covered.unheld(first, last)
        if not lost:
            return
        count = sum(hi - lo + 1 for lo, hi in lost)
        self.corrupt += count
        self.lost.extend(lost)
        self.log.error("wal_entries_lost", generation=gen, resumed_at=offset, entries=count,
                       first_sequence=lost[0][0], last_sequence=lost[-1][1])

    def finish(self) -> None:
        """Damage after the last good entry: only the bad entries seen can be counted."""
        if self.damaged:
            self.corrupt += self.skipped
            self.damaged = False

    def _skip(self, path: Path, gen: int, start: int, data: memoryview, pos: int,
              resync: int) -> None:
        """Damage at ``pos`` up to the next sound entry at ``resync`` is skipped.

        With the sidecar lost, replay can walk into a punched hole (zeroed 4 KiB
        blocks of released entries) mid-entry; the intact entries after it must
        survive. Skipped non-zero bytes are quarantined before they are skipped.
        """
        skipped = memoryview(data)[pos:resync]
        if NONZERO.search(skipped) is not None:
            self._quarantine(gen, start + pos, "skipped", skipped)
        # Zeros too: a punched hole's entries are held by segments (``covered`` says
        # so); zeroed blocks in the live part are not, and those entries are lost.
        self.damaged = True
        self.resynced_bytes += resync - pos
        self.log.warning("wal_damage_skipped", path=str(path), offset=start + pos,
                         bytes=resync - pos, resumed_at=start + resync)

    def _skip_tail(self, path: Path, gen: int, start: int, data: memoryview, pos: int,
                   reason: str) -> None:
        """Damage at the end of a rotated file: it was fsynced whole, so no torn write.

        The bytes stay (replay is rerun on them, rewriting the same copy); the
        next file's first entry tells which sequences they held.
        """
        target = self._quarantine(gen, start + pos, "skipped", memoryview(data)[pos:])
        self.damaged = True
        self.resynced_bytes += len(data) - pos
        self.log.error("wal_damage_skipped", path=str(path), offset=start + pos,
                       bytes=len(data) - pos, resumed_at=None, reason=reason,
                       quarantine=str(target))

    def _quarantine_corrupt(
        self, path: Path, gen: int, offset: int, data: memoryview, entry: wf.DecodedEntry
    ) -> None:
        pos = entry.offset
        chunk = memoryview(data)[pos : pos + entry.total_len]
        target = self._quarantine(gen, offset, "corrupt", chunk)
        self.skipped += 1
        self.damaged = True
        self.log.error(
            "wal_corrupt_entry_skipped", path=str(path), offset=offset, bytes=entry.total_len,
            sequence=entry.sequence, reason=_why(entry), quarantine=str(target),
        )

    def _cut_tail(
        self, path: Path, gen: int, start: int, data: memoryview, pos: int, reason: str
    ) -> int:
        """Copy ``data[pos:]`` to quarantine (durably) before truncating the file there.

        No space for the copy (a 100 % full disk): the bytes stay where they are and
        the start goes on; the file ends, for the writer, at ``offset``, and its first
        append copies and cuts them (``WalFiles``), so nothing is dropped uncopied.
        """
        offset = start + pos
        cut = len(data) - pos
        name = layout.wal_quarantine_name(gen, offset, "torn")
        try:
            target = keep_bytes(memoryview(data)[pos:], self.quarantine_dir, name)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            layout.tmp_path(self.quarantine_dir / name).unlink(missing_ok=True)
            self.deferred_cut_target = self.quarantine_dir / name
            self.log.warning("wal_torn_tail_deferred", path=str(path), offset=offset,
                             bytes=cut, reason=reason, error=exc.strerror or str(exc),
                             hint="no space to copy the torn bytes into quarantine/: they "
                             "stay in the file until the first write after space returns")
            return offset
        self.quarantined.append(target)
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, offset)
            os.fsync(fd)
        except OSError as exc:
            raise with_path(exc, path) from exc
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


def _map_from(path: Path, start: int) -> memoryview:
    """The file's bytes from ``start`` as a read-only map (empty view for no bytes)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size <= start:
            return memoryview(b"")
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    mm.madvise(mmap.MADV_SEQUENTIAL)
    return memoryview(mm)[start:]


def _with_facts(slot: Slot) -> Slot:
    try:
        schema, batches = stream_facts(slot.ipc)
    except (pa.ArrowInvalid, OSError, ValueError):
        return slot
    return msgspec.structs.replace(slot, schema=schema, batches=batches)


def _why(entry: wf.DecodedEntry) -> str:
    return entry.problem or "crc mismatch"
