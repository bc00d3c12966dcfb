"""An fsync by fd raises an OSError with no filename: the helpers name the file, so the
``quiverd_fatal_durability`` event carries ``path`` (EIO from fsync cannot be made real
on demand here: the seam's fsync is replaced for the call)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from quiverd.kernel import durable, fs
from quiverd.kernel.layout import tmp_path as tmp_name
from quiverd.runtime import serve


def eio(fd: int) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


class FailingFsync(fs.FileSystem):
    """The real file system, except that every fsync (file or directory) fails."""

    fsync = staticmethod(eio)

    def fsync_dir(self, path: fs.StrPath) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            eio(fd)
        finally:
            os.close(fd)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def critical(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))


@pytest.mark.parametrize("call", ["atomic_write", "fsync_dir"])
def test_failed_fsync_names_its_file_in_the_fatal_event(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    target = tmp_path / "marker"
    previous = fs.install(FailingFsync())
    try:
        with pytest.raises(OSError) as raised:
            if call == "atomic_write":
                durable.atomic_write(target, b"x")
            else:
                durable.fsync_dir(tmp_path)
    finally:
        fs.install(previous)
    expected = tmp_name(target) if call == "atomic_write" else tmp_path
    assert raised.value.errno == errno.EIO and raised.value.filename == str(expected)
    log = Log()
    assert serve._report_fatal(BaseExceptionGroup("x", [raised.value]), log) == serve.EXIT_FATAL
    [(event, fields)] = log.events
    assert event == "quiverd_fatal_durability" and fields["path"] == str(expected)
    assert fields["errno"] == "EIO"
