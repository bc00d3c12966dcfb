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
        holder = _flock_holder(fd)
        recorded = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        who = (f"pid {holder[0]}) running `{holder[1]}`" if holder
               else f"pid {recorded})")
        raise AlreadyRunning(f"{data_dir} is in use by another quiverd ({who}"
                             + (f"; {purpose}" if purpose else ""), hint=hint) from None
    if record_pid:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _flock_holder(fd: int) -> tuple[int, str] | None:
    """The pid holding the flock on ``fd``'s file and its command line, from /proc/locks.

    LOCK's recorded pid names the last daemon, not an fsck holding the lock now (fsck
    does not record itself), so the kernel's own record is asked first.
    """
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; blocked waiters have "->".
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == dev:
            pid = int(fields[4])
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                return None
            words = [a.decode(errors="replace") for a in argv if a]
            if len(words) > 1 and os.path.basename(words[0]).startswith("python"):
                # "python -m quiverd ..." or "python .../bin/quiverd ...": "quiverd ..."
                words = words[words.index("-m") + 1:] if "-m" in words else words[1:]
            if words:
                words[0] = os.path.basename(words[0])
            return pid, " ".join(words)
    return None
