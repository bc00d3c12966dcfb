"""A burst of deliveries (a Spark job's commit publishes every staged bundle at once)
still rotates lake files by size: real uploader, real Parquet files, fs store, SQLite."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.acks import format as ackfmt
from tests.actors.test_uploader import delivery, registered, running
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import open_test_tier

KiB = 1024
FILE_SIZE = 256 * KiB
ROW_GROUP = 64 * KiB
PART_ROWS = 2_000  # 32 KB per bundle (seed + random float64): zstd cannot shrink it


def floats(seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"seed": pa.array([seed] * PART_ROWS, pa.int64()),
                     "x": rng.random(PART_ROWS)})


@pytest.mark.asyncio
async def test_uploader_burst_rotates_every_file_by_size(tmp_path: Path) -> None:
    bundles = 200  # 3.2 MB of Arrow bytes at once: over 12 x file_size_bytes
    async with open_test_tier(tmp_path, file_size_bytes=FILE_SIZE, row_group_bytes=ROW_GROUP,
                              file_duration_ms=1_000, max_buffer_bytes=64 << 20) as tier, \
            running(tier) as (acks, uploader, tx):
        for i in range(bundles):  # nothing awaited in between but the stream's room
            await tx.send(delivery(1, i, {0: floats(i)}))
        await acks.until(lambda o: len(o) == bundles)
        assert sorted(acks.outcomes) == [(1, i, ackfmt.ACK) for i in range(bundles)]
        files = await registered(tier)
        # The bound that holds: a file is rotated once a row group takes it to
        # file_size_bytes, and a row group holds less than row_group_bytes plus one
        # bundle's slot of Arrow bytes (Parquet bytes <= Arrow bytes here: zstd can only
        # shrink the seed column, random floats stay as they are).
        slack = ROW_GROUP + floats(0).nbytes
        sizes = sorted(f.compressed_size for f in files)
        assert sum(sizes) > 8 * FILE_SIZE, sizes  # the burst was several files' worth
        assert all(s <= FILE_SIZE + slack for s in sizes), (sizes, FILE_SIZE + slack)
        seen: Counter[int] = Counter()
        for f in files:
            t = pq.read_table(uri_path(f.uri), columns=["seed", "_quiver_bundle"])
            assert t.num_rows == f.row_count
            seen.update(t["seed"].to_pylist())
        assert seen == Counter({i: PART_ROWS for i in range(bundles)})
