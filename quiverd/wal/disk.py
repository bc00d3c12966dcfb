"""The WAL's disk operations beside appends: space, fresh files, the sidecar.

    statvfs(wal_dir) ── free bytes ──▶ an append that would leave < reserve_bytes free
                                       is refused before it writes (WalNoSpace)
    write() ── ENOSPC / EDQUOT ──────▶ the file is cut back (files.py), WalNoSpace
    quiver.wal.tmp ──────────────────▶ the next active file (rotation) or the live tail
                                       copied out (no hole punching), synced before
                                       its rename
    truncate.offset ─────────────────▶ the sidecar: WalNoSpace before its rename,
                                       DurabilityLost after it
    fallocate(PUNCH_HOLE) ───────────▶ released prefix of the active file given back
    lseek(SEEK_HOLE) ────────────────▶ the holes replay steps over unread

Blocking code, called from worker threads (``WalFiles``). Every change to a file
goes through the seam (``kernel.fs.active()``); reads (statvfs, lseek, pread) do not.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from quiverd.kernel import fs, layout
from quiverd.kernel.durable import atomic_write, with_path, write_all
from quiverd.kernel.errors import AtCapacity, DurabilityLost
from quiverd.kernel.faults import Hook, StepTracker, prefixed
from quiverd.wal import format as walformat

BLOCK = 4096
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
PUNCH_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class WalNoSpace(AtCapacity):
    """An append found no disk space; ``written`` entries of its batch made it.

    Those first ``written`` entries are in the file (not yet synced). The rest are
    not, and no byte of them is left behind: the file was cut back to where the
    first of them would have started, so a later append never follows torn bytes.
    """

    hint = ("free space on data_dir's filesystem (or let subscribers ack so segments are "
            "deleted): producers wait and ingest resumes by itself")

    def __init__(self, message: str, *, written: int, reason: str) -> None:
        super().__init__(message)
        self.written = written
        self.reason = reason  # "enospc", "edquot" or "reserve"


def reason_of(exc: OSError) -> str:
    return "edquot" if exc.errno == errno.EDQUOT else "enospc"


def create_fresh(tmp: Path, cfg_hash: bytes, *, done: int) -> int:
    """``tmp`` holding just a WAL header, synced; returns its fd (WalNoSpace: disk full)."""
    seam = fs.active()
    fd = -1
    try:
        fd = seam.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        write_all(fd, [walformat.encode_header(cfg_hash)])
    except OSError as exc:
        close_and_unlink(fd, tmp)
        if exc.errno not in NO_SPACE:
            raise DurabilityLost(f"creating {tmp} failed: {exc.strerror or exc}"
                                 ) from with_path(exc, tmp)
        raise WalNoSpace(f"no space left for a new WAL file {tmp}: {exc.strerror or exc}",
                         written=done, reason=reason_of(exc)) from exc
    try:
        seam.fdatasync(fd)
    except OSError as exc:
        close_and_unlink(fd, tmp)
        raise DurabilityLost(f"fdatasync of {tmp} failed: {exc.strerror or exc}"
                             ) from with_path(exc, tmp)
    return fd


def copy_live_tail(active: Path, new_path: Path, cfg_hash: bytes, offset: int, end: int) -> int:
    """A fresh file: header + bytes ``offset..end`` of ``active``, fdatasynced; its fd."""
    seam = fs.active()
    fd = seam.open(new_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        write_all(fd, [walformat.encode_header(cfg_hash)])
        src = os.open(active, os.O_RDONLY | os.O_CLOEXEC)
        try:
            remaining, pos = end - offset, offset
            while remaining > 0:
                n = seam.copy_file_range(src, fd, remaining, pos)
                if n == 0:
                    raise OSError(errno.EIO, "WAL shrank during rewrite")
                pos, remaining = pos + n, remaining - n
        finally:
            os.close(src)  # read-only: not the seam's
        seam.fdatasync(fd)
    except BaseException:
        close_and_unlink(fd, new_path)
        raise
    return fd


def write_sidecar(wal_dir: Path, offset: int, gen: int, *, hook: Hook | None) -> None:
    """The sidecar, crash-safely. No space before its rename: WalNoSpace (nothing
    changed, retry later); a failure after the rename, or any other: DurabilityLost."""
    path = layout.sidecar(wal_dir)
    steps = StepTracker(prefixed(hook, "sidecar_"))
    try:
        atomic_write(path, walformat.encode_sidecar(offset, gen), hook=steps)
    except OSError as exc:
        if steps.renamed or exc.errno not in NO_SPACE:
            raise DurabilityLost(f"writing {path} failed after step "
                                 f"{steps.reached or 'open'}: {exc.strerror or exc}"
                                 ) from with_path(exc, path)
        close_and_unlink(-1, layout.tmp_path(path))
        raise WalNoSpace(f"no space left to write {path}: {exc.strerror or exc}",
                         written=0, reason=reason_of(exc)) from exc


def close_and_unlink(fd: int, path: Path) -> None:
    """Clean up a temp file that will not be used (it may not exist)."""
    seam = fs.active()
    if fd >= 0:
        seam.close(fd)
    seam.unlink(path, missing_ok=True)


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still allocate on ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) through the seam; raises OSError."""
    fs.active().punch_hole(fd, offset, length)


def holes(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The holes (begin, end) of the file in ``[start, end)``, by SEEK_HOLE/SEEK_DATA.

    Replay must not read a hole through its memory map: on tmpfs the fault allocates
    a page, and on a full tmpfs that is SIGBUS. A filesystem without SEEK_HOLE
    (EINVAL) reports none: it cannot punch holes either.
    """
    out: list[tuple[int, int]] = []
    pos = start
    try:
        while pos < end:
            begin = os.lseek(fd, pos, os.SEEK_HOLE)
            if begin >= end:
                break
            try:
                pos = min(os.lseek(fd, begin, os.SEEK_DATA), end)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no data after it, a hole to the end
                    raise
                pos = end
            out.append((begin, pos))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    return out


def probe_punch_hole(directory: Path) -> bool:
    """Startup probe: can this filesystem punch holes? (doc 000)"""
    probe = directory / ".punch-probe"
    seam = fs.active()
    try:
        fd = seam.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in NO_SPACE:
            return True  # a full disk at startup: assume so; release falls back if not
        raise
    try:
        write_all(fd, [b"\xff" * (2 * BLOCK)])
        seam.punch_hole(fd, 0, BLOCK)
        return os.pread(fd, 8, 0) == b"\0" * 8
    except OSError as exc:
        if exc.errno in NO_SPACE:
            return True
        if exc.errno in PUNCH_UNSUPPORTED:
            return False
        raise
    finally:
        seam.close(fd)
        seam.unlink(probe)
