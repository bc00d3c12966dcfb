"""A shard's WAL files on disk: append, group-commit sync, rotate, release.

Blocking code, called from the WAL writer actor through worker threads. The
byte layout lives in ``walformat``; this module owns file handles and space:

    wal/quiver.wal            active file, generation G (appends go here)
    wal/quiver.wal.<g>        rotated files, g < G, deleted whole once released
    wal/truncate.offset       sidecar: (offset, generation) of the first byte
                              still needed for crash recovery

Capacity: ``max_size_bytes`` bounds the live bytes of all files and
``max_chunks`` the file count (active included). The active file rotates when
an append would take it past ``max_size_bytes / max_chunks``. When a bound is
hit the caller waits or refuses (``at_capacity``): nothing is ever dropped.

Disk full: an append that would leave less than ``reserve_bytes`` free on the
filesystem, or whose write fails with ENOSPC/EDQUOT, raises ``WalNoSpace``
naming how many of its entries made it; the file is cut back (ftruncate) to
where the others would have started, so no torn entry sits in front of later
appends. Any other I/O failure, and any failed fsync, raises DurabilityLost.

Every change to a file goes through the seam captured once at construction
(``self._fs = fs.active()``): one attribute lookup per call on the hot path.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiverd.kernel import fs, layout
from quiverd.kernel.bundle import META_SLOT, Buffer, Slot
from quiverd.kernel.durable import atomic_write, fsync_dir, with_path
from quiverd.kernel.errors import CorruptRecord, DurabilityLost
from quiverd.kernel.faults import Hook
from quiverd.kernel.quarantine import keep_bytes
from quiverd.wal import format as walformat
from quiverd.wal.disk import (
    BLOCK,
    NO_SPACE,
    PUNCH_UNSUPPORTED,
    WalNoSpace,
    copy_live_tail,
    create_fresh,
    free_bytes,
    probe_punch_hole,
    punch_hole,
    reason_of,
    write_sidecar,
)

__all__ = ["BLOCK", "EntryToWrite", "WalFiles", "WalNoSpace", "probe_punch_hole", "punch_hole"]

# (sequence, (ingestion_ts_ns, slots), encoded size): encoded in the write's worker hop
EntryToWrite = tuple[int, tuple[int, tuple[Slot, ...]], int]
IOV_MAX = 512


@dataclass
class _Rotated:
    generation: int
    size: int


@dataclass
class WalFiles:
    """Open WAL of one shard. Not thread-safe except ``sync`` vs ``append``."""

    wal_dir: Path
    cfg_hash: bytes
    max_size_bytes: int
    max_chunks: int
    log: Any
    generation: int = 0
    end_offset: int = 0
    punch_supported: bool = True
    reserve_bytes: int = 0  # free space an append must leave on the filesystem
    fault_hook: Hook | None = None  # tests: raises at a step to simulate an I/O error
    last_sync_seconds: float = 0.0
    # Commit records (SPEC §3, ``quiverd.wal.commits``): written unless the flush
    # policy never syncs. ``synced_through``: the highest sequence an fdatasync that
    # returned covered; ``base``: the last sequence when this writer began.
    commits: bool = True
    synced_through: int = 0
    base: int = 0
    _written_through: int = 0  # the highest sequence whose write returned
    _committed: int | None = None  # synced_through of the active file's last record
    _fd: int = -1
    _rotated: list[_Rotated] = field(default_factory=list)
    # (sequence, generation, offset) of every entry not yet released: bounded by
    # the WAL's own size bound, because released entries are popped.
    _index: deque[tuple[int, int, int]] = field(default_factory=deque)
    _released_offset: int = 0  # bytes of the active file already reclaimed
    # Replay found a torn tail and no space to copy it: it lies past end_offset until
    # the first append copies it here and cuts it (see _cut_deferred_tail).
    _deferred_cut: Path | None = None
    # _lock guards the fd swap (rotate, rewrite) against a concurrent fdatasync;
    # _mutex serializes append and release, which both change the file layout.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _mutex: threading.Lock = field(default_factory=threading.Lock)
    _fs: fs.FileSystem = field(default_factory=fs.active)  # the seam, captured once

    # ---- opening -----------------------------------------------------------------------
    @classmethod
    def open(cls, wal_dir: Path, state: Any, *, cfg_hash: bytes, max_size_bytes: int,
             max_chunks: int, log: Any) -> WalFiles:
        """Open the active file after replay (``state`` is walreplay's WalState)."""
        self = cls(wal_dir=wal_dir, cfg_hash=cfg_hash, max_size_bytes=max_size_bytes,
                   max_chunks=max_chunks, log=log)
        self.generation = state.active_generation
        self.end_offset = state.active_end_offset
        for r in state.rotated:
            self._rotated.append(_Rotated(r.generation, r.size))
        for e in state.entries:
            self._index.append((e.sequence, e.generation, e.offset))
        if state.start_generation == self.generation and state.start_offset > walformat.HEADER_LEN:
            # The sidecar's prefix was released before the restart: not live bytes.
            self._released_offset = state.start_offset - walformat.HEADER_LEN
        self._deferred_cut = getattr(state, "deferred_cut_target", None)
        self._fd = self._fs.open(layout.active_wal(wal_dir), os.O_WRONLY | os.O_CLOEXEC)
        os.lseek(self._fd, self.end_offset, os.SEEK_SET)
        self.punch_supported = probe_punch_hole(wal_dir)
        return self

    def begin(self, last_sequence: int, *, vouch_above: int = 0) -> None:
        """A writer's life starts after ``last_sequence`` (recovery's next_sequence - 1).

        What replay kept is made durable first (a kill -9 leaves it in the page cache
        only), so this life's records vouch for it as synced: for every sequence above
        ``vouch_above`` (the highest one replay found torn and never acknowledged), never
        for what replay skipped as such.
        """
        if self.end_offset > walformat.HEADER_LEN:
            self._fdatasync("begin_fdatasync")
        self.synced_through = self._written_through = last_sequence
        self.base = min(vouch_above, last_sequence)
        self._committed = None

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                self._fs.close(self._fd)
                self._fd = -1

    # ---- capacity --------------------------------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        return max(self.max_size_bytes // self.max_chunks, walformat.HEADER_LEN + 1)

    @property
    def live_bytes(self) -> int:
        rotated = sum(r.size for r in self._rotated)
        return rotated + self.end_offset - self._released_offset

    @property
    def file_count(self) -> int:
        return len(self._rotated) + 1

    def fits(self, nbytes: int) -> bool:
        """May an entry of ``nbytes`` be appended now (rotating if needed)?"""
        return self.fits_batch([nbytes])

    def fits_batch(self, sizes: Sequence[int]) -> bool:
        """May entries of these sizes be appended in one ``append`` call?

        Walks them as ``_append`` will, rotation included, so a batch meets both
        bounds entry by entry. Only the first entry into an empty WAL may pass
        ``max_size_bytes`` (an entry larger than the bound must still go somewhere).
        """
        return self.fitting_prefix(sizes) == len(sizes)

    def fitting_prefix(self, sizes: Sequence[int]) -> int:
        """How many of these entries, from the first, fit in one ``append`` call now."""
        live, end, files = self.live_bytes, self.end_offset, self.file_count
        has_entries = self._has_entries()
        record = walformat.COMMIT_LEN if self.commits else 0  # at most one per file part
        for i, nbytes in enumerate(sizes):
            first = record if i == 0 else 0
            if live + nbytes + first > self.max_size_bytes and has_entries:
                return i
            if end > walformat.HEADER_LEN and end + nbytes + first > self.chunk_bytes:
                if files >= self.max_chunks:
                    return i
                files, end = files + 1, walformat.HEADER_LEN
                live += walformat.HEADER_LEN
                first = record
            live, end, has_entries = live + nbytes + first, end + nbytes + first, True
        return len(sizes)

    def _has_entries(self) -> bool:
        return bool(self._index)

    def _needs_rotation(self, nbytes: int) -> bool:
        active_has_data = self.end_offset > walformat.HEADER_LEN
        return active_has_data and self.end_offset + nbytes > self.chunk_bytes

    def _record_due(self) -> bool:
        """Does the active file need a commit record before its next entry?"""
        return self.commits and (self._committed is None
                                 or self.synced_through > self._committed)

    def _record(self) -> bytes:
        synced = self.synced_through
        self._committed = synced
        return walformat.encode_commit(base=self.base, synced_through=synced,
                                       ts_ns=time.time_ns())

    # ---- append and sync -------------------------------------------------------------
    def append(self, entries: list[EntryToWrite], *, sync: bool) -> None:
        """Encode and write ``(sequence, (ts_ns, slots), size)`` entries in order.

        fdatasync too if ``sync``. The caller checked ``fits`` for each entry. One
        call is one thread hop; the CRC over the payloads is computed here. On a
        full disk raises WalNoSpace: its first ``written`` entries are in the file,
        not synced even if ``sync`` was asked, and nothing of the others is.
        """
        with self._mutex:
            if self.end_offset == 0:
                self._create_header()
            if self._deferred_cut is not None:
                self._cut_deferred_tail(self._deferred_cut)
            self._check_space(sum(e[2] for e in entries) + walformat.COMMIT_LEN)
            self._append(entries)
        if sync:
            self.sync()

    def commit_idle(self, *, sync: bool = False) -> bool:
        """The writer is idle (or stopping): record the frontier if it moved since the
        active file's last record, so that damage to what was synced is never taken for
        a torn unsynced write. Skipped (False) while an append holds the file, when the
        record would need a new file or the disk is full; ``sync``: make it durable.
        """
        if not self._mutex.acquire(blocking=False):
            return False
        try:
            last = self._committed if self._committed is not None else self.base
            if (not self.commits or self._fd < 0 or self.end_offset == 0
                    or self._deferred_cut is not None or self.synced_through <= last
                    or self.end_offset + walformat.COMMIT_LEN > self.chunk_bytes
                    or self.live_bytes + walformat.COMMIT_LEN > self.max_size_bytes):
                return False
            start, committed = self.end_offset, self._committed
            record = self._record()
            try:
                self._write([record], "commit_write")
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise self._lost("write to", exc) from with_path(
                        exc, layout.active_wal(self.wal_dir))
                self._cut_back(start, 0, exc)
                self._committed = committed
                return False
            self.end_offset = start + walformat.COMMIT_LEN
        finally:
            self._mutex.release()
        if sync:
            self._fdatasync("commit_fdatasync")  # not a sync of entries: not counted as one
        return True

    def _create_header(self) -> None:
        """Replay left the active file empty (no space for its header): write it now,
        atomically like any new WAL file, before the first entry."""
        path = layout.active_wal(self.wal_dir)
        try:
            atomic_write(path, walformat.encode_header(self.cfg_hash))
            fd = self._fs.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise self._lost("creating", exc) from with_path(exc, path)
            self._fs.unlink(layout.tmp_path(path), missing_ok=True)
            raise WalNoSpace(f"no space left to write the header of {path}: "
                             f"{exc.strerror or exc}", written=0, reason=reason_of(exc)) from exc
        os.lseek(fd, walformat.HEADER_LEN, os.SEEK_SET)
        with self._lock:
            self._fs.close(self._fd)
            self._fd = fd
            self._committed = None  # a new file: its first batch gets a record
        self.end_offset = walformat.HEADER_LEN
        self.log.info("wal_created", path=str(path), generation=self.generation, deferred=True)

    def _cut_deferred_tail(self, target: Path) -> None:
        """The torn tail replay left (no space for its copy then): copy it, then cut it.

        Before the first append, which would otherwise overwrite bytes never copied.
        Still no space: WalNoSpace (nothing written), the append waits like any other.
        The tail is less than one batch (no sound entry follows it), read with read(2),
        not a map: a map of a full tmpfs can fault with SIGBUS.
        """
        path = layout.active_wal(self.wal_dir)
        try:
            with open(path, "rb") as f:
                f.seek(self.end_offset)
                torn = f.read()
            keep_bytes(torn, target.parent, target.name)
            self._fs.ftruncate(self._fd, self.end_offset)
            self._fs.fsync(self._fd)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise self._lost("cutting the torn tail of", exc) from with_path(exc, path)
            self._fs.unlink(layout.tmp_path(target), missing_ok=True)
            raise WalNoSpace(f"no space left to copy the torn tail of {path} into "
                             f"{target.parent}: {exc.strerror or exc}", written=0,
                             reason=reason_of(exc)) from exc
        self._deferred_cut = None
        self.log.warning("wal_torn_tail", path=str(path), offset=self.end_offset,
                         bytes=len(torn), reason="cut deferred at start (disk full)",
                         quarantine=str(target))

    def _check_space(self, nbytes: int) -> None:
        """Leave ``reserve_bytes`` free: segments and ack.log need room to drain the WAL."""
        if self.reserve_bytes <= 0:
            return
        try:
            free = free_bytes(self.wal_dir)
        except OSError as exc:
            raise self._lost("statvfs of", exc) from with_path(
                    exc, layout.active_wal(self.wal_dir))
        if free - nbytes < self.reserve_bytes:
            raise WalNoSpace(f"{free} bytes free on the filesystem of {self.wal_dir}: "
                             f"appending {nbytes} would leave less than the "
                             f"{self.reserve_bytes} kept free for segments and ack.log",
                             written=0, reason="reserve")

    def _append(self, entries: list[EntryToWrite]) -> None:
        pieces: list[Buffer] = []
        part_start, part_first = self.end_offset, 0  # this file's part of the batch
        committed = self._committed
        for i, (sequence, (ts_ns, slots), size) in enumerate(entries):
            entry_pieces = walformat.encode_entry(ts_ns=ts_ns, sequence=sequence, slots=slots)
            due = walformat.COMMIT_LEN if self._record_due() else 0
            if self._needs_rotation(size + due):
                self._write_part(pieces, part_start, i - part_first, done=part_first,
                                 committed=committed)
                pieces = []
                if i > part_first:
                    self._written_through = entries[i - 1][0]
                self._rotate(done=i)
                part_start, part_first, committed = self.end_offset, i, self._committed
            if self._committed is None and self.commits:
                # The first record of a life or of a file is synced on its own: a crash
                # that tears the batch after it must not take the evidence that this
                # writer records commits (replay then calls its damage never acked).
                at = self.end_offset
                self._write_part([self._record()], at, 0, done=i, committed=None,
                                 step="commit_write")
                self.end_offset = part_start = at + walformat.COMMIT_LEN
                self._fdatasync("record_fdatasync")
            elif self._record_due():  # the batch's first bytes in this file
                pieces.append(self._record())
                self.end_offset += walformat.COMMIT_LEN
            self._index.append((sequence, self.generation, self.end_offset))
            self.end_offset += size
            pieces.extend(entry_pieces)
        self._write_part(pieces, part_start, len(entries) - part_first, done=part_first,
                         committed=committed)
        if entries:
            self._written_through = entries[-1][0]

    def _write_part(self, pieces: list[Buffer], start: int, count: int, *, done: int,
                    committed: int | None, step: str = "write") -> None:
        """Write ``count`` entries from ``start``; ``done`` earlier ones of the batch made it.
        ``committed``: the file's last commit record before this part (a part cut back
        takes its own record with it)."""
        try:
            self._write(pieces, step)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise self._lost("write to", exc) from with_path(
                    exc, layout.active_wal(self.wal_dir))
            self._cut_back(start, count, exc)
            self._committed = committed
            raise WalNoSpace(f"no space left writing {layout.active_wal(self.wal_dir)} at "
                             f"offset {start}: {exc.strerror or exc}", written=done,
                             reason=reason_of(exc)) from exc

    def _cut_back(self, start: int, count: int, cause: OSError) -> None:
        """A write failed part-way: drop its bytes and its entries from the index."""
        try:
            self._fs.ftruncate(self._fd, start)
            os.lseek(self._fd, start, os.SEEK_SET)
        except OSError as exc:
            raise DurabilityLost(
                f"a write to {layout.active_wal(self.wal_dir)} failed "
                f"({cause.strerror or cause}) and cutting it back to offset {start} failed "
                f"too: {exc.strerror or exc}; a torn entry may follow the last good one",
                hint="check the disk (dmesg); replay cuts the torn tail into quarantine/ "
                "and recovers every acknowledged entry") from with_path(
                    exc, layout.active_wal(self.wal_dir))
        for _ in range(count):
            self._index.pop()
        self.end_offset = start

    def _write(self, pieces: list[Buffer], step: str = "write") -> None:
        if not pieces:
            return
        self._fault(step)
        for start in range(0, len(pieces), IOV_MAX):
            chunk = pieces[start:start + IOV_MAX]
            want = sum(len(p) for p in chunk)
            done = self._fs.writev(self._fd, chunk)
            if done < want:  # short write (signal, near-full disk): finish it by hand
                fs.write_all(self._fd, [_tail(chunk, done)], self._fs)

    def sync(self) -> None:
        """fdatasync the active file (see ``_fdatasync``)."""
        self._fdatasync("fdatasync")

    def _fdatasync(self, step: str) -> None:
        """fdatasync the active file. A failure is fatal: the caller must not ack.

        ``last_sync_seconds`` holds how long the fdatasync itself took.
        """
        with self._lock:
            try:
                self._fault(step)  # tests: a fault hook fails this step
                covers = self._written_through  # every write that returned before it
                started = time.perf_counter()
                self._fs.fdatasync(self._fd)
                self.last_sync_seconds = time.perf_counter() - started
                self.synced_through = max(self.synced_through, covers)
            except OSError as exc:
                raise DurabilityLost(
                    f"fdatasync of {layout.active_wal(self.wal_dir)} failed: "
                    f"{exc.strerror or exc}; "
                    "the shard stops without acknowledging the entries it covered"
                ) from with_path(exc, layout.active_wal(self.wal_dir))

    def _fault(self, step: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(step)

    def _lost(self, what: str, exc: OSError) -> DurabilityLost:
        return DurabilityLost(f"{what} {layout.active_wal(self.wal_dir)} failed: "
                              f"{exc.strerror or exc}; the shard stops without acknowledging "
                              "what it had not synced")

    def _rotate(self, *, done: int) -> None:
        """Retire the active file as ``quiver.wal.<gen>`` and start a fresh one.

        The fresh file is made first under a temp name (header, fdatasync), so a full
        disk leaves the active file as it was (WalNoSpace, ``done`` entries written);
        two renames then swap it in. A crash between them leaves no active file, and
        replay creates one.
        """
        self.sync()
        active = layout.active_wal(self.wal_dir)
        fd = create_fresh(layout.tmp_path(active), self.cfg_hash, done=done)
        with self._lock:
            try:
                self._fs.rename(active, layout.rotated_wal(self.wal_dir, self.generation))
                self._fs.rename(layout.tmp_path(active), active)
                fsync_dir(self.wal_dir)
                self._fault("rotate_dir_fsync")
            except OSError as exc:
                self._fs.close(fd)
                raise DurabilityLost(f"rotating {active} failed: {exc.strerror or exc}; the "
                                     "shard stops, replay finds every synced entry"
                                     ) from with_path(exc, self.wal_dir)
            self._rotated.append(_Rotated(self.generation, self.end_offset - self._released_offset))
            self._fs.close(self._fd)
            self.generation += 1
            self._fd = fd
            self._committed = None  # a new file: its first batch gets a record
            self.end_offset = walformat.HEADER_LEN
            self._released_offset = 0
        self.log.info("wal_rotated", generation=self.generation, files=self.file_count)

    # ---- read back -----------------------------------------------------------------
    def read_back(self, sequences: list[int]) -> dict[int, dict[int, Buffer]]:
        """The user slots' payloads of unreleased entries, by sequence (worker thread).

        For the finalizer: the open segment keeps no payload bytes, they are read back
        here from the page cache through read-only memory maps. The files are opened
        under the mutex (no rotation or rewrite in between), so each fd pins the inode
        that holds the entry even if a rewrite later replaces the path; a region is
        punched only once released, after the segment holding it is durable. Every
        entry's CRC is checked again: a mismatch raises CorruptRecord.
        """
        return {seq: {sl.slot: sl.ipc for sl in slots}
                for seq, slots in self.read_slots(sequences).items()}

    def read_slots(self, sequences: list[int]) -> dict[int, tuple[Slot, ...]]:
        """Like ``read_back``, with each user slot whole (fingerprint, row count)."""
        return {seq: tuple(sl for sl in entry.slots if sl.slot != META_SLOT)
                for seq, (entry, _) in self._read_entries(sequences).items()}

    def entry_bytes(self, sequences: list[int]) -> dict[int, bytes]:
        """Unreleased entries whole (length prefix to CRC), copied: for quarantine/."""
        return {seq: bytes(raw) for seq, (_, raw) in self._read_entries(sequences).items()}

    def _read_entries(self, sequences: list[int]
                      ) -> dict[int, tuple[walformat.DecodedEntry, memoryview]]:
        with self._mutex:
            where = self._locate(sequences)
            files: dict[int, int] = {}
            try:
                for gen, _ in where.values():
                    if gen not in files:
                        files[gen] = os.open(self._path_of(gen), os.O_RDONLY | os.O_CLOEXEC)
            except BaseException:
                for fd in files.values():
                    os.close(fd)
                raise
            paths = {gen: str(self._path_of(gen)) for gen in files}
        maps: dict[int, mmap.mmap] = {}
        try:
            for gen, fd in files.items():
                maps[gen] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            for fd in files.values():
                os.close(fd)  # the maps keep the inodes
        out: dict[int, tuple[walformat.DecodedEntry, memoryview]] = {}
        for seq, (gen, offset) in where.items():
            path = paths[gen]
            view = memoryview(maps[gen])
            entry = walformat.decode_entry(view, offset, path=path,
                                           max_entry_bytes=walformat.MAX_ENTRY_LEN)
            if not entry.sound or entry.sequence != seq:
                raise CorruptRecord(path, offset, f"WAL entry {seq} read back for its segment "
                                    f"is damaged ({entry.problem or 'crc mismatch'}, sequence "
                                    f"{entry.sequence})")
            out[seq] = (entry, view[offset:offset + entry.total_len])
        return out

    def _path_of(self, generation: int) -> Path:
        if generation == self.generation:
            return layout.active_wal(self.wal_dir)
        return layout.rotated_wal(self.wal_dir, generation)

    def _locate(self, sequences: list[int]) -> dict[int, tuple[int, int]]:
        """(generation, offset) of unreleased entries; sequences are contiguous in the
        index (each entry takes the next number), so this is arithmetic, checked."""
        index = self._index
        if not index:
            raise KeyError(f"WAL entries {sequences[:3]}... are not in the WAL any more")
        first = index[0][0]
        out: dict[int, tuple[int, int]] = {}
        for seq in sequences:
            i = seq - first
            if not 0 <= i < len(index) or index[i][0] != seq:
                found = [e for e in index if e[0] == seq]
                if not found:
                    raise KeyError(f"WAL entry {seq} is not in the WAL any more")
                out[seq] = (found[0][1], found[0][2])
            else:
                out[seq] = (index[i][1], index[i][2])
        return out

    # ---- release -------------------------------------------------------------------
    def release(self, upto_sequence: int) -> bool:
        """Entries <= ``upto_sequence`` are in durable segments: reclaim their space.

        Order matters: the sidecar is written first, then rotated files are
        deleted and the active file's prefix punched, so a crash in between
        only leaves bytes that replay skips by sequence. Returns True when
        space was freed.
        """
        with self._mutex:
            return self._release(upto_sequence)

    def _release(self, upto_sequence: int) -> bool:
        if self.end_offset == 0:
            return False  # no header yet, so no entry: nothing to release
        while self._index and self._index[0][0] <= upto_sequence:
            self._index.popleft()
        if self._index:
            _, gen, offset = self._index[0]
        else:
            gen, offset = self.generation, self.end_offset
        write_sidecar(self.wal_dir, offset, gen, hook=self.fault_hook)
        self._fault("sidecar_written")
        freed = False
        try:
            for r in [r for r in self._rotated if r.generation < gen]:
                self._fs.unlink(layout.rotated_wal(self.wal_dir, r.generation))
                self._rotated.remove(r)
                freed = True
            if freed:
                fsync_dir(self.wal_dir)
                self._fault("unlink_dir_fsync")
        except OSError as exc:
            raise self._lost("deleting released files beside", exc) from with_path(
                exc, self.wal_dir)
        if gen == self.generation and offset > self._released_offset + walformat.HEADER_LEN:
            freed = self._reclaim_active(offset) or freed
        return freed

    def _reclaim_active(self, offset: int) -> bool:
        start = walformat.HEADER_LEN
        if self.punch_supported:
            begin = -(-start // BLOCK) * BLOCK  # rounded up
            # Not the commit record right before the first live entry: replay reads it.
            end = max(offset - walformat.COMMIT_LEN, 0) // BLOCK * BLOCK
            try:
                if end > begin:
                    self._fs.punch_hole(self._fd, begin, end - begin)
                self._released_offset = offset - start
                return True
            except OSError as exc:
                if exc.errno in NO_SPACE:  # splitting an extent can need a block
                    self.log.warning("wal_reclaim_deferred", error=exc.strerror or str(exc))
                    return False
                if exc.errno not in PUNCH_UNSUPPORTED:
                    raise self._lost("punching released bytes out of", exc) from with_path(
                    exc, layout.active_wal(self.wal_dir))
                self.punch_supported = False
        if offset - start >= max(self.chunk_bytes // 2, BLOCK):
            return self._rewrite_active(offset)
        return False

    def _rewrite_active(self, offset: int) -> bool:
        """No hole punching here: copy the live tail into a fresh file (doc 000).

        The sidecar is first pointed at the header end: valid in the old file
        (replay then skips released entries by sequence) and in the new one. No
        space for the copy: the old file stays as it is (returns False).
        """
        start = walformat.HEADER_LEN
        if self._deferred_cut is not None:
            return False  # the copy would leave the torn tail behind uncopied
        write_sidecar(self.wal_dir, start, self.generation, hook=self.fault_hook)
        new_path = layout.tmp_path(layout.active_wal(self.wal_dir))
        try:
            fd = copy_live_tail(layout.active_wal(self.wal_dir), new_path, self.cfg_hash,
                                offset, self.end_offset)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise self._lost("rewriting", exc) from with_path(
                    exc, layout.active_wal(self.wal_dir))
            self.log.warning("wal_rewrite_deferred", error=exc.strerror or str(exc))
            return False
        with self._lock:
            try:
                self._fs.rename(new_path, layout.active_wal(self.wal_dir))
                fsync_dir(self.wal_dir)
            except OSError as exc:
                self._fs.close(fd)
                raise self._lost("replacing", exc) from with_path(
                    exc, layout.active_wal(self.wal_dir))
            self._fs.close(self._fd)
            self._fd = fd
            self._committed = None  # a new file: its first batch gets a record
            shift = offset - start
            self._index = deque((s, g, o - shift if g == self.generation else o)
                                for s, g, o in self._index)
            self.end_offset -= shift
            self._released_offset = 0
        self.log.info("wal_rewritten", reclaimed_bytes=shift)
        return True

    @property
    def unreleased_entries(self) -> int:
        """Entries written that no durable segment holds yet (replay would keep them)."""
        return len(self._index)

    def stats(self) -> dict[str, int]:
        return {"wal_bytes": self.live_bytes, "wal_files": self.file_count,
                "wal_generation": self.generation}


def _tail(chunk: list[Buffer], done: int) -> bytes:
    return b"".join(bytes(p) for p in chunk)[done:]
