"""lake.parquet: an Active file the daemon never closed (its fatal exit on a dead disk)
is left as it is when collected. pyarrow's writer closed itself from ``__del__``: it
wrote a footer, so an abandoned file looked whole, and on the power-cut campaign's dead
filesystem (bench/powercut.py) that write failed at exit with a traceback in the log."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from quiverd.lake.parquet import ActiveFile, ParquetSettings
from tests.daemon.mounts import MiB, fill, mounted_tmpfs

SCHEMA = pa.schema([("ts", pa.int64()), ("text", pa.string())])


def _active_with_rows(path: Path) -> ActiveFile:
    active = ActiveFile.create(path, SCHEMA, ParquetSettings(), metadata={}, time_column="ts")
    active.append(pa.table({"ts": list(range(1000)), "text": ["x" * 40] * 1000},
                           schema=SCHEMA))
    return active


def test_active_file_gets_no_footer_when_collected_unclosed(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    active = _active_with_rows(path)
    del active
    gc.collect()
    assert path.read_bytes()[-4:] != b"PAR1"  # unfinished, as the daemon left it


def test_active_file_collected_unclosed_raises_nothing_when_disk_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with mounted_tmpfs(tmp_path / "small", 1 * MiB) as where:
        active = _active_with_rows(where / "a.parquet")
        active._file.flush()  # the row group is on the disk; only a footer could follow
        fill(where / "filler")
        del active
        gc.collect()
    assert [repr(u.exc_value) for u in unraisable] == []
