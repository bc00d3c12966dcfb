"""Every durable write of the core goes through the file-system seam (``kernel.fs``).

A test's recording file system (``fs.install``) can only tell what a crash leaves if
it sees every call that changes a file or makes a change durable. This walks the
core's modules and fails on any such call made directly: a mutating ``os`` function,
an ``os.open`` whose flags are not plainly read-only, a mutating ``Path`` method, a
``shutil`` move or copy, or ``open()`` for writing. Reads stay direct.

Static, so it is strict where it cannot know: ``os.open`` passes only when its flags
spell ``O_RDONLY`` and none of the write flags; ``open()`` only with a literal read
mode. ``unlink``/``mkdir``/``rename`` pass only on the seam itself: ``fs.active()``,
``self._fs``, or a local bound to ``fs.active()``.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The core and the lake's local steps (staging files, compaction's task copies and
# downloads, their eviction and sweeping): what
# the seam's model must see whole. Not the object store's own files (OpenDAL writes them;
# the crash-state tools treat the store as a service), the catalog's (SQLite's), the CLI,
# spark, the lockfile.
MODULE_GLOBS = (
    "quiverd/kernel/durable.py",
    "quiverd/kernel/quarantine.py",
    "quiverd/wal/*.py",
    "quiverd/segments/*.py",
    "quiverd/acks/*.py",
    "quiverd/runtime/recovery.py",
    "quiverd/runtime/loss.py",
    *(f"actors/quiverd_actors/{name}.py" for name in (
        "finalizer", "gc_sweeper", "ack_logger", "scrubber", "wal_threads", "wal_writer",
        "segment_builder", "indexer", "janitor")),
    "actors/quiverd_actors/uploader/*.py",
    *(f"quiverd/lake/{name}.py" for name in ("parquet", "bundles", "tier", "janitor",
                                             "compaction")),
    "quiverd/lake/store/transfer.py",  # downloads land in staging/
)
EXCLUDED = frozenset({"quiverd/kernel/fs.py"})  # the seam itself

MUTATING_OS = frozenset({
    "write", "writev", "pwrite", "pwritev", "fsync", "fdatasync", "ftruncate", "truncate",
    "rename", "renames", "replace", "unlink", "remove", "rmdir", "removedirs", "mkdir",
    "makedirs", "copy_file_range", "sendfile", "chmod", "fchmod", "posix_fallocate",
    "link", "symlink", "sync",
})
WRITE_FLAGS = frozenset({"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"})
# Path methods that change the file system. ``rename``/``replace`` with one argument
# only: ``str.replace`` and ``msgspec.structs.replace`` take more.
PATH_ANY_ARGS = frozenset({"unlink", "mkdir", "write_bytes", "write_text", "touch",
                           "rmdir", "symlink_to", "hardlink_to", "chmod"})
PATH_ONE_ARG = frozenset({"rename", "replace"})
SHUTIL_MUTATING = frozenset({"move", "copy", "copy2", "copyfile", "copytree", "rmtree",
                             "copymode", "copystat", "chown"})
SEAM_ATTRS = frozenset({"_fs"})  # self._fs, captured once by long-lived objects
LIBC_MUTATING = frozenset({"fallocate", "_fallocate"})  # ctypes: punch_hole is the seam's


def core_modules() -> list[Path]:
    found = {p for pattern in MODULE_GLOBS for p in ROOT.glob(pattern)}
    return sorted(p for p in found if p.relative_to(ROOT).as_posix() not in EXCLUDED)


def direct_writes(source: str, name: str = "<source>") -> list[str]:
    """``file:line: call`` for every mutating call in ``source`` that bypasses the seam."""
    tree = ast.parse(source, name)
    os_names, os_funcs, seam_locals = _bindings(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        why = _why(node, os_names, os_funcs, seam_locals)
        if why is not None:
            out.append((node.lineno, f"{name}:{node.lineno}: {why}"))
    return [text for _, text in sorted(out)]


def _bindings(tree: ast.AST) -> tuple[set[str], dict[str, str], set[str]]:
    """Names bound to the os module, to os functions (``from os import x``), and to
    the seam (``x = fs.active()``)."""
    os_names, os_funcs, seam_locals = {"os"}, {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            os_funcs |= {a.asname or a.name: a.name for a in node.names}
        elif isinstance(node, ast.Assign) and _is_active_call(node.value):
            seam_locals |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return os_names, os_funcs, seam_locals


def _why(call: ast.Call, os_names: set[str], os_funcs: dict[str, str],
         seam_locals: set[str]) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in LIBC_MUTATING:
            return f"{func.id}() (libc, not the seam)"
        if func.id in os_funcs:
            return _os_call(os_funcs[func.id], call)
        if func.id == "open":
            return _builtin_open(call)
        return None
    if not isinstance(func, ast.Attribute):
        return None
    receiver, attr = func.value, func.attr
    if isinstance(receiver, ast.Name) and receiver.id in os_names:
        return _os_call(attr, call)
    if isinstance(receiver, ast.Name) and receiver.id == "shutil" and attr in SHUTIL_MUTATING:
        return f"shutil.{attr}"
    if _is_seam(receiver, seam_locals):
        return None
    if attr in LIBC_MUTATING:
        return f"{ast.unparse(receiver)}.{attr}() (libc, not the seam)"
    if attr in PATH_ANY_ARGS or (attr in PATH_ONE_ARG and len(call.args) == 1
                                 and not call.keywords):
        return f"{ast.unparse(receiver)}.{attr}() (a Path method, not the seam)"
    return None


def _os_call(attr: str, call: ast.Call) -> str | None:
    if attr in MUTATING_OS:
        return f"os.{attr}"
    if attr in ("open", "fdopen"):
        return _os_open(attr, call)
    return None


def _os_open(attr: str, call: ast.Call) -> str | None:
    if attr == "fdopen":
        return _builtin_open(call, what="os.fdopen")
    flags = call.args[1] if len(call.args) > 1 else _keyword(call, "flags")
    if flags is None:
        return "os.open without flags"
    names = {n.attr for n in ast.walk(flags) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(flags) if isinstance(n, ast.Name)}
    if "O_RDONLY" in names and not names & WRITE_FLAGS:
        return None
    return f"os.open({ast.unparse(flags)}) (not plainly read-only)"


def _builtin_open(call: ast.Call, what: str = "open") -> str | None:
    mode = call.args[1] if len(call.args) > 1 else _keyword(call, "mode")
    if mode is None:
        return None  # "r"
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return f"{what}(mode={mode.value!r})" if set(mode.value) & set("wa+x") else None
    return f"{what}(mode={ast.unparse(mode)}) (not a literal read mode)"


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_active_call(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "active" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "fs")


def _is_seam(receiver: ast.expr, seam_locals: set[str]) -> bool:
    if _is_active_call(receiver):
        return True
    if isinstance(receiver, ast.Name):
        return receiver.id in seam_locals
    return (isinstance(receiver, ast.Attribute) and receiver.attr in SEAM_ATTRS
            and isinstance(receiver.value, ast.Name) and receiver.value.id == "self")


# ---- the tree ------------------------------------------------------------------------
def test_fs_seam_module_list_finds_the_core() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in core_modules()}
    assert {"quiverd/kernel/durable.py", "quiverd/wal/files.py", "quiverd/acks/log.py",
            "quiverd/segments/files.py", "actors/quiverd_actors/gc_sweeper.py"} <= names
    assert "quiverd/kernel/fs.py" not in names


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_fs_seam_core_module_writes_only_through_the_seam(path: Path) -> None:
    found = direct_writes(path.read_text(), path.relative_to(ROOT).as_posix())
    assert found == [], "durable writes must go through fs.active():\n" + "\n".join(found)


# ---- the checker catches what it must (planted calls) ---------------------------------
@pytest.mark.parametrize("line", [
    "os.write(fd, b'x')",
    "os.writev(fd, [b'x'])",
    "os.pwrite(fd, b'x', 0)",
    "os.fsync(fd)",
    "os.fdatasync(fd)",
    "os.ftruncate(fd, 0)",
    "os.truncate(p, 0)",
    "os.rename(a, b)",
    "os.replace(a, b)",
    "os.unlink(p)",
    "os.remove(p)",
    "os.mkdir(p)",
    "os.makedirs(p, exist_ok=True)",
    "os.copy_file_range(a, b, 1, 0)",
    "os.chmod(p, 0o640)",
    "os.open(p, os.O_WRONLY | os.O_CLOEXEC)",
    "os.open(p, os.O_RDWR | os.O_CREAT, 0o600)",
    "os.open(p, os.O_RDONLY | os.O_APPEND)",
    "os.open(p, flags)",
    "os.open(p, flags=os.O_WRONLY)",
    "p.unlink(missing_ok=True)",
    "layout.tmp_path(p).unlink()",
    "p.mkdir(parents=True, exist_ok=True)",
    "p.write_bytes(b'x')",
    "p.write_text('x')",
    "p.rename(q)",
    "p.replace(q)",
    "p.touch()",
    "shutil.move(a, b)",
    "shutil.rmtree(d)",
    "open(p, 'wb')",
    "open(p, 'ab')",
    "open(p, 'r+b')",
    "open(p, mode='x')",
    "open(p, mode)",
    "self.other.unlink(p)",
    "_fallocate()(fd, 3, 0, 4096)",
    "libc.fallocate(fd, 3, 0, 4096)",
])
def test_fs_seam_checker_flags_a_direct_call(line: str) -> None:
    assert len(direct_writes(f"import os, shutil\n{line}\n")) == 1


def test_fs_seam_checker_follows_aliases() -> None:
    source = "import os as o\nfrom os import fsync as sync_now\no.unlink(p)\nsync_now(fd)\n"
    assert len(direct_writes(source)) == 2


@pytest.mark.parametrize("line", [
    "os.open(p, os.O_RDONLY | os.O_CLOEXEC)",
    "os.open(p, os.O_RDONLY | os.O_DIRECTORY)",
    "os.close(fd)",
    "os.pread(fd, 8, 0)",
    "os.fstat(fd)",
    "os.lseek(fd, 0, os.SEEK_SET)",
    "os.statvfs(d)",
    "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)",
    "open(p, 'rb')",
    "open(p)",
    "p.read_bytes()",
    "fs.active().unlink(p, missing_ok=True)",
    "fs.active().mkdir(d)",
    "self._fs.rename(a, b)",
    "seam = fs.active()\nseam.unlink(p)\nseam.rename(a, b)",
    "msgspec.structs.replace(s, ipc=b'')",
    "name.replace('a', 'b')",
    "fs.write_all(fd, [b'x'], seam)",
    "fs.active().punch_hole(fd, 0, 4096)",
])
def test_fs_seam_checker_passes_reads_and_the_seam(line: str) -> None:
    assert direct_writes(f"import os\n{line}\n") == []


def test_write_all_writes_every_chunk_through_short_writevs_and_past_iov_max(tmp_path):
    """write_all hands the seam's writev up to IOV_MAX chunks at a time and goes on
    after a short write that ends inside a chunk (empty chunks are skipped)."""
    from quiverd.kernel import fs as fsmod

    class Short(fsmod.FileSystem):
        calls: list[int] = []

        def writev(self, fd, buffers):  # type: ignore[override]
            self.calls.append(len(buffers))
            assert len(buffers) <= fsmod.IOV_MAX
            first = bytes(buffers[0])
            return os.write(fd, first[: max(1, len(first) // 2)] if len(buffers) % 3 else first)

    chunks = [bytes([i % 251]) * (i % 7) for i in range(2500)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        n = fsmod.write_all(fd, chunks, Short())
    finally:
        os.close(fd)
    want = b"".join(chunks)
    assert n == len(want) and path.read_bytes() == want
    assert max(Short.calls) == fsmod.IOV_MAX  # batched, not one call per chunk
