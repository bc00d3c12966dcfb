"""Helpers for lake integrity tests: distinct lake files of random floats, and damage
done to an object on disk as a failing disk or a bad copy would do it."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.client import Client
from quiverd.lake.model import FileRow
from tests.daemon.lake_helpers import wait_for_lake

ROWS = 20_000  # 160 KB of random float64 per bundle: pages far larger than 32 bytes
CLIENT = "floats"


def floats(seed: int) -> pa.Table:
    return pa.table({"seed": pa.array([seed] * ROWS, pa.int64()),
                     "x": np.random.default_rng(seed).random(ROWS)})


def send_files(d: Any, files: int) -> list[FileRow]:
    """``files`` lake files of client "floats", one bundle each (the lake rotates
    between sends: FAST_LAKE's file_duration_ms), ordered by time."""
    sent: Counter[tuple[str, int]] = Counter()
    rows: list[FileRow] = []
    for seed in range(files):
        with Client.connect(d.socket) as c:
            c.send({0: floats(seed)}, client=CLIENT)
        sent[(CLIENT, 0)] += ROWS
        rows = wait_for_lake(d, sent)
    assert len(rows) == files, rows
    return sorted(rows, key=lambda r: (r.start_ts, r.file_id))


def flip_in_data_page(path: str, column: str = "x", nbytes: int = 32) -> None:
    """Flip ``nbytes`` bytes 4 KiB into the first page of ``column``'s chunk: inside the
    page body, past its header, so only the page checksum can tell."""
    meta = pq.read_metadata(path)
    leaf = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == column)
    chunk = meta.row_group(0).column(leaf)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    assert chunk.total_compressed_size > 8192
    os.chmod(path, 0o640)
    with open(path, "r+b") as f:
        f.seek(start + 4096)
        data = f.read(nbytes)
        f.seek(start + 4096)
        f.write(bytes(b ^ 0x5A for b in data))
