"""One pass of WAL replay over the files of a shard (``replay.replay_wal`` drives it).

Per file, from a start offset, through a read-only memory map::

    [released prefix, maybe punched holes][entry][entry]...[damage?][entry]...[torn tail?]
     stepped over unread                   next_step: entry | corrupt | skip | tail

SPEC §3: a bad entry with a sound successor is quarantined and skipped, bytes that are
no entry are skipped to the next sound entry, damage with nothing sound after it in the
active file is a torn tail: copied to quarantine, then cut. Holes are never read through
the map (on a full tmpfs that is SIGBUS). Blocking: runs in the recovery thread.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Protocol

import msgspec
import pyarrow as pa

from quiverd.kernel import fs, layout
from quiverd.kernel.bundle import META_SLOT, Slot, stream_facts
from quiverd.kernel.durable import with_path
from quiverd.kernel.quarantine import keep_bytes
from quiverd.wal import commits as walcommits
from quiverd.wal import format as wf
from quiverd.wal.disk import NO_SPACE, holes
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


class Scan:
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
        # Damage between sound entries that commit records show was never synced.
        self.never_acked: list[tuple[int, int]] = []
        self.commits: list[tuple[int, int]] = []  # (base, synced_through) of every record
        self._settled: list[tuple[list[tuple[int, int]], int, int]] = []  # (ranges, gen, at)
        self.deferred_cut_target: Path | None = None

    def replay_file(self, path: Path, gen: int, start: int, *, active: bool) -> int:
        """Replay one file from ``start``; returns its size after any tail cut.

        The file is memory-mapped, not read: a WAL of several GiB costs page cache, not
        a copy in the daemon's memory, and each byte is touched once (the CRC pass).
        """
        data, found = _map_from(path, start)
        pos = 0
        if start >= wf.HEADER_LEN + wf.COMMIT_LEN:
            # Records a release left before the start still speak (SPEC §3): the one
            # before the first live entry (its batch's) and the file's first (a life's
            # or a file's first record, synced; block 0 is never punched).
            with open(path, "rb") as f:
                for at in {wf.HEADER_LEN, start - wf.COMMIT_LEN}:
                    f.seek(at)
                    record = walcommits.decode_at(f.read(wf.COMMIT_LEN), 0)
                    if record is not None:
                        self.commits.append(record)
        if found:
            data, pos = self._step_over_holes(path, start, data, found)
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

    def _step_over_holes(self, path: Path, start: int, data: memoryview,
                         found: list[tuple[int, int]]) -> tuple[memoryview, int]:
        """Holes past ``start`` (the sidecar was lost): the view to scan and where to begin.

        Holes are punched only into released bytes, below the first live entry, so
        everything before the end of the last one is released: skipped unread (a hole
        read through the map makes tmpfs allocate a page: SIGBUS when it is full).
        The next sound entry settles which sequences that held, as for any damage. A
        hole running to the end of the file ends the view: nothing follows it.
        """
        end = start + len(data)
        if found[-1][1] >= end:
            data, found = data[:found[-1][0] - start], found[:-1]
        if not found:
            return data, 0
        resume = found[-1][1] - start
        self.damaged = True
        self.resynced_bytes += resume
        self.log.warning("wal_holes_skipped", path=str(path), offset=start, bytes=resume,
                         holes=len(found), resumed_at=start + resume)
        return data, resume

    def _after(self) -> int | None:
        """The sequence a resync must find an entry above (sequences only grow)."""
        if self.last_seq is not None:
            return self.last_seq
        return self.covered.high if self.covered is not None else None

    def _take(self, path: Path, gen: int, start: int, entry: wf.DecodedEntry) -> None:
        if entry.entry_type == wf.ENTRY_COMMIT and entry.total_len == wf.COMMIT_LEN:
            self.commits.append((entry.slot_bitmap, entry.sequence))
        elif entry.entry_type in wf.KNOWN_ENTRY_TYPES:
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
        self._settled.append((lost, gen, offset))

    def finish(self) -> None:
        """Damage after the last good entry: only the bad entries seen can be counted.

        Damage between sound entries is settled here, once every commit record has
        been read: what none vouches for as synced was a torn unsynced write
        (``quiverd.wal.commits``), never acknowledged; the rest is lost.
        """
        if self.damaged:
            self.corrupt += self.skipped
            self.damaged = False
        for ranges, gen, offset in self._settled:
            lost, never = walcommits.split_unsynced(ranges, self.commits)
            if lost:
                count = sum(hi - lo + 1 for lo, hi in lost)
                self.corrupt += count
                self.lost.extend(lost)
                self.log.error("wal_entries_lost", generation=gen, resumed_at=offset,
                               entries=count, first_sequence=lost[0][0],
                               last_sequence=lost[-1][1])
            if never:
                self.never_acked.extend(never)
                self.log.warning(
                    "wal_unsynced_entries_torn", generation=gen, resumed_at=offset,
                    entries=sum(hi - lo + 1 for lo, hi in never), first_sequence=never[0][0],
                    last_sequence=never[-1][1], hint="written but never synced, so never "
                    "acknowledged: the crash tore them (copied to quarantine/); producers "
                    "resend what was not acknowledged")
        self._settled = []

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
            self.commits.extend(walcommits.found_in(data, pos, resync))
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
        self.commits.extend(walcommits.found_in(data, pos))
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
        if not (entry.entry_type == wf.ENTRY_COMMIT and entry.total_len == wf.COMMIT_LEN):
            self.skipped += 1  # a damaged commit record used no sequence
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
        self.commits.extend(walcommits.found_in(data, pos))
        name = layout.wal_quarantine_name(gen, offset, "torn")
        try:
            target = keep_bytes(memoryview(data)[pos:], self.quarantine_dir, name)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            fs.active().unlink(layout.tmp_path(self.quarantine_dir / name), missing_ok=True)
            self.deferred_cut_target = self.quarantine_dir / name
            self.log.warning("wal_torn_tail_deferred", path=str(path), offset=offset,
                             bytes=cut, reason=reason, error=exc.strerror or str(exc),
                             hint="no space to copy the torn bytes into quarantine/: they "
                             "stay in the file until the first write after space returns")
            return offset
        self.quarantined.append(target)
        seam = fs.active()
        fd = seam.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            seam.ftruncate(fd, offset)
            seam.fsync(fd)
        except OSError as exc:
            raise with_path(exc, path) from exc
        finally:
            seam.close(fd)
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
        try:
            target = keep_bytes(chunk, self.quarantine_dir, name)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            # Skipping cuts nothing: the bytes stay in the WAL file, and the next
            # replay that finds space writes this copy. A full disk must not stop a start.
            target = self.quarantine_dir / name
            fs.active().unlink(layout.tmp_path(target), missing_ok=True)
            self.log.warning("wal_quarantine_deferred", path=str(target), offset=offset,
                             bytes=len(chunk), error=exc.strerror or str(exc))
            return target
        self.quarantined.append(target)
        return target


def _map_from(path: Path, start: int) -> tuple[memoryview, list[tuple[int, int]]]:
    """The file's bytes from ``start`` as a read-only map (empty view for no bytes),
    and the holes in them (never to be read through the map)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size <= start:
            return memoryview(b""), []
        found = holes(fd, start, size)
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    mm.madvise(mmap.MADV_SEQUENTIAL)
    return memoryview(mm)[start:], found


def _with_facts(slot: Slot) -> Slot:
    try:
        schema, batches = stream_facts(slot.ipc)
    except (pa.ArrowInvalid, OSError, ValueError):
        return slot
    return msgspec.structs.replace(slot, schema=schema, batches=batches)


def _why(entry: wf.DecodedEntry) -> str:
    return entry.problem or "crc mismatch"
