"""The one quarantine (quiverd.kernel.quarantine): whole files moved, byte ranges kept."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from quiverd.kernel.quarantine import keep_bytes, move_file


class Events:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.records.append({"event": event, **kw})


def test_quarantine_move_file_never_overwrites_an_earlier_copy(tmp_path: Path) -> None:
    src_dir, qdir = tmp_path / "segments", tmp_path / "quarantine"
    src_dir.mkdir()
    events = Events()
    targets = []
    for content in (b"first", b"second"):
        path = src_dir / "0000000000000001.qseg"
        path.write_bytes(content)
        os.chmod(path, 0o440)  # finalized segments are read-only
        targets.append(move_file(path, qdir, reason="bad crc", log=events))
        assert not path.exists()
    assert [t.name for t in targets] == ["0000000000000001.qseg", "0000000000000001.qseg.1"]
    assert [t.read_bytes() for t in targets] == [b"first", b"second"]
    assert [e["event"] for e in events.records] == ["file_quarantined"] * 2
    assert events.records[0]["reason"] == "bad crc"
    assert os.stat(targets[0]).st_mode & 0o200  # an operator may delete it


def test_quarantine_keep_bytes_creates_the_directory_and_rewrites_the_same_name(
        tmp_path: Path) -> None:
    qdir = tmp_path / "shard-0" / "quarantine"
    (tmp_path / "shard-0").mkdir()
    first = keep_bytes(memoryview(b"torn tail"), qdir, "quiver.wal.0.30.torn")
    again = keep_bytes(b"torn tail", qdir, "quiver.wal.0.30.torn")
    assert first == again and first.read_bytes() == b"torn tail"
    assert sorted(p.name for p in qdir.iterdir()) == ["quiver.wal.0.30.torn"]
