"""The quarantine: bytes cut out of any file, kept, never silently dropped.

Recovery (segments, WAL replay, ack.log replay) and ``fsck --repair`` use these
two moves and no other; each is durable before the caller goes on, and each is
reported as one log event:

- ``move_file``: a whole file (a segment that fails its check, a temp file a
  crash left) is renamed into ``quarantine/`` under a name no earlier copy
  holds (``name``, ``name.1``, ...); the new directory entry and the removal
  from the old directory are both fsynced. Same shard directory, same
  filesystem: a rename, never a copy.
- ``keep_bytes``: a byte range about to be cut or skipped (a torn WAL tail, a
  bad ack.log record) is written with the crash-safe write
  (tmp → fsync → rename → fsync dir) before the caller truncates the original.

Blocking: call from a worker thread (recovery runs in one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from quiverd.kernel import fs
from quiverd.kernel.durable import Buffer, atomic_write, fsync_dir


class _Log(Protocol):
    def warning(self, event: str, **kw: Any) -> Any: ...


def move_file(path: Path, quarantine_dir: Path, *, reason: str, log: _Log) -> Path:
    """Move ``path`` into ``quarantine_dir`` durably; returns where it went."""
    _ensure_dir(quarantine_dir)
    target, n = quarantine_dir / path.name, 1
    while target.exists():
        target, n = quarantine_dir / f"{path.name}.{n}", n + 1
    seam = fs.active()
    if path.stat().st_mode & 0o200 == 0:
        seam.chmod(path, 0o640)  # finalized segments are 0440: let an operator clean up
    seam.rename(path, target)
    fsync_dir(quarantine_dir)
    fsync_dir(path.parent)
    log.warning("file_quarantined", path=str(path), moved_to=str(target), reason=reason)
    return target


def keep_bytes(data: Buffer, quarantine_dir: Path, name: str) -> Path:
    """Write ``data`` durably as ``quarantine_dir/name`` before the caller cuts it.

    The caller names the copy (``layout`` has the names) and logs its own event,
    which says what was cut and why; rerunning the same repair rewrites the same
    file instead of piling up copies.
    """
    _ensure_dir(quarantine_dir)
    target = quarantine_dir / name
    atomic_write(target, data)
    return target


def _ensure_dir(quarantine_dir: Path) -> None:
    if not quarantine_dir.is_dir():
        fs.active().mkdir(quarantine_dir)
        fsync_dir(quarantine_dir.parent)
