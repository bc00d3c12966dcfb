"""The store on a local disk (OpenDAL fs): what it does beyond the generic ObjectStore.

    <root>/                      lake.store.root, absolute; <data_dir>/objects by default
        <key>                    one object, one file (client=web/slot=0/...)
        .tmp/<name>.<rand>       OpenDAL's atomic_write_dir: an upload in progress,
                                 renamed onto <key> by the commit (same filesystem)

Guarantees beyond ObjectStore's:
- A committed object survives a power cut: OpenDAL's fs backend renames its temp file
  into place but never fsyncs a directory, so every directory from the object's parent
  up to the root is fsynced after each upload and copy.
- Temp files never show as objects (``list``), a failed upload's temp file is swept,
  and ``stale_temp_files`` finds (and removes) those a crash left.
- The whole-file CRC-32C is kept as user metadata only where the filesystem has user
  xattrs (not NFS, not old tmpfs); elsewhere uploads are verified by reading back.
- Names: ``uri`` is file:///abs/root/<key> with only what a URI must encode
  percent-encoded ('=' is allowed: client=web stays readable); ``location`` is the
  same unencoded; ``key_of`` reads both, and the fully encoded URIs written before
  issue 20 (client%3Dweb); ``local_path`` is the object's file.
"""

from __future__ import annotations

import builtins
import glob
import os
import urllib.parse
from pathlib import Path, PurePosixPath

import anyio

from quiverd.kernel.config import StoreConfig
from quiverd.kernel.durable import fsync_dir
from quiverd.kernel.layout import DataDir
from quiverd.lake.store.names import FS_TMP_DIR, key_ok
from quiverd.lake.store.objects import ObjectStore

FILE = "file://"
# RFC 3986 pchar minus the unreserved characters quote() never encodes: sub-delims,
# ':' and '@', and '/' between segments. Everything else ('%', ' ', '#', '?', non-ASCII
# bytes) is percent-encoded.
URI_SAFE = "/!$&'()*+,;=:@"


class LocalStore(ObjectStore):
    """Objects as files under a local directory (OpenDAL fs)."""

    is_local = True

    @classmethod
    def resolve_root(cls, cfg: StoreConfig, data_dir: Path) -> str:
        """lake.store.root or <data_dir>/objects, made absolute."""
        return str(Path(cfg.root or DataDir(data_dir).objects).absolute())

    @classmethod
    def complete_options(cls, cfg: StoreConfig, options: dict[str, str], root: str) -> None:
        options.setdefault("atomic_write_dir", str(Path(root, FS_TMP_DIR)))

    @classmethod
    def file_under(cls, root: str, key: str) -> Path | None:
        return Path(root, key)

    def uri(self, key: str) -> str:
        """file:///abs/root/<key>, encoding only what a URI must (``key`` "": the root)."""
        return FILE + urllib.parse.quote(str(Path(self.root, key)), safe=URI_SAFE)

    def location(self, key: str) -> str:
        return FILE + str(Path(self.root, key))

    def key_of(self, uri: str) -> str | None:
        if not uri.startswith(FILE):
            return None
        path = urllib.parse.unquote(uri[len(FILE):])  # old URIs encoded '=' too
        head = self.root.rstrip("/") + "/"
        key = path[len(head):] if path.startswith(head) else ""
        return key if key_ok(key) else None

    async def stale_temp_files(self, older_than_ns: int, *, remove: bool) -> builtins.list[str]:
        """Upload temp files (OpenDAL's atomic_write_dir) a crash left behind, last
        written before ``older_than_ns``; removed when ``remove``. Paths returned."""
        return await anyio.to_thread.run_sync(_stale_temps, Path(self.root, FS_TMP_DIR),
                                              older_than_ns, remove,
                                              limiter=self._file_limiter)

    # -- hooks ---------------------------------------------------------------------------------
    def _prepare(self) -> None:
        Path(self.root, FS_TMP_DIR).mkdir(parents=True, exist_ok=True)

    def _metadata_kept(self) -> bool:
        # fs keeps user metadata in xattrs, which not every filesystem has (NFS, old tmpfs).
        return _has_user_xattrs(Path(self.root, FS_TMP_DIR))

    def _hidden(self, key: str) -> bool:
        return key == FS_TMP_DIR or key.startswith(FS_TMP_DIR + "/")

    async def _committed(self, key: str) -> None:
        # OpenDAL's fs backend renames the tmp file into place but never fsyncs the
        # directory: without this a power cut could lose an object already registered.
        await anyio.to_thread.run_sync(_fsync_parents, Path(self.root), key,
                                       limiter=self._file_limiter)

    async def _discarded(self, key: str) -> None:
        await anyio.to_thread.run_sync(_sweep_fs_tmp, Path(self.root), key,
                                       limiter=self._file_limiter)


# -- worker-thread helpers (blocking) ---------------------------------------------------------
def _fsync_parents(root: Path, key: str) -> None:
    """fsync every directory from the object's parent up to the root (new ones included)."""
    parent = PurePosixPath(key).parent
    while True:
        fsync_dir(root / parent)
        if parent == PurePosixPath("."):
            return
        parent = parent.parent


def _has_user_xattrs(directory: Path) -> bool:
    probe = directory / f"xattr-probe-{os.getpid()}"
    try:
        probe.touch()
        os.setxattr(probe, "user.quiverd-probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _sweep_fs_tmp(root: Path, key: str) -> None:
    """Remove the tmp files a dropped fs writer left (OpenDAL names them <name>.<random>)."""
    name = PurePosixPath(key).name
    for entry in (root / FS_TMP_DIR).glob(f"{glob.escape(name)}.*"):
        entry.unlink(missing_ok=True)


def _stale_temps(directory: Path, older_than_ns: int, remove: bool) -> list[str]:
    found: list[str] = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return found
    for path in entries:
        try:
            if path.is_file() and path.stat().st_mtime_ns < older_than_ns:
                if remove:
                    path.unlink()
                found.append(str(path))
        except FileNotFoundError:
            continue  # an upload finished (renamed it) meanwhile
    return found
