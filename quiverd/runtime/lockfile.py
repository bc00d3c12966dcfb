"""``data_dir/LOCK``: one flock holder at a time (the daemon, or fsck on a stopped one)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from quiverd.kernel.errors import AlreadyRunning
from quiverd.kernel.layout import DataDir


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
