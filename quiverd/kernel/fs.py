"""The file-system seam: every durable write of the core goes through one object.

    WalFiles, wal/disk, wal/replay, wal/scan ─┐
    segments/files, acks/log, durable,        ├─▶ fs.active() ──▶ FileSystem (os.*)
    quarantine, runtime/recovery              ┘        │            production
                                                       └──────────▶ a recording model
                                                                    (tests/sim/modelfs.py)

The lake's local steps (Active and Stable Parquet files in staging/, compaction's task
copies and downloads, their eviction and sweeping) go through it too: ``create_binary``
gives pyarrow's writer a buffered file whose writes are the seam's. What does not: the
object store's files (OpenDAL writes them) and the embedded catalog's (SQLite's); the
crash-state tools treat both as services.

What goes through it: every call that changes a file or a directory, or makes a
change durable (open for writing, write, writev, ftruncate, punch, copy_file_range,
fsync, fdatasync, rename, link, unlink, mkdir, fsync of a directory). Reads do not: they
go straight to the kernel (mmap, read, stat, listdir). The model in the tests
performs every call on a real directory as well, so reads see what was written,
and keeps apart what is durable from what is only written; a crash then builds
the directory a power cut may leave (tests/sim/).

``FileSystem`` binds the ``os`` functions themselves: production pays one attribute
lookup per call. ``active()`` is the one that callers capture (``WalFiles`` once, when
it opens); ``install`` swaps it, for tests only. It is the one piece of module-level
state in the daemon, kept so that no hot-path signature carries a file system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Buffer = bytes | bytearray | memoryview
StrPath = str | os.PathLike[str]

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


class FileSystem:
    """The real file system: each method is the ``os`` call of the same name."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    write = staticmethod(os.write)
    writev = staticmethod(os.writev)
    ftruncate = staticmethod(os.ftruncate)
    fsync = staticmethod(os.fsync)
    fdatasync = staticmethod(os.fdatasync)
    rename = staticmethod(os.rename)
    link = staticmethod(os.link)
    chmod = staticmethod(os.chmod)

    def unlink(self, path: StrPath, *, missing_ok: bool = False) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, path: StrPath) -> None:
        """``path`` and its missing parents (``mkdir -p``)."""
        Path(path).mkdir(parents=True, exist_ok=True)

    def fsync_dir(self, path: StrPath) -> None:
        """fsync a directory so a create, rename or unlink inside it is durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def copy_file_range(self, src: int, dst: int, count: int, offset_src: int) -> int:
        """Copy ``count`` bytes of ``src`` from ``offset_src`` to ``dst``'s position."""
        return os.copy_file_range(src, dst, count, offset_src)

    def punch_hole(self, fd: int, offset: int, length: int) -> None:
        """fallocate(PUNCH_HOLE | KEEP_SIZE) via libc; raises OSError."""
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if _fallocate()(fd, mode, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def mark(self, event: str, **facts: Any) -> None:
        """A fact for crash-state tools (e.g. an ack was sent); nothing in production."""


@functools.cache
def _fallocate() -> Any:
    """libc's fallocate, looked up once (find_library forks ldconfig)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return fn


_active: FileSystem = FileSystem()


def active() -> FileSystem:
    """The file system durable writes go through (the real one outside tests)."""
    return _active


def install(fs: FileSystem) -> FileSystem:
    """Tests: make ``fs`` the active file system; returns the one it replaces."""
    global _active
    previous, _active = _active, fs
    return previous


IOV_MAX = 1024  # Linux's limit on the buffers of one writev


def write_all(fd: int, chunks: Iterable[Buffer], seam: FileSystem | None = None) -> int:
    """Write every chunk fully (a write may be short); returns bytes written. Up to
    IOV_MAX chunks per writev: a segment is hundreds of stored-message pieces, and one
    write each cost 3-6 ms more CPU per 32 MiB segment (a GIL hand-off each)."""
    writev = (seam or _active).writev
    views = [v for v in (memoryview(c).cast("B") for c in chunks) if v.nbytes]
    total = i = 0
    while i < len(views):
        n = writev(fd, views[i:i + IOV_MAX])
        total += n
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:  # a short write ended inside views[i]
            views[i] = views[i][n:]
    return total


class _SeamRaw(io.RawIOBase):
    """An fd opened through the seam, written through it (``create_binary``)."""

    def __init__(self, fd: int, seam: FileSystem) -> None:
        super().__init__()
        self._fd, self._seam = fd, seam

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True  # position queries only: BufferedWriter.tell asks the raw file

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self._fd, offset, whence)

    def write(self, b: Any, /) -> int:  # any buffer (3.12's collections.abc.Buffer)
        return self._seam.write(self._fd, memoryview(b))

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if not self.closed:
            try:
                self._seam.close(self._fd)
            finally:
                super().close()


def create_binary(path: StrPath, *, buffer_size: int = 1 << 20) -> io.BufferedWriter:
    """A new file at ``path`` (FileExistsError if one exists: ``open(path, "xb")``), for
    writing through the seam; ``fsync_file`` makes it durable."""
    seam = _active
    fd = seam.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    return io.BufferedWriter(_SeamRaw(fd, seam), buffer_size=buffer_size)


def fsync_file(file: io.BufferedWriter) -> None:
    """Flush ``file`` (from ``create_binary``) and fsync it through the seam."""
    file.flush()
    raw = file.raw
    seam = raw._seam if isinstance(raw, _SeamRaw) else _active
    seam.fsync(file.fileno())
