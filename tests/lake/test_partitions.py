"""Hour partitions (quiverd.lake.partitions): the partition column, the split by hour, the
Hive-style key directories, keys and file names of both layouts read back, and the
catalog's coverage per hour partition."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest
from ulid import ULID

from quiverd.lake.catalog import Catalog, DuplicateCoverage
from quiverd.lake.model import INGESTED_AT, Coverage, FileRow
from quiverd.lake.parquet import file_name, parse_file_name
from quiverd.lake.partitions import (
    DEFAULT_PARTITION,
    hour_dirs,
    hour_of_ns,
    is_node_key,
    key_partition,
    parse_object_key,
    partition_column,
    split_by_hour,
)

NULL_DIRS = f"date={DEFAULT_PARTITION}/hour={DEFAULT_PARTITION}"


def at(hour: int, minute: int = 0, *, year: int = 2024) -> datetime:
    return datetime(year, 6, 10, hour, minute, tzinfo=UTC)


def epoch_hour(when: datetime) -> int:
    return int(when.timestamp()) // 3600


@pytest.mark.parametrize(("schema", "wanted", "column"), [
    (pa.schema([("ts", pa.timestamp("ms", tz="UTC"))]), "ts", "ts"),
    (pa.schema([("ts", pa.timestamp("ns"))]), "ts", "ts"),  # tz-naive counts as UTC
    (pa.schema([("ts", pa.int64())]), "ts", INGESTED_AT),  # an integer time: ingestion
    (pa.schema([("v", pa.int64())]), "ts", INGESTED_AT),  # absent
    (pa.schema([("ts", pa.timestamp("us"))]), "", INGESTED_AT),  # no time column set
])
def test_partition_column_is_the_time_column_only_when_a_timestamp(
        schema: pa.Schema, wanted: str, column: str) -> None:
    assert partition_column(schema, wanted) == column


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_split_by_hour_three_hours_and_nulls_each_piece_within_one_hour(unit: str) -> None:
    times = [at(5, 59), None, at(6, 0), at(7, 30), at(6, 59), None, at(5, 1)]
    table = pa.table({"ts": pa.array(times, pa.timestamp(unit, tz="UTC")),
                      "i": range(len(times))})
    pieces = split_by_hour(table, "ts")
    assert [(h, p["i"].to_pylist()) for h, p in pieces] == [
        (epoch_hour(at(5)), [0, 6]), (epoch_hour(at(6)), [2, 4]),
        (epoch_hour(at(7)), [3]), (None, [1, 5])]  # order kept within an hour
    for hour, piece in pieces:
        values = piece["ts"].to_pylist()
        assert {None if v is None else epoch_hour(v) for v in values} == {hour}


def test_split_by_hour_one_hour_returns_the_table_itself() -> None:
    table = pa.table({"ts": pa.array([at(6, 1), at(6, 59)], pa.timestamp("us", tz="UTC"))})
    [(hour, piece)] = split_by_hour(table, "ts")
    assert hour == epoch_hour(at(6)) and piece is table


def test_split_by_hour_floors_times_before_1970_and_nulls_alone() -> None:
    before = datetime(1969, 12, 31, 23, 30, tzinfo=UTC)
    table = pa.table({"ts": pa.array([before, None], pa.timestamp("s", tz="UTC"))})
    assert [(h, len(p)) for h, p in split_by_hour(table, "ts")] == [(-1, 1), (None, 1)]
    only_nulls = pa.table({"ts": pa.array([None, None], pa.timestamp("ns"))})
    assert [(h, len(p)) for h, p in split_by_hour(only_nulls, "ts")] == [(None, 2)]


def test_split_by_hour_year_no_date_can_name_goes_to_the_null_partition() -> None:
    far = pa.array([10**17, 0], pa.timestamp("s", tz="UTC"))  # year ~3e9, and 1970
    assert [(h, len(p)) for h, p in split_by_hour(pa.table({"ts": far}), "ts")] == [
        (0, 1), (None, 1)]


def test_hour_dirs_are_hive_style_and_round_trip_through_a_key() -> None:
    hour = hour_of_ns(int(at(6, 13).timestamp()) * 10**9)
    assert hour_dirs(hour) == "date=2024-06-10/hour=06"
    assert hour_dirs(None) == NULL_DIRS
    name = file_name("node_1", 1_718_000_000_123_456_789, str(ULID()), "stable")
    for h in (hour, None):
        key = f"client=web/slot=2/{hour_dirs(h)}/{name}"
        parsed = parse_object_key(key)
        assert parsed is not None
        assert (parsed.client, parsed.slot, parsed.partitioned, parsed.hour, parsed.node_id) \
            == ("web", 2, True, h, "node_1")
        assert key_partition(key) == hour_dirs(h)


def test_old_layout_keys_and_names_still_read_as_this_nodes() -> None:
    old_name = "my_client_20240610T061320123456789Z_01J0000000000000000000000X_stable.parquet"
    parsed_name = parse_file_name(old_name)
    assert parsed_name is not None and parsed_name.client == "my_client"
    assert parsed_name.node_id is None and parsed_name.ulid == "01J0000000000000000000000X"
    old_key = f"client=my_client/slot=0/n1/{old_name}"
    parsed = parse_object_key(old_key)
    assert parsed is not None and not parsed.partitioned and parsed.node_id == "n1"
    assert is_node_key(old_key, "n1") and not is_node_key(old_key, "n2")
    assert key_partition(old_key) == ""  # an old file holds whole slots


def test_node_key_reads_the_file_name_not_a_directory() -> None:
    name = file_name("n_2", 1, str(ULID()), "stable")
    key = f"client=app/slot=0/{hour_dirs(0)}/{name}"
    assert is_node_key(key, "n_2") and not is_node_key(key, "n") and not is_node_key(key, "2")
    for other in ("quarantine/" + key, "client=app/slot=x/n1/a", f"client=app/slot=0/{name}",
                  "client=app/slot=0/date=2024-13-01/hour=00/" + name,
                  "client=app/slot=0/hour=00/date=2024-01-01/" + name):
        assert parse_object_key(other) is None or not is_node_key(other, "n_2"), other


def test_file_name_grammars_cannot_be_confused() -> None:
    """A client name built to look like a new name still parses as an old one: only new
    names hold '~', which neither a client name nor a node id may."""
    ulid = "01J0000000000000000000000X"
    tricky_client = f"20240610T061320123456789Z_{ulid}"
    old = f"{tricky_client}_20240610T061320123456789Z_{ulid}_stable.parquet"
    parsed = parse_file_name(old)
    assert parsed is not None and parsed.client == tricky_client and parsed.node_id is None
    new = file_name("a_b", 0, ulid, "active")
    assert new == f"19700101T000000000000000Z_{ulid}~a_b_active.parquet"
    assert parse_file_name(new) == ("19700101T000000000000000Z", ulid, "active", "a_b", None)
    with pytest.raises(ValueError):
        file_name("a~b", 0, ulid, "active")


# ---- coverage per hour partition ------------------------------------------------------

SOURCE = str(ULID())


def piece(tier_source: str, hour: int | None, key_prefix: str = "") -> FileRow:
    file_id = str(ULID())
    name = file_name("n1", 0, file_id, "stable")
    key = key_prefix + name if key_prefix else f"client=app/slot=0/{hour_dirs(hour)}/{name}"
    return FileRow(file_id=file_id, client_name="app", source_id=tier_source, shard=0, slot=0,
                   node_id="n1", object_key=key)


@pytest.mark.asyncio
async def test_catalog_coverage_one_file_per_hour_of_a_bundle_slot(catalog: Catalog) -> None:
    """On SQLite and PostgreSQL (the ``catalog`` fixture)."""
    cov = [Coverage(segment_seq=3, bundle_indexes=(0, 1))]
    five, six = epoch_hour(at(5)), epoch_hour(at(6))
    for hour in (five, six, None):  # one bundle's slot split over three files
        assert await catalog.register(piece(SOURCE, hour), cov)
    with pytest.raises(DuplicateCoverage):  # the same hour twice
        await catalog.register(piece(SOURCE, six), cov)
    with pytest.raises(DuplicateCoverage):  # an old-layout file holds the whole slot
        await catalog.register(piece(SOURCE, None, key_prefix="client=app/slot=0/n1/"), cov)
    parts = await catalog.covered_parts(SOURCE, 0, 3)
    assert parts == {(0, hour_dirs(five)): {0, 1}, (0, hour_dirs(six)): {0, 1},
                     (0, NULL_DIRS): {0, 1}}
    assert await catalog.covered(SOURCE, 0, 3) == {0: {0, 1}}
