"""Small real filesystems for disk-full and power-cut tests (root only; skipped otherwise).

    mounted_tmpfs(dir, size)              tmpfs with size= (ENOSPC when full)
    mounted_image(dir, image, "xfs", size) a sparse image file, mkfs'd, mount -o loop

Both unmount in ``finally`` (the loop device of ``mount -o loop`` is released by the
unmount: autoclear); a mount that stays busy is unmounted lazily so nothing is left.
Skips print why (``pytest -rs`` lists them too).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MiB = 1024 * 1024


def _skip(reason: str) -> None:
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@contextmanager
def mounted_tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    if os.geteuid() != 0:
        _skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "quiverd-test",
                str(where))
    if done.returncode != 0:
        _skip(f"cannot mount a tmpfs at {where}: {done.stderr.strip()}")
    try:
        yield where
    finally:
        unmount(where)


@contextmanager
def mounted_image(where: Path, image: Path, fstype: str, size_bytes: int) -> Iterator[Path]:
    """``image`` (sparse, ``size_bytes``) formatted as ``fstype`` and loop-mounted at ``where``."""
    if os.geteuid() != 0:
        _skip(f"loop-mounting an {fstype} image needs root")
    mkfs = shutil.which(f"mkfs.{fstype}") or shutil.which(f"mkfs.{fstype}", path="/usr/sbin:/sbin")
    if mkfs is None:
        _skip(f"mkfs.{fstype} is not installed")
    assert mkfs is not None
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    options = {"ext4": ["-q", "-F", "-m", "0"], "xfs": ["-q", "-f"]}.get(fstype, [])
    done = _run(mkfs, *options, str(image))
    if done.returncode != 0:
        _skip(f"mkfs.{fstype} failed: {done.stderr.strip()}")
    where.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-o", "loop", "-t", fstype, str(image), str(where))
    if done.returncode != 0:
        _skip(f"cannot loop-mount {image} ({fstype}): {done.stderr.strip()}")
    try:
        yield where
    finally:
        unmount(where)


def remount(where: Path, image: Path, fstype: str) -> None:
    """Unmount and mount the same image again (after a simulated power cut)."""
    unmount(where)
    done = _run("mount", "-o", "loop", "-t", fstype, str(image), str(where))
    assert done.returncode == 0, f"remount of {image} failed: {done.stderr}"


def unmount(where: Path) -> None:
    """Unmount ``where`` if mounted; retry while busy, then detach lazily."""
    for _ in range(50):
        if not is_mounted(where):
            return
        if _run("umount", str(where)).returncode == 0:
            return
        gc.collect()  # segment bundles read back keep their files memory-mapped
        time.sleep(0.1)
    _run("umount", "-l", str(where))


def is_mounted(where: Path) -> bool:
    """From the kernel's mount table: ``os.path.ismount`` says no on a shut-down
    filesystem (its stat fails with EIO), which would leave the mount behind."""
    target = os.path.realpath(where)
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts if line.strip())


def fill(path: Path, nbytes: int | None = None) -> int:
    """Write ``path`` with ``nbytes`` (or until ENOSPC), fsynced; returns bytes written."""
    chunk = b"\xa5" * MiB
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while nbytes is None or written < nbytes:
            want = chunk if nbytes is None else chunk[:min(MiB, nbytes - written)]
            try:
                written += os.write(fd, want)
            except OSError:
                if nbytes is not None:
                    raise
                break
        os.fsync(fd)
    finally:
        os.close(fd)
    return written
