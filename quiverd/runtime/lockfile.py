"""``data_dir/LOCK``: one flock holder at a time (the daemon, or fsck on a stopped one).

``lock_data_dir`` creates LOCK when it is absent (a daemon starting on a new data
directory); a tool that must not create one in an arbitrary directory checks
``is_data_dir`` first.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from quiverd.kernel import layout
from quiverd.kernel.errors import AlreadyRunning
from quiverd.kernel.layout import DataDir


def is_data_dir(path: Path) -> bool:
    """A quiverd data directory holds LOCK or at least one ``shard-<n>/`` directory."""
    if not path.is_dir():
        return False
    if DataDir(path).lock.is_file():
        return True
    return any(p.is_dir() and layout.shard_index(p.name) is not None for p in path.iterdir())


def lock_data_dir(data_dir: Path, *, purpose: str = "", hint: str | None = None,
                  record_pid: bool = True) -> int:
    """flock LOCK without blocking; the holder's pid is named when it is taken."""
    fd = os.open(DataDir(data_dir).lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunning(f"{data_dir} is in use by another quiverd (pid {holder})"
                             + (f"; {purpose}" if purpose else ""), hint=hint) from None
    if record_pid:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
