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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiverd.kernel import layout
from quiverd.kernel.bundle import Buffer, Slot
from quiverd.kernel.durable import atomic_write, fsync_dir, write_all
from quiverd.kernel.errors import DurabilityLost
from quiverd.kernel.faults import Hook
from quiverd.wal import format as walformat

# (sequence, (ingestion_ts_ns, slots), encoded size): encoded in the write's worker hop
EntryToWrite = tuple[int, tuple[int, tuple[Slot, ...]], int]
BLOCK = 4096
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
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
    fault_hook: Hook | None = None  # tests: raises at a step to simulate an I/O error
    last_sync_seconds: float = 0.0
    _fd: int = -1
    _rotated: list[_Rotated] = field(default_factory=list)
    # (sequence, generation, offset) of every entry not yet released: bounded by
    # the WAL's own size bound, because released entries are popped.
    _index: deque[tuple[int, int, int]] = field(default_factory=deque)
    _released_offset: int = 0  # bytes of the active file already reclaimed
    # _lock guards the fd swap (rotate, rewrite) against a concurrent fdatasync;
    # _mutex serializes append and release, which both change the file layout.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _mutex: threading.Lock = field(default_factory=threading.Lock)

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
        self._fd = os.open(layout.active_wal(wal_dir), os.O_WRONLY | os.O_CLOEXEC)
        os.lseek(self._fd, self.end_offset, os.SEEK_SET)
        self.punch_supported = probe_punch_hole(wal_dir)
        return self

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
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
        live, end, files = self.live_bytes, self.end_offset, self.file_count
        has_entries = self._has_entries()
        for nbytes in sizes:
            if live + nbytes > self.max_size_bytes and has_entries:
                return False
            if end > walformat.HEADER_LEN and end + nbytes > self.chunk_bytes:
                if files >= self.max_chunks:
                    return False
                files, end = files + 1, walformat.HEADER_LEN
                live += walformat.HEADER_LEN
            live, end, has_entries = live + nbytes, end + nbytes, True
        return True

    def _has_entries(self) -> bool:
        return bool(self._index)

    def _needs_rotation(self, nbytes: int) -> bool:
        active_has_data = self.end_offset > walformat.HEADER_LEN
        return active_has_data and self.end_offset + nbytes > self.chunk_bytes

    # ---- append and sync -------------------------------------------------------------
    def append(self, entries: list[EntryToWrite], *, sync: bool) -> None:
        """Encode and write ``(sequence, (ts_ns, slots), size)`` entries in order.

        fdatasync too if ``sync``. The caller checked ``fits`` for each entry. One
        call is one thread hop; the CRC over the payloads is computed here.
        """
        with self._mutex:
            self._append(entries)
        if sync:
            self.sync()

    def _append(self, entries: list[EntryToWrite]) -> None:
        pieces: list[Buffer] = []
        for sequence, (ts_ns, slots), size in entries:
            entry_pieces = walformat.encode_entry(ts_ns=ts_ns, sequence=sequence, slots=slots)
            if self._needs_rotation(size):
                self._write(pieces)
                pieces = []
                self._rotate()
            self._index.append((sequence, self.generation, self.end_offset))
            self.end_offset += size
            pieces.extend(entry_pieces)
        self._write(pieces)

    def _write(self, pieces: list[Buffer]) -> None:
        self._fault("write")
        for start in range(0, len(pieces), IOV_MAX):
            chunk = pieces[start:start + IOV_MAX]
            want = sum(len(p) for p in chunk)
            done = os.writev(self._fd, chunk)
            if done < want:  # short write (signal, near-full disk): finish it by hand
                write_all(self._fd, [_tail(chunk, done)])

    def sync(self) -> None:
        """fdatasync the active file. A failure is fatal: the caller must not ack.

        ``last_sync_seconds`` holds how long the fdatasync itself took.
        """
        with self._lock:
            try:
                self._fault("fdatasync")
                started = time.perf_counter()
                os.fdatasync(self._fd)
                self.last_sync_seconds = time.perf_counter() - started
            except OSError as exc:
                raise DurabilityLost(
                    f"fdatasync of {layout.active_wal(self.wal_dir)} failed: "
                    f"{exc.strerror or exc}; "
                    "the shard stops without acknowledging the entries it covered"
                ) from exc

    def _fault(self, step: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(step)

    def _rotate(self) -> None:
        """Retire the active file as ``quiver.wal.<gen>`` and start a fresh one."""
        self.sync()
        with self._lock:
            os.rename(layout.active_wal(self.wal_dir),
                      layout.rotated_wal(self.wal_dir, self.generation))
            self._rotated.append(_Rotated(self.generation, self.end_offset - self._released_offset))
            os.close(self._fd)
            self.generation += 1
            self._fd = create_active(self.wal_dir, self.cfg_hash)
            self.end_offset = walformat.HEADER_LEN
            self._released_offset = 0
        self.log.info("wal_rotated", generation=self.generation, files=self.file_count)

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
        while self._index and self._index[0][0] <= upto_sequence:
            self._index.popleft()
        if self._index:
            _, gen, offset = self._index[0]
        else:
            gen, offset = self.generation, self.end_offset
        atomic_write(layout.sidecar(self.wal_dir), walformat.encode_sidecar(offset, gen))
        self._fault("sidecar_written")
        freed = False
        for r in [r for r in self._rotated if r.generation < gen]:
            os.unlink(layout.rotated_wal(self.wal_dir, r.generation))
            self._rotated.remove(r)
            freed = True
        if freed:
            fsync_dir(self.wal_dir)
        if gen == self.generation and offset > self._released_offset + walformat.HEADER_LEN:
            freed = self._reclaim_active(offset) or freed
        return freed

    def _reclaim_active(self, offset: int) -> bool:
        start = walformat.HEADER_LEN
        if self.punch_supported:
            begin = _round_up(start, BLOCK)
            end = offset // BLOCK * BLOCK
            if end > begin:
                punch_hole(self._fd, begin, end - begin)
            self._released_offset = offset - start
            return True
        if offset - start >= max(self.chunk_bytes // 2, BLOCK):
            self._rewrite_active(offset)
            return True
        return False

    def _rewrite_active(self, offset: int) -> None:
        """No hole punching here: copy the live tail into a fresh file (doc 000).

        The sidecar is first pointed at the header end: valid in the old file
        (replay then skips released entries by sequence) and in the new one.
        """
        start = walformat.HEADER_LEN
        atomic_write(layout.sidecar(self.wal_dir), walformat.encode_sidecar(start, self.generation))
        new_path = layout.tmp_path(layout.active_wal(self.wal_dir))
        fd = os.open(new_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        try:
            write_all(fd, [walformat.encode_header(self.cfg_hash)])
            src = os.open(layout.active_wal(self.wal_dir), os.O_RDONLY | os.O_CLOEXEC)
            try:
                remaining, pos = self.end_offset - offset, offset
                while remaining > 0:
                    n = os.copy_file_range(src, fd, remaining, pos)
                    if n == 0:
                        raise OSError(errno.EIO, "WAL shrank during rewrite")
                    pos, remaining = pos + n, remaining - n
            finally:
                os.close(src)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            os.rename(new_path, layout.active_wal(self.wal_dir))
            fsync_dir(self.wal_dir)
            os.close(self._fd)
            self._fd = fd
            shift = offset - start
            self._index = deque((s, g, o - shift if g == self.generation else o)
                                for s, g, o in self._index)
            self.end_offset -= shift
            self._released_offset = 0
        self.log.info("wal_rewritten", reclaimed_bytes=shift)

    def stats(self) -> dict[str, int]:
        return {"wal_bytes": self.live_bytes, "wal_files": self.file_count,
                "wal_generation": self.generation}


def _tail(chunk: list[Buffer], done: int) -> bytes:
    return b"".join(bytes(p) for p in chunk)[done:]


def _round_up(n: int, block: int) -> int:
    return (n + block - 1) // block * block


def create_active(wal_dir: Path, cfg_hash: bytes) -> int:
    """Create ``quiver.wal`` holding just the header, durably; return its fd."""
    path = layout.active_wal(wal_dir)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    write_all(fd, [walformat.encode_header(cfg_hash)])
    os.fdatasync(fd)
    fsync_dir(wal_dir)
    return fd


@functools.cache
def _fallocate() -> Any:
    """libc's fallocate, looked up once (find_library forks ldconfig)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return fn


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) via libc; raises OSError."""
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if _fallocate()(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def probe_punch_hole(directory: Path) -> bool:
    """Startup probe: can this filesystem punch holes? (doc 000)"""
    probe = directory / ".punch-probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, [b"\xff" * (2 * BLOCK)])
        punch_hole(fd, 0, BLOCK)
        return os.pread(fd, 8, 0) == b"\0" * 8
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(probe)
