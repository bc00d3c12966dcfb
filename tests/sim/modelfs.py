"""A model file system that knows what a power cut keeps.

    fs.install(ModelFS(root))            every durable write of the core (quiverd/kernel/fs.py)
        │                                comes here: done on the real directory (so reads,
        ├─ real op on root/...           mmaps and listings see what was written) and applied
        └─ Op ─▶ State.apply ─▶ ops log  to a State that keeps, apart, what is durable

    State            per inode: data now, data synced, writes since the last (f)datasync
                     per name:  names now, names durable, metadata ops since the dir's fsync
    State.image(cut) the files a crash may leave: the durable state, plus a prefix of the
                     pending metadata ops (a journal keeps them in order) and, per inode,
                     none, all, or a random subset of its pending writes torn at 512-byte
                     sectors (unsynced writes reach the disk in any order, in pieces)
    ModelFS.crash()  from that instant every call fails with EIO (the dying daemon can no
                     longer touch the disk); the image is built from the state at the cut

The model is strict POSIX, not ext4's generosity: a new or renamed name is durable only once
its directory is fsynced (an fsync of the file does not carry its name), and fdatasync is
taken to persist the size (Linux does, to make the data readable). Only paths under
``root`` are tracked; a write on an fd the model did not open that points under ``root``
is a leak in the seam and fails loudly (``SeamLeak``).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiverd.kernel.fs import Buffer, FileSystem, StrPath
from quiverd.kernel.layout import segment_seq_of
from quiverd.segments.reader import SegmentReader

SECTOR = 512


class SeamLeak(AssertionError):
    """A change under the model's root that did not go through the seam."""


# ---- the state: ops applied in order -----------------------------------------------------
# Data ops: ("w", ino, offset, bytes), ("t", ino, size), ("p", ino, offset, length)
# Metadata ops: ("link", rel, ino), ("rename", src, dst), ("unlink", rel), ("mkdir", rel)
# Barriers: ("sync", ino, n) (its first n pending writes), ("fsync_dir", rel)
# Facts: ("mark", event, facts)
Op = tuple[Any, ...]
DATA_OPS = frozenset({"w", "t", "p"})
META_OPS = frozenset({"link", "rename", "unlink", "mkdir"})
BARRIERS = frozenset({"sync", "fsync_dir"})


@dataclass
class Inode:
    data: bytearray = field(default_factory=bytearray)
    synced: bytes = b""
    pending: list[Op] = field(default_factory=list)


def _parent(rel: str) -> str:
    return os.path.dirname(rel)


def _names_of(op: Op) -> tuple[str, ...]:
    kind = op[0]
    if kind == "rename":
        return (op[1], op[2])
    return (op[1],)


@dataclass
class State:
    inodes: dict[int, Inode] = field(default_factory=dict)
    names: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {""})
    durable_names: dict[str, int] = field(default_factory=dict)
    durable_dirs: set[str] = field(default_factory=lambda: {""})
    pending_meta: list[Op] = field(default_factory=list)
    next_ino: int = 1

    def new_inode(self) -> int:
        ino, self.next_ino = self.next_ino, self.next_ino + 1
        self.inodes[ino] = Inode()
        return ino

    def apply(self, op: Op) -> None:
        kind = op[0]
        if kind in DATA_OPS:
            inode = self.inodes[op[1]]
            _apply_data(inode.data, op)
            inode.pending.append(op)
        elif kind == "sync":  # ("sync", ino, n): the first n pending writes are durable
            inode = self.inodes[op[1]]
            n = op[2] if len(op) > 2 else len(inode.pending)
            if n == len(inode.pending):
                inode.synced, inode.pending = bytes(inode.data), []
            else:
                synced = bytearray(inode.synced)
                for done in inode.pending[:n]:
                    _apply_data(synced, done)
                inode.synced, inode.pending = bytes(synced), inode.pending[n:]
        elif kind == "link":
            self.names[op[1]] = op[2]
            self.pending_meta.append(op)
        elif kind == "rename":
            self.names[op[2]] = self.names.pop(op[1])
            self.pending_meta.append(("rename", op[1], op[2], self.names[op[2]]))
        elif kind == "unlink":
            del self.names[op[1]]
            self.pending_meta.append(op)
        elif kind == "mkdir":
            self.dirs.add(op[1])
            self.pending_meta.append(op)
        elif kind == "fsync_dir":
            self._persist_dir(op[1])
        elif kind == "new_inode":
            self.inodes[op[1]] = Inode()
            self.next_ino = max(self.next_ino, op[1] + 1)
        elif kind != "mark":
            raise ValueError(f"unknown op {op!r}")

    def _persist_dir(self, rel: str) -> None:
        """The metadata ops touching ``rel`` become durable, with every earlier pending op
        on the same names (a journal commits a transaction after those it depends on)."""
        chosen: set[int] = set()
        names: set[str] = set()
        for i in range(len(self.pending_meta) - 1, -1, -1):
            op = self.pending_meta[i]
            touched = _names_of(op)
            if any(_parent(n) == rel for n in touched) or names.intersection(touched):
                chosen.add(i)
                names.update(touched)
        for i in sorted(chosen):
            _apply_meta(self.durable_names, self.durable_dirs, self.pending_meta[i])
        self.pending_meta = [op for i, op in enumerate(self.pending_meta) if i not in chosen]

    # ---- crash images ------------------------------------------------------------------
    def image(self, cut: Cut) -> Image:
        """The files and directories a crash at this state may leave, per ``cut``."""
        names, dirs = dict(self.durable_names), set(self.durable_dirs)
        for op in self.pending_meta[:cut.meta_prefix]:
            _apply_meta(names, dirs, op)
        rng = random.Random(cut.seed)
        contents: dict[int, bytes] = {}
        files: dict[str, bytes] = {}
        for rel, ino in sorted(names.items()):
            if not _reachable(rel, dirs):
                continue
            if ino not in contents:
                contents[ino] = self._crashed_data(self.inodes[ino], cut.data, rng)
            files[rel] = contents[ino]
        return Image(files=files, dirs={d for d in dirs if _reachable(d, dirs)})

    def _crashed_data(self, inode: Inode, mode: str, rng: random.Random) -> bytes:
        if mode == "none" or not inode.pending:
            return inode.synced
        if mode == "all":
            return bytes(inode.data)
        data = bytearray(inode.synced)
        truncates = [op for op in inode.pending if op[0] == "t"]
        keep_truncates = rng.randint(0, len(truncates))
        seen = 0
        for op in inode.pending:
            if op[0] == "t":
                seen += 1
                if seen <= keep_truncates:
                    _apply_data(data, op)
                continue
            for piece in _sectors(op):
                if rng.random() < 0.5:
                    _apply_data(data, piece)
        return bytes(data)

    def crash_cuts(self, rng: random.Random, random_cuts: int = 2) -> list[Cut]:
        """Distinct cuts worth trying here: nothing / everything pending, a metadata
        prefix at random, and ``random_cuts`` torn subsets."""
        n = len(self.pending_meta)
        has_data = any(i.pending for i in self.inodes.values())
        cuts = {Cut(0, "none"), Cut(n, "all"), Cut(n, "none"), Cut(0, "all")}
        for _ in range(random_cuts if (n or has_data) else 0):
            cuts.add(Cut(rng.randint(0, n), "random", rng.randrange(1 << 30)))
        return sorted(cuts, key=lambda c: (c.meta_prefix, c.data, c.seed))

    def current(self) -> Image:
        """What is there now (no crash): for checking the mirror."""
        return Image(files={rel: bytes(self.inodes[ino].data) for rel, ino in self.names.items()},
                     dirs=set(self.dirs))


def _apply_data(data: bytearray, op: Op) -> None:
    kind = op[0]
    if kind == "w":
        offset, chunk = op[2], op[3]
        if offset > len(data):
            data.extend(bytes(offset - len(data)))
        data[offset:offset + len(chunk)] = chunk
    elif kind == "t":
        size = op[2]
        if size < len(data):
            del data[size:]
        else:
            data.extend(bytes(size - len(data)))
    elif kind == "p":
        offset, length = op[2], op[3]
        end = min(offset + length, len(data))
        if end > offset:
            data[offset:end] = bytes(end - offset)


def _sectors(op: Op) -> Iterator[Op]:
    """A write or punch in sector-aligned pieces (what a torn write keeps or loses)."""
    kind, ino, offset = op[0], op[1], op[2]
    length = len(op[3]) if kind == "w" else op[3]
    pos, end = offset, offset + length
    while pos < end:
        stop = min((pos // SECTOR + 1) * SECTOR, end)
        if kind == "w":
            yield ("w", ino, pos, op[3][pos - offset:stop - offset])
        else:
            yield ("p", ino, pos, stop - pos)
        pos = stop


def _apply_meta(names: dict[str, int], dirs: set[str], op: Op) -> None:
    kind = op[0]
    if kind == "link":
        names[op[1]] = op[2]
    elif kind == "rename":
        names.pop(op[1], None)
        names[op[2]] = op[3]
    elif kind == "unlink":
        names.pop(op[1], None)
    elif kind == "mkdir":
        dirs.add(op[1])


def _reachable(rel: str, dirs: set[str]) -> bool:
    parent = _parent(rel)
    while parent:
        if parent not in dirs:
            return False
        parent = _parent(parent)
    return True


@dataclass(frozen=True)
class Cut:
    """Which of the pending changes a crash keeps (see ``State.image``)."""

    meta_prefix: int
    data: str  # "none" | "all" | "random"
    seed: int = 0


@dataclass
class Image:
    files: dict[str, bytes]
    dirs: set[str]

    def materialize(self, root: Path) -> None:
        """Write this image as a real directory tree at ``root`` (which must not exist)."""
        root.mkdir(parents=True)
        for d in sorted(self.dirs):
            if d:
                (root / d).mkdir(parents=True, exist_ok=True)
        for rel, data in self.files.items():
            (root / rel).write_bytes(data)


def replay(ops: Iterable[Op], state: State | None = None) -> State:
    state = state or State()
    for op in ops:
        state.apply(op)
    return state


# ---- the file system the daemon calls ------------------------------------------------------
class ModelFS(FileSystem):
    """The seam's recording model over the real directory ``root`` (see the module doc).

    ``record=True`` keeps every op in ``ops`` (for crash-state enumeration); marks are
    facts the test adds (``mark("ack", seq=...)``) in the same order as the ops.
    """

    def __init__(self, root: StrPath, *, record: bool = False,
                 sync_latency_s: float = 0.0002) -> None:
        self.root = os.path.abspath(root)
        self.sync_latency_s = sync_latency_s
        self.state = State()
        self.record = record
        self.ops: list[Op] = []
        self.dead = False
        self._lock = threading.RLock()
        self._fds: dict[int, tuple[int, bool]] = {}  # fd -> (inode, O_APPEND)
        self._adopt_existing()

    def _adopt_existing(self) -> None:
        """Files already under root count as durable (a restart after a crash image)."""
        if not os.path.isdir(self.root):
            return
        for dirpath, _dirnames, filenames in os.walk(self.root):
            rel_dir = self._rel(dirpath) or ""
            self.state.dirs.add(rel_dir)
            self.state.durable_dirs.add(rel_dir)
            for name in filenames:
                path = os.path.join(dirpath, name)
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                rel = self._rel(path)
                assert rel is not None
                ino = self.state.new_inode()
                with open(path, "rb") as f:
                    data = f.read()
                inode = self.state.inodes[ino]
                inode.data, inode.synced = bytearray(data), data
                self.state.names[rel] = ino
                self.state.durable_names[rel] = ino

    # ---- helpers ---------------------------------------------------------------------
    def _rel(self, path: StrPath) -> str | None:
        p = os.path.abspath(os.fspath(path))
        if p == self.root:
            return ""
        if p.startswith(self.root + os.sep):
            return p[len(self.root) + 1:]
        return None

    def _do(self, op: Op) -> None:
        self.state.apply(op)
        if self.record:
            self.ops.append(op)

    def _alive(self) -> None:
        if self.dead:
            raise OSError(errno.EIO, "the model file system crashed")

    def _inode_of_fd(self, fd: int) -> tuple[int, bool] | None:
        known = self._fds.get(fd)
        if known is not None:
            return known
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        if self._rel(target) is not None:
            raise SeamLeak(f"fd {fd} ({target}) is written but was not opened through the seam")
        return None

    # ---- the seam's calls ------------------------------------------------------------
    def open(self, path: StrPath, flags: int, mode: int = 0o777, *,  # type: ignore[override]
             dir_fd: int | None = None) -> int:
        with self._lock:
            self._alive()
            rel = self._rel(path)
            writable = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            if rel is None or not writable:
                return os.open(path, flags, mode)
            existed = rel in self.state.names
            fd = os.open(path, flags, mode)
            if existed:
                ino = self.state.names[rel]
            else:
                ino = self.state.next_ino
                self._do(("new_inode", ino))
                self._do(("link", rel, ino))
            if flags & os.O_TRUNC and existed:
                self._do(("t", ino, 0))
            self._fds[fd] = (ino, bool(flags & os.O_APPEND))
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            os.close(fd)

    def write(self, fd: int, data: Buffer) -> int:
        return self.writev(fd, [data])

    def writev(self, fd: int, buffers: Sequence[Buffer]) -> int:  # type: ignore[override]
        with self._lock:
            self._alive()
            known = self._inode_of_fd(fd)
            if known is None:
                return os.writev(fd, buffers)
            ino, append = known
            offset = os.fstat(fd).st_size if append else os.lseek(fd, 0, os.SEEK_CUR)
            n = os.writev(fd, buffers)
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:n]
            if data:
                self._do(("w", ino, offset, data))
            return n

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._alive()
            known = self._inode_of_fd(fd)
            os.ftruncate(fd, length)
            if known is not None:
                self._do(("t", known[0], length))

    def punch_hole(self, fd: int, offset: int, length: int) -> None:
        with self._lock:
            self._alive()
            known = self._inode_of_fd(fd)
            super().punch_hole(fd, offset, length)
            if known is not None:
                self._do(("p", known[0], offset, length))

    def copy_file_range(self, src: int, dst: int, count: int, offset_src: int) -> int:
        with self._lock:
            self._alive()
            known = self._inode_of_fd(dst)
            offset = os.lseek(dst, 0, os.SEEK_CUR)
            n = os.copy_file_range(src, dst, count, offset_src)
            if known is not None and n:
                self._do(("w", known[0], offset, os.pread(src, n, offset_src)))
            return n

    def fsync(self, fd: int) -> None:
        self.fdatasync(fd)

    def fdatasync(self, fd: int) -> None:
        """Durable: what was written before the call (not what other threads write while
        it runs). No real sync, only ``sync_latency_s`` of waiting: the window in which
        a real fdatasync has not yet returned is kept, and tests run faster."""
        with self._lock:
            self._alive()
            known = self._inode_of_fd(fd)
            if known is None:
                return
            covered = len(self.state.inodes[known[0]].pending)
        if self.sync_latency_s:
            time.sleep(self.sync_latency_s)
        with self._lock:
            self._alive()
            self._do(("sync", known[0], covered))

    def rename(self, src: StrPath, dst: StrPath) -> None:  # type: ignore[override]
        with self._lock:
            self._alive()
            a, b = self._rel(src), self._rel(dst)
            os.rename(src, dst)
            if a is not None and b is not None and a in self.state.names:
                self._do(("rename", a, b))
                if self.record and not self.dead:
                    self._note_segment(dst, b)
            elif a is not None or b is not None:
                raise SeamLeak(f"rename {src} -> {dst} crosses the model's root or names "
                               "a file it does not know")

    def link(self, src: StrPath, dst: StrPath) -> None:  # type: ignore[override]
        """A hard link: a new name of ``src``'s inode (compaction's task copies)."""
        with self._lock:
            self._alive()
            a, b = self._rel(src), self._rel(dst)
            os.link(src, dst)
            if a is not None and b is not None and a in self.state.names:
                self._do(("link", b, self.state.names[a]))
            elif b is not None:
                raise SeamLeak(f"link {src} -> {dst}: a name under the model's root for a "
                               "file it does not know")

    def _note_segment(self, path: StrPath, rel: str) -> None:
        """A segment renamed into place: which bundle (index) holds which sequence, as a
        mark (what a crash-state check needs to map an acked sequence to its bundle id
        once retention has deleted the file)."""
        seq = segment_seq_of(os.path.basename(rel))
        if seq is None:
            return
        with SegmentReader.open(path) as reader:
            bundles = [(b.index, b.sequence) for b in reader.bundles()]
        self.ops.append(("mark", "segment", {"seg": seq, "bundles": bundles}))

    def unlink(self, path: StrPath, *, missing_ok: bool = False) -> None:
        with self._lock:
            self._alive()
            rel = self._rel(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                if not missing_ok:
                    raise
                return
            if rel is not None:
                if rel not in self.state.names:
                    raise SeamLeak(f"unlink of {path}, which was not created through the seam")
                self._do(("unlink", rel))

    def chmod(self, path: StrPath, mode: int) -> None:  # type: ignore[override]
        with self._lock:
            self._alive()
            os.chmod(path, mode)

    def mkdir(self, path: StrPath) -> None:
        with self._lock:
            self._alive()
            rel = self._rel(path)
            missing: list[str] = []
            p = Path(os.path.abspath(os.fspath(path)))
            while not p.exists():
                missing.append(str(p))
                p = p.parent
            Path(path).mkdir(parents=True, exist_ok=True)
            if rel is None:
                return
            for made in reversed(missing):
                made_rel = self._rel(made)
                if made_rel:
                    self._do(("mkdir", made_rel))

    def fsync_dir(self, path: StrPath) -> None:
        with self._lock:
            self._alive()
            rel = self._rel(path)
            if rel is None:
                super().fsync_dir(path)
            else:
                self._do(("fsync_dir", rel))

    def mark(self, event: str, **facts: Any) -> None:
        with self._lock:
            if not self.dead and self.record:
                if "written" in facts:  # the WAL writer's commit: keep the sequences only
                    facts["sequences"] = [b.sequence for _, b, _ in facts.pop("written")]
                self.ops.append(("mark", event, facts))

    # ---- crashing --------------------------------------------------------------------
    def crash(self) -> State:
        """From now on every call fails (EIO); returns the state at this instant."""
        with self._lock:
            self.dead = True
            return self.state

    def check_mirror(self, ignore: Iterable[str] = ()) -> list[str]:
        """Differences between the model's present and the real directory: each one is
        a change that bypassed the seam. ``ignore``: relative path prefixes not tracked."""
        skip = tuple(ignore)
        with self._lock:
            now = self.state.current()
            problems: list[str] = []
            seen: set[str] = set()
            for dirpath, _dirs, filenames in os.walk(self.root):
                for name in filenames:
                    rel = self._rel(os.path.join(dirpath, name))
                    assert rel is not None
                    if rel.startswith(skip) or os.path.islink(os.path.join(dirpath, name)):
                        continue
                    seen.add(rel)
                    if rel not in now.files:
                        problems.append(f"{rel}: on disk, unknown to the model")
                        continue
                    with open(os.path.join(dirpath, name), "rb") as f:
                        real = f.read()
                    if real != now.files[rel]:
                        problems.append(f"{rel}: {len(real)} bytes on disk, "
                                        f"{len(now.files[rel])} in the model, contents differ")
            for rel in now.files:
                if rel not in seen and not rel.startswith(skip):
                    problems.append(f"{rel}: in the model, not on disk")
            return problems
