"""The model file system: what a cut keeps, and that it mirrors the real directory."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from quiverd.kernel import fs
from quiverd.kernel.durable import atomic_write
from tests.sim.modelfs import Cut, ModelFS, SeamLeak, replay

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC


@pytest.fixture
def model(tmp_path: Path):  # type: ignore[no-untyped-def]
    m = ModelFS(tmp_path, record=True, sync_latency_s=0)
    previous = fs.install(m)
    yield m
    fs.install(previous)


def test_modelfs_new_file_needs_its_directory_fsynced(model: ModelFS, tmp_path: Path) -> None:
    fd = model.open(tmp_path / "a", FLAGS, 0o644)
    model.write(fd, b"x" * 1000)
    model.fdatasync(fd)
    model.close(fd)
    assert "a" not in model.state.image(Cut(0, "none")).files  # name not durable yet
    model.fsync_dir(tmp_path)
    assert model.state.image(Cut(0, "none")).files["a"] == b"x" * 1000


def test_modelfs_unsynced_append_is_dropped_kept_or_torn(model: ModelFS, tmp_path: Path) -> None:
    fd = model.open(tmp_path / "w", FLAGS, 0o644)
    model.write(fd, b"a" * 512)
    model.fdatasync(fd)
    model.fsync_dir(tmp_path)
    model.write(fd, b"b" * 2048)
    model.close(fd)
    state = model.state
    assert state.image(Cut(0, "none")).files["w"] == b"a" * 512
    assert state.image(Cut(0, "all")).files["w"] == b"a" * 512 + b"b" * 2048
    torn = {state.image(Cut(0, "random", s)).files["w"] for s in range(40)}
    assert len(torn) > 3  # pieces of 512 bytes, kept or lost independently
    assert all(t.startswith(b"a" * 512) for t in torn)


def test_modelfs_atomic_write_leaves_old_or_new(model: ModelFS, tmp_path: Path) -> None:
    atomic_write(tmp_path / "side", b"old")
    first_done = len(model.ops)  # ends with the directory fsync
    atomic_write(tmp_path / "side", b"new")
    ops = model.ops
    for n in range(len(ops) + 1):
        state = replay(ops[:n])
        allowed = {b"old", b"new"} if n >= first_done else {None, b"old"}
        for k in range(len(state.pending_meta) + 1):
            for mode in ("none", "all", "random"):
                got = state.image(Cut(k, mode, n)).files.get("side")
                assert got in allowed, (n, k, mode, got)
    assert replay(ops).image(Cut(0, "none")).files["side"] == b"new"


def test_modelfs_mirrors_the_real_directory_and_finds_a_bypass(model: ModelFS,
                                                               tmp_path: Path) -> None:
    rng = random.Random(1)
    for i in range(30):
        name = tmp_path / f"f{rng.randrange(4)}"
        fd = model.open(name, FLAGS, 0o644)
        os.lseek(fd, 0, os.SEEK_END)
        model.write(fd, os.urandom(rng.randrange(1, 3000)))
        if rng.random() < 0.3:
            model.ftruncate(fd, rng.randrange(0, 2000))
        model.close(fd)
        if i % 7 == 6 and name.exists():
            model.rename(name, tmp_path / f"r{i}")
    assert model.check_mirror() == []
    (tmp_path / "x").write_bytes(b"behind the model's back")
    assert model.check_mirror() != []


def test_modelfs_write_on_an_fd_it_did_not_open_is_a_leak(model: ModelFS, tmp_path: Path) -> None:
    fd = os.open(tmp_path / "direct", FLAGS, 0o644)
    try:
        with pytest.raises(SeamLeak):
            model.write(fd, b"x")
    finally:
        os.close(fd)


def test_modelfs_after_a_crash_every_call_fails(model: ModelFS, tmp_path: Path) -> None:
    model.crash()
    with pytest.raises(OSError) as info:
        model.open(tmp_path / "late", FLAGS, 0o644)
    assert info.value.errno == errno.EIO
