"""Crash-safe file writes: the one helper every sidecar, segment and checkpoint uses.

Recipe: write ``<name>.tmp`` → fsync it → rename over ``<name>`` → fsync the
directory. A reader sees the old file or the new one, never a mix. All functions
here block: call them from a worker thread (``anyio.to_thread.run_sync``).

Every call that changes a file goes through the seam (``kernel.fs.active()``), so
a test's recording file system sees each step; the names here stay for callers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from quiverd.kernel import fs
from quiverd.kernel.fs import Buffer
from quiverd.kernel.layout import tmp_path

__all__ = ["Buffer", "atomic_write", "fsync_dir", "make_dirs", "with_path", "write_all"]

def with_path(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """``exc`` naming the file it concerns: an fsync or write by fd raises with no
    filename, and the fatal event must say which file failed. Chain it with ``from``."""
    if exc.filename is not None:
        return exc
    named = OSError(exc.errno, exc.strerror or str(exc), str(path))
    named.__cause__ = exc
    return named


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    try:
        fs.active().fsync_dir(path)
    except OSError as exc:
        raise with_path(exc, path) from exc


def make_dirs(path: str | os.PathLike[str]) -> None:
    """``mkdir -p`` whose new directories survive a power cut: each created directory's
    entry is made durable by fsyncing its parent (a new directory is only a name in
    its parent until then), the deepest first."""
    created: list[Path] = []
    p = Path(path)
    while not p.is_dir():
        created.append(p)
        p = p.parent
    if not created:
        return
    fs.active().mkdir(path)
    for new in created:
        fsync_dir(new.parent)


def write_all(fd: int, chunks: Iterable[Buffer]) -> int:
    """Write every chunk fully (a write may be short); returns bytes written."""
    return fs.write_all(fd, chunks, fs.active())


def atomic_write(
    path: str | os.PathLike[str],
    chunks: Iterable[Buffer] | Buffer,
    *,
    mode: int = 0o644,
    hook: object = None,
) -> int:
    """Write ``chunks`` to ``path`` atomically and durably; returns the byte count.

    ``hook``, when given, is called as ``hook(step)`` after each step
    (``"tmp_written"``, ``"tmp_fsynced"``, ``"renamed"``, ``"dir_fsynced"``) so
    crash tests can stop the process between steps.
    """
    if isinstance(chunks, bytes | bytearray | memoryview):
        chunks = [chunks]
    target = Path(path)
    tmp = tmp_path(target)
    seam = fs.active()
    fd = seam.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        n = fs.write_all(fd, chunks, seam)
        _step(hook, "tmp_written")
        seam.fsync(fd)
        _step(hook, "tmp_fsynced")
    except OSError as exc:  # by fd: no filename of its own; the fatal event names it
        raise with_path(exc, tmp) from exc
    finally:
        seam.close(fd)
    seam.chmod(tmp, mode)
    seam.rename(tmp, target)
    _step(hook, "renamed")
    fsync_dir(target.parent)
    _step(hook, "dir_fsynced")
    return n


def _step(hook: object, name: str) -> None:
    if hook is not None:
        hook(name)  # type: ignore[operator]
