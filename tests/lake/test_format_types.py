"""The lake file format of issue 20: quiverd's columns as types every engine reads
(timestamp[us, UTC], signed ids), a producer's ns columns cast to us where no value
changes, and files of the old format still read and compacted next to new ones.

Files are written by the real uploader (in process, fs store, SQLite catalog) or, for
the old format, by hand as the old uploader wrote them (tests/lake/legacy_files.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.acks import format as ackfmt
from quiverd.lake.bundles import (
    EXTRA_FIELDS,
    MAX_SEGMENT_SEQ,
    as_current,
    slot_table,
    with_bundle_columns,
)
from quiverd.lake.compaction import compact
from quiverd.lake.drift import _micros_targets, has_ns_timestamps, micros_where_lossless
from quiverd.lake.model import (
    BUNDLE_COLUMN,
    INGESTED_AT,
    REGISTERED,
    SEGMENT_COLUMN,
    SHARD_COLUMN,
    FileRow,
    FileState,
)
from quiverd.lake.tier import Tier
from tests.actors.test_uploader import ROTATE_EACH, delivery, registered, rows, running
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import LOG, add_file, open_test_tier
from tests.lake.legacy_files import LEGACY_FIELDS, add_legacy_file, legacy_table

NEW_TYPES = {f.name: f.type for f in EXTRA_FIELDS}
TS_NS = 1_700_000_000_000_000_000  # delivery()'s ingestion time of bundle 0


def _ns(values: list[int | None], tz: str | None = "UTC") -> pa.Array:
    return pa.array(values, pa.timestamp("ns", tz=tz))


def _schema_of(row: FileRow) -> pa.Schema:
    return pq.read_schema(uri_path(row.uri))


# ---- quiverd's columns -----------------------------------------------------------------

@pytest.mark.asyncio
async def test_uploader_writes_signed_ids_and_microsecond_ingestion_time(tmp_path: Path
                                                                         ) -> None:
    async with open_test_tier(tmp_path, **ROTATE_EACH) as tier, \
            running(tier) as (acks, _, tx):
        await tx.send(delivery(2**40, 7, {0: rows(3)}))
        await acks.until(lambda o: len(o) == 1)
        [f] = await registered(tier)
        table = pq.read_table(uri_path(f.uri))
    assert {n: table.schema.field(n).type for n in NEW_TYPES} == NEW_TYPES
    assert table[INGESTED_AT].cast(pa.int64()).to_pylist() == [(TS_NS + 7) // 1000] * 3
    assert table[SEGMENT_COLUMN].to_pylist() == [2**40] * 3
    assert table[BUNDLE_COLUMN].to_pylist() == [7] * 3
    assert table[SHARD_COLUMN].to_pylist() == [0] * 3
    # The catalog's time range stays integer ns: the file's µs, times 1000.
    assert (f.start_ts, f.end_ts) == ((TS_NS + 7) // 1000 * 1000,) * 2
    assert not has_ns_timestamps(table.schema)


def test_bundle_columns_refuse_a_segment_seq_past_int64() -> None:
    t = pa.table({"v": [1, 2]})
    ok = slot_table(t, shard=1, segment_seq=MAX_SEGMENT_SEQ, bundle_index=2**32 - 1,
                    ingestion_ts_ns=TS_NS)
    assert ok[SEGMENT_COLUMN].to_pylist() == [2**63 - 1] * 2
    assert ok[BUNDLE_COLUMN].to_pylist() == [2**32 - 1] * 2  # the full uint32 range
    with pytest.raises(ValueError, match="does not fit the lake's int64"):
        slot_table(t, shard=1, segment_seq=2**63, bundle_index=0, ingestion_ts_ns=TS_NS)
    with pytest.raises(ValueError, match="segment seq 9223372036854775808"):
        with_bundle_columns(t, [1, 1], shard=1, segment_seqs=[5, 2**63],
                            bundle_indexes=[0, 1], ingestion_ts_ns=[TS_NS, TS_NS])


# ---- a producer's ns columns -----------------------------------------------------------

def test_micros_where_lossless_casts_exact_columns_nested_too_keeping_the_zone() -> None:
    nested = pa.array([{"at": 2_000, "seen": [3_000, None]}, None],
                      pa.struct([("at", pa.timestamp("ns", "Europe/Paris")),
                                 ("seen", pa.list_(pa.timestamp("ns")))]))
    table = pa.table({"t": _ns([1_000, None]), "local": _ns([5_000, 6_000], tz=None),
                      "lossy": _ns([1_000, 1_001]), "n": [1, 2], "nested": nested,
                      "ms": pa.array([1, 2], pa.timestamp("ms"))})
    out = micros_where_lossless(table)
    assert out.schema.field("t").type == pa.timestamp("us", "UTC")
    assert out.schema.field("local").type == pa.timestamp("us")
    assert out.schema.field("lossy").type == pa.timestamp("ns", "UTC")  # 1_001: as sent
    assert out.schema.field("ms").type == pa.timestamp("ms")  # not ns: untouched
    assert out.schema.field("nested").type == pa.struct([
        ("at", pa.timestamp("us", "Europe/Paris")), ("seen", pa.list_(pa.timestamp("us")))])
    assert out["t"].cast(pa.int64()).to_pylist() == [1, None]
    assert out["nested"].to_pylist()[1] is None
    assert out["lossy"].equals(table["lossy"])
    assert has_ns_timestamps(out.schema) and not has_ns_timestamps(out.drop(["lossy"]).schema)


def test_micros_where_lossless_decides_columns_once_per_schema() -> None:
    plain = pa.table({"n": [1]})
    assert micros_where_lossless(plain) is plain  # no ns column: the table itself
    table = pa.table({"t": _ns([4_000])})
    micros_where_lossless(table)
    hits = _micros_targets.cache_info().hits
    again = micros_where_lossless(pa.table({"t": _ns([8_000, 9_000])}))
    assert _micros_targets.cache_info().hits == hits + 1
    assert again.schema.field("t").type == pa.timestamp("us", "UTC")


@pytest.mark.asyncio
async def test_uploader_stores_exact_ns_as_us_and_keeps_lossy_ns(tmp_path: Path) -> None:
    async with open_test_tier(tmp_path, **ROTATE_EACH) as tier, \
            running(tier) as (acks, _, tx):
        await tx.send(delivery(1, 0, {0: pa.table({"t": _ns([TS_NS, None])})}))
        await tx.send(delivery(1, 1, {0: pa.table({"t": _ns([TS_NS + 1])})}, client="b"))
        await acks.until(lambda o: len(o) == 2)
        files = {f.client_name: f for f in await registered(tier)}
    exact, lossy = pq.read_table(uri_path(files["app"].uri)), \
        pq.read_table(uri_path(files["b"].uri))
    assert exact.schema.field("t").type == pa.timestamp("us", "UTC")
    assert exact["t"].cast(pa.int64()).to_pylist() == [TS_NS // 1000, None]
    assert lossy.schema.field("t").type == pa.timestamp("ns", "UTC")
    assert lossy["t"].cast(pa.int64()).to_pylist() == [TS_NS + 1]  # every ns kept
    assert has_ns_timestamps(lossy.schema) and not has_ns_timestamps(exact.schema)


@pytest.mark.asyncio
async def test_uploader_rotates_a_us_file_when_a_lossy_ns_bundle_follows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that took the column as us and has its first row group written (its
    schema frozen) cannot take ns values: the bundle starts a new file."""
    settings = {"row_group_bytes": 1, "file_size_bytes": 1 << 30, "window_bundles": 4,
                "file_duration_ms": 3_600_000}
    async with open_test_tier(tmp_path, **settings) as tier:
        appended = _on_state(tier, FileState.APPENDED, monkeypatch)
        async with running(tier) as (acks, _, tx):
            await tx.send(delivery(1, 0, {0: pa.table({"t": _ns([5_000])})}))
            with anyio.fail_after(20):
                await appended.wait()  # the first row group is written: schema frozen
            await tx.send(delivery(1, 1, {0: pa.table({"t": _ns([6_001])})}))
            await tx.send(delivery(1, 2, {0: pa.table({"t": _ns([7_000])})}))
            await acks.until(lambda o: len(o) == 3)
            files = sorted(await registered(tier), key=lambda f: f.first_bundle)
    assert sorted(acks.outcomes) == [(1, i, ackfmt.ACK) for i in range(3)]
    assert [(f.first_bundle, f.last_bundle) for f in files] == [(0, 0), (1, 2)]
    first, second = (pq.read_table(uri_path(f.uri)) for f in files)
    assert first.schema.field("t").type == pa.timestamp("us", "UTC")
    assert second.schema.field("t").type == pa.timestamp("ns", "UTC")  # us taken as ns
    assert second["t"].cast(pa.int64()).to_pylist() == [6_001, 7_000]


def _on_state(tier: Tier, state: FileState, monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """An event set once the catalog has moved a file to ``state``."""
    reached, real = anyio.Event(), tier.catalog.set_state

    async def set_state(file_id: str, to: FileState, **fields: Any) -> None:
        await real(file_id, to, **fields)
        if to == state:
            reached.set()

    monkeypatch.setattr(tier.catalog, "set_state", set_state)
    return reached


# ---- files of the old format -----------------------------------------------------------

def test_as_current_presents_old_files_in_the_new_types() -> None:
    old = legacy_table(pa.table({"v": [1, 2]}), ts_ns=TS_NS + 1_999, segment=2**63 - 1,
                       bundle=2**32 - 1, shard=65_535)
    assert [old.schema.field(f.name).type for f in LEGACY_FIELDS] == \
        [f.type for f in LEGACY_FIELDS]
    assert as_current(old.schema) == pa.schema([pa.field("v", pa.int64()), *EXTRA_FIELDS])
    new = old.cast(as_current(old.schema), safe=False)  # what the reader's cast does
    assert new.to_pylist()[0] == {"v": 1, INGESTED_AT: new[INGESTED_AT][0].as_py(),
                                  SHARD_COLUMN: 65_535, SEGMENT_COLUMN: 2**63 - 1,
                                  BUNDLE_COLUMN: 2**32 - 1}
    assert new[INGESTED_AT].cast(pa.int64()).to_pylist() == [TS_NS // 1000 + 1] * 2
    # A producer column of a reserved name and another type (a bundle from before the
    # rule) is left as sent.
    odd = pa.schema([pa.field(BUNDLE_COLUMN, pa.string())])
    assert as_current(odd) == odd


@pytest.mark.asyncio
async def test_compaction_leaves_old_files_and_merges_new_ones(tmp_path: Path) -> None:
    """Old-layout files (no hour in their key) are never compaction inputs: an output
    must sit in one hour partition, and an old file's hours are unknown. New files of
    the same hour merge, in the new types."""
    async with open_test_tier(tmp_path / "d") as tier:
        old = await add_legacy_file(tier, pa.table({"v": [1, 2]}), segment=1,
                                    ts_ns=TS_NS + 1_999)
        a = await add_file(tier, pa.table({"v": [3]}), segment=2, ts_ns=TS_NS + 5_000)
        b = await add_file(tier, pa.table({"v": [4]}), segment=3, ts_ns=TS_NS + 6_000)
        [result] = await compact(tier, limiter=anyio.CapacityLimiter(2), log=LOG)
        assert result.outcome == "compacted" and result.inputs == [a.file_id, b.file_id]
        out = await tier.catalog.get(result.output)
        assert out is not None and out.state in REGISTERED
        kept = await tier.catalog.get(old.file_id)
        assert kept is not None and kept.state in REGISTERED
        table = pq.read_table(uri_path(out.uri))
    assert {n: table.schema.field(n).type for n in NEW_TYPES} == NEW_TYPES
    assert table["v"].to_pylist() == [3, 4]
    assert table[SEGMENT_COLUMN].to_pylist() == [2, 3]
