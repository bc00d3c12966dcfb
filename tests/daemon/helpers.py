"""Helpers for daemon tests: tagged tables and reading back what the daemon stored."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from quiverd.segments.reader import SegmentReader


def tagged_table(tag: int, rows: int = 100, text_bytes: int = 8) -> pa.Table:
    """A table whose content identifies it: column `tag` holds ``tag`` in every row."""
    return pa.table({
        "tag": pa.array([tag] * rows, pa.int64()),
        "i": pa.array(range(rows), pa.int64()),
        "s": pa.array([f"{tag:0{text_bytes}d}"] * rows),
    })


def stored_bundles(data_dir: Path) -> dict[tuple[int, int], Any]:
    """Every bundle in every segment, keyed by (shard, WAL sequence); asserts no duplicates."""
    out: dict[tuple[int, int], Any] = {}
    for shard_dir in sorted(data_dir.glob("shard-*")):
        shard = int(shard_dir.name.split("-")[1])
        for path in sorted((shard_dir / "segments").glob("*.qseg")):
            with SegmentReader.open(path) as reader:
                for b in reader.bundles():
                    key = (shard, b.sequence)
                    assert key not in out, f"bundle {key} stored twice"
                    out[key] = b
    return out


def flip(path: Path, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` in a (read-only) file: damage on disk."""
    os.chmod(path, 0o640)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
