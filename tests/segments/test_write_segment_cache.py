"""write_segment gives a durable segment's page-cache pages back, and only then.

Pages the VM touched recently are ~5× cheaper to write into than fresh ones, so each
segment hands its (clean, fsynced) pages back for the next one. The advice comes after
the fsync and the rename, is best effort, and never fails a write.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quiverd.kernel import fs
from quiverd.segments import files
from quiverd.segments.files import write_segment


def test_write_segment_drops_cached_pages_after_the_file_is_durable(tmp_path, monkeypatch):
    path = tmp_path / "0000000000000001.qseg"
    events: list[str] = []

    class RecordingFsync(fs.FileSystem):
        def fsync(self, fd: int) -> None:
            events.append("fsync")
            os.fsync(fd)

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert path.exists(), "advice before the rename"
        assert os.fstat(fd).st_size == 3 * 4096
        events.append(f"fadvise {offset} {length} {advice == os.POSIX_FADV_DONTNEED}")

    monkeypatch.setattr(files.os, "posix_fadvise", fadvise)
    previous = fs.install(RecordingFsync())
    try:
        assert write_segment(path, [b"a" * 4096, memoryview(b"b" * 8192)]) == 3 * 4096
    finally:
        fs.install(previous)
    assert events[-1] == "fadvise 0 0 True"
    assert "fsync" in events[:-1]
    assert path.read_bytes() == b"a" * 4096 + b"b" * 8192


@pytest.mark.parametrize("where", ["open", "fadvise"])
def test_write_segment_succeeds_when_the_cache_advice_fails(tmp_path: Path, monkeypatch, where):
    def refuse(*args: object) -> None:
        raise OSError(22, "refused")

    if where == "open":
        real_open = os.open

        def opener(p: object, flags: int, *args: object) -> int:
            if flags & os.O_WRONLY == 0 and str(p).endswith(".qseg"):
                refuse()
            return real_open(p, flags, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(files.os, "open", opener)
    else:
        monkeypatch.setattr(files.os, "posix_fadvise", refuse)
    path = tmp_path / "0000000000000002.qseg"
    assert write_segment(path, [b"x" * 100]) == 100
    assert path.read_bytes() == b"x" * 100
