"""Issue 18, the uploader's per-bundle and per-hop costs: intake keeps filling a file's
next row group while one is encoded, the bundle columns are built without pandas, and
coverage answers are cached per segment."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.acks import format as ackfmt
from quiverd.lake.bundles import CoverageCache, slot_table, time_column_of, with_extras
from quiverd.lake.drift import conform, unify
from quiverd.lake.model import INGESTED_AT
from quiverd.lake.partitions import hour_of_ns
from quiverd_actors.uploader.files import OpenFile, Part, row_group
from tests.actors.test_uploader import delivery, registered, rows, running
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import open_test_tier

MiB = 1 << 20


async def eventually(done: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        for _ in range(100_000):
            if done():
                return
            await anyio.sleep(0.01)


# (shard, client, slot, partition column, hour): test_uploader's deliveries' hour.
KEY = (0, "app", 0, INGESTED_AT, hour_of_ns(1_700_000_000_000_000_000), "")


def open_file() -> OpenFile:
    return OpenFile(key=KEY, file_id="f", path=Path("/nonexistent"),
                    schema=pa.schema([]), opened_at=0.0, created_ns=0)


@pytest.mark.parametrize(
    ("locked", "buffered", "inflight", "written", "encoded", "add", "wait"),
    [
        (False, 0, 0, 0, 0, MiB, False),  # nothing in flight: buffer
        (False, 64 * MiB, 0, 0, 0, MiB, True),  # a full row group waits for its flush
        (True, 0, 64 * MiB, 0, 0, MiB, False),  # first one in flight, ratio 1: 65 < 128
        (True, 63 * MiB, 64 * MiB, 0, 0, MiB, True),  # ratio 1: 64 + 63 + 1 >= 128
        (True, 10 * MiB, 64 * MiB, 13 * MiB, 64 * MiB, MiB, False),  # 13 + 0.2 x 75 < 128
        (True, 63 * MiB, 64 * MiB, 13 * MiB, 64 * MiB, MiB, False),  # 13 + 0.2 x 128 < 128
        (True, 10 * MiB, 64 * MiB, 115 * MiB, 512 * MiB, MiB, True),  # 115 + 0.22 x 75 >= 128
        (True, 64 * MiB, 64 * MiB, 13 * MiB, 64 * MiB, MiB, True),  # next one full too
    ])
@pytest.mark.asyncio
async def test_must_wait_only_when_a_row_group_is_full_or_the_file_may_fill(
        locked: bool, buffered: int, inflight: int, written: int, encoded: int, add: int,
        wait: bool) -> None:
    f = open_file()
    f.buffered_bytes, f.inflight_bytes = buffered, inflight
    f.written_bytes, f.encoded_bytes = written, encoded
    if locked:
        await f.lock.acquire()
    assert f.must_wait(add, row_group_bytes=64 * MiB, file_size_bytes=128 * MiB) is wait


@pytest.mark.asyncio
async def test_uploader_buffers_next_row_group_while_one_encodes(tmp_path: Path) -> None:
    """A file whose row group is being written (its lock held here) still takes the
    next bundles into its buffer: intake does not wait for the encoder."""
    async with open_test_tier(tmp_path, row_group_bytes=64 * MiB, file_size_bytes=1 << 40,
                              window_bundles=4096, file_duration_ms=3_600_000) as tier, \
            running(tier) as (acks, uploader, tx):
        await tx.send(delivery(1, 0, {0: rows(10)}))
        await eventually(lambda: bool(uploader.files.get(KEY, open_file()).parts))
        f = uploader.files[KEY]
        f.encoded_bytes, f.written_bytes = 1000, 100  # as after a first row group
        async with f.lock:  # "a row group is being encoded"
            for i in range(1, 5):
                await tx.send(delivery(1, i, {0: rows(10, 10 * i)}))
            await eventually(lambda: len(f.parts) == 5)
        uploader._start_rotation(f, "test")
        await acks.until(lambda o: len(o) == 5)
        assert sorted(acks.outcomes) == [(1, i, ackfmt.ACK) for i in range(5)]
        (file,) = await registered(tier)
        back = pq.read_table(uri_path(file.uri))
        assert back["v"].to_pylist() == list(range(50))
        assert back["_quiver_bundle"].to_pylist() == [i for i in range(5) for _ in range(10)]


def test_bundle_columns_do_not_import_pandas() -> None:
    """pa.array / fill_null import pandas on first use (~0.4 s of CPU in the first
    row group of a daemon's life); the uploader's bundle columns must not."""
    code = (
        "import sys, pyarrow as pa\n"
        "from quiverd.lake.bundles import slot_table\n"
        "t = pa.Table.from_arrays([pa.nulls(3, pa.int64())], names=['a'])\n"
        "t = slot_table(t, shard=3, segment_seq=2**63 - 5, bundle_index=7,\n"
        "               ingestion_ts_ns=1_700_000_000_123_456_789)\n"
        "t.validate(full=True)\n"
        "assert 'pandas' not in sys.modules, 'pandas imported'\n"
        "assert t.column('_quiver_segment')[2].as_py() == 2**63 - 5\n"
        "assert t.column('_quiver_shard').type == pa.int32()\n"
        "assert t.column('_quiver_bundle')[0].as_py() == 7\n"
        "assert t.column('_quiver_ingested_at').cast(pa.int64())[1].as_py() == "
        "1_700_000_000_123_456\n")  # microseconds
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_coverage_cache_keeps_registrations_and_evicts_oldest() -> None:
    cache = CoverageCache(limit=2)
    cache.put(0, 1, {})
    cache.put(0, 2, {0: {5}})
    assert cache.get(0, 1) == {}  # now the most recent
    cache.put(0, 3, {})
    assert cache.get(0, 2) is None and cache.get(0, 1) == {}
    cache.remember(0, 1, [(1, 4), (1, 6), (9, 0)])  # segment 9 not cached: ignored
    assert cache.get(0, 1) == {1: {4, 6}} and cache.get(0, 9) is None


def test_time_column_falls_back_to_ingestion_time() -> None:
    schema = pa.schema([("ts", pa.timestamp("us")), ("n", pa.int32()), ("s", pa.utf8()),
                        (INGESTED_AT, pa.timestamp("ns", tz="UTC"))])
    assert time_column_of(schema, "ts") == "ts"
    assert time_column_of(schema, "n") == "n"
    assert time_column_of(schema, "s") == INGESTED_AT
    assert time_column_of(schema, "absent") == INGESTED_AT
    assert time_column_of(schema, "") == INGESTED_AT


def _part(seg: int, idx: int, table: pa.Table) -> Part:
    return Part(table=table, segment_seq=seg, bundle_index=idx,
                ingestion_ts_ns=1_700_000_000_000_000_000 + 1000 * seg + idx)


def _part_by_part(parts: list[Part], schema: pa.Schema, shard: int) -> pa.Table:
    return pa.concat_tables(conform(slot_table(
        p.table, shard=shard, segment_seq=p.segment_seq, bundle_index=p.bundle_index,
        ingestion_ts_ns=p.ingestion_ts_ns), schema) for p in parts)


def _logs(n: int, start: int) -> pa.Table:
    level = pa.DictionaryArray.from_arrays(pa.array([i % 3 for i in range(n)], pa.int8()),
                                           pa.array(["INFO", "WARN", "ERROR"]))
    return pa.table({"v": pa.array(range(start, start + n), pa.int64()), "level": level})


@pytest.mark.parametrize("mixed", [False, True])
def test_row_group_equals_the_part_by_part_table(mixed: bool) -> None:
    """Parts of one schema take the joined path; a part of another schema (here a
    column the producer named _quiver_bundle, kept as sent) the part-by-part one."""
    parts = [_part(7, i, _logs(3 + i, 10 * i)) for i in range(5)]
    parts.append(_part(2**40, 0, _logs(1, 99)))
    if mixed:
        parts.append(_part(8, 0, _logs(2, 50).append_column(
            "_quiver_bundle", pa.array([42, 43], pa.uint32()))))
    schema = None
    for p in parts:
        schema = unify(schema, with_extras(p.table.schema))
    assert schema is not None
    got = row_group(parts, schema, shard=3)
    assert got.schema == schema
    assert got.equals(_part_by_part(parts, schema, 3))
    assert got["_quiver_segment"].to_pylist()[-3 if mixed else -1] == 2**40
    assert got["_quiver_shard"].to_pylist() == [3] * got.num_rows
