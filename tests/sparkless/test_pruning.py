"""quiverd.spark.pruning without Spark: filters as Bounds (by the Arrow type Spark reads
each column as), files kept by the catalog's time range and their zone maps, and row
groups kept by the footer statistics of real Parquet files."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.lake.model import INGESTED_AT, FileRow, ZoneMap
from quiverd.spark.pruning import Bound, datetime_ns, may_match, row_groups, to_bound

V = datetime(2025, 1, 1, tzinfo=UTC)
V_NS = 1_735_689_600 * 10**9
# The Arrow types Spark reads columns as (to_arrow_type of the reader's schema).
TYPES: dict[str, pa.DataType] = {
    INGESTED_AT: pa.timestamp("us", "UTC"), "ntz": pa.timestamp("us"), "d": pa.date32(),
    "n": pa.int64(), "i8": pa.int8(), "i16": pa.int16(), "i32": pa.int32(),
    "f32": pa.float32(), "x": pa.float64(), "s": pa.string(), "flag": pa.bool_(),
    "dec": pa.decimal128(10, 2), "bin": pa.binary(), "tm": pa.time64("us"),
    "dur": pa.duration("us"), "arr": pa.list_(pa.int64()), "st": pa.struct([("a", pa.int64())]),
}


def spark_filter(name: str, column: str | tuple[str, ...], value: Any) -> Any:
    """An object shaped as Spark's filter ``name`` (to_bound reads its class name)."""
    attribute = column if isinstance(column, tuple) else (column,)
    return type(name, (), {"attribute": attribute, "value": value})()


def values(op: str, column: str, value: Any) -> tuple[tuple[Any, Any], ...] | None:
    bound = to_bound(spark_filter(op, column, value), TYPES)
    return None if bound is None else bound.values


# ---- to_bound -----------------------------------------------------------------------------

def test_to_bound_timestamp_literal_is_every_ns_that_truncates_to_it() -> None:
    assert values("EqualTo", INGESTED_AT, V) == ((V_NS, V_NS + 999),)
    assert values("EqualTo", "ntz", V.replace(tzinfo=None)) == ((V_NS, V_NS + 999),)  # UTC
    plus_one = datetime(2025, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    assert values("LessThan", INGESTED_AT, plus_one) == ((V_NS, V_NS + 999),)
    assert values("EqualTo", INGESTED_AT, V + timedelta(microseconds=7)) == \
        ((V_NS + 7_000, V_NS + 7_999),)
    # At the epoch, both ways: -999 ns truncates toward zero to 0 as well as +999.
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert values("EqualTo", INGESTED_AT, epoch) == ((-999, 999),)
    # Below it, [v - 999, v]: -1 µs holds -1999 .. -1000 ns.
    assert values("EqualTo", INGESTED_AT, epoch - timedelta(microseconds=1)) == \
        ((-1_999, -1_000),)
    assert values("EqualTo", INGESTED_AT, 5) is None  # not a datetime
    assert values("EqualTo", INGESTED_AT, date(2025, 1, 1)) is None


def test_to_bound_dates_are_days_since_the_epoch() -> None:
    assert values("EqualTo", "d", date(1970, 1, 2)) == ((1, 1),)
    assert values("GreaterThan", "d", date(1969, 12, 31)) == ((-1, -1),)
    assert values("EqualTo", "d", date(2025, 1, 1)) == ((20_089, 20_089),)
    assert values("EqualTo", "d", V) is None  # a datetime is not a date here
    assert values("EqualTo", "d", "2025-01-01") is None


def test_to_bound_numbers_strings_booleans_and_what_they_refuse() -> None:
    for column in ("n", "i8", "i16", "i32", "f32", "x"):
        assert values("EqualTo", column, 3) == ((3, 3),), column
        assert values("EqualTo", column, 2.5) == ((2.5, 2.5),), column
        assert values("EqualTo", column, True) is None, column  # bool is an int in Python
        assert values("EqualTo", column, float("nan")) is None, column  # NaN compares false
        assert values("EqualTo", column, "3") is None, column
    assert values("EqualTo", "s", "web") == (("web", "web"),)
    assert values("EqualTo", "s", 1) is None
    assert values("EqualTo", "flag", False) == ((False, False),)
    assert values("EqualTo", "flag", 0) is None


def test_to_bound_none_for_columns_types_and_filters_it_cannot_prune() -> None:
    for column in ("dec", "bin", "tm", "dur", "arr", "st"):
        assert values("EqualTo", column, 1) is None, column
    assert values("EqualTo", "unknown", 1) is None  # not a column of the schema
    assert to_bound(spark_filter("EqualTo", ("st", "a"), 1), TYPES) is None  # nested field
    assert to_bound(spark_filter("EqualTo", ("n", "a"), 1), TYPES) is None  # never "n" itself
    for op in ("StringContains", "StringStartsWith", "Not", "IsNull", "IsNotNull",
               "EqualNullSafe"):
        assert values(op, "n", 1) is None, op


def test_to_bound_in_keeps_each_literal_and_refuses_if_one_cannot_prune() -> None:
    bound = to_bound(spark_filter("In", "n", (1, 15, 7.5)), TYPES)
    assert bound == Bound(column="n", op="In", values=((1, 1), (15, 15), (7.5, 7.5)))
    assert values("In", INGESTED_AT, (V, V + timedelta(microseconds=1))) == \
        ((V_NS, V_NS + 999), (V_NS + 1_000, V_NS + 1_999))
    assert values("In", "n", (1, "x")) is None  # one literal of another kind: no bound
    assert values("In", "n", ()) is None  # IN (): nothing to compare with
    for op in ("GreaterThan", "GreaterThanOrEqual", "LessThan", "LessThanOrEqual"):
        assert to_bound(spark_filter(op, "n", 4), TYPES) == Bound(column="n", op=op,
                                                                  values=((4, 4),))


# ---- may_match: the catalog's time range and the zone maps --------------------------------

ROW = FileRow(file_id="f", client_name="c", start_ts=V_NS + 500, end_ts=V_NS + 500)
ZONE = ZoneMap(column="n", min_value=10, max_value=20, null_count=0)


def keeps(op: str, value: Any, column: str = INGESTED_AT, maps: tuple[ZoneMap, ...] = (),
          row: FileRow = ROW) -> bool:
    bound = to_bound(spark_filter(op, column, value), TYPES)
    assert bound is not None
    return may_match(row, list(maps), [bound], INGESTED_AT)


def test_may_match_time_column_by_the_catalogs_range_at_microsecond_truncation() -> None:
    # Rows stored at v + 500 ns read as v in Spark: they pass "= v", "<= v", ">= v".
    assert keeps("EqualTo", V) and keeps("LessThanOrEqual", V) and keeps("GreaterThanOrEqual", V)
    assert not keeps("GreaterThan", V) and not keeps("LessThan", V)
    assert not keeps("EqualTo", V + timedelta(microseconds=1))
    assert not keeps("EqualTo", V - timedelta(microseconds=1))
    wide = FileRow(file_id="w", client_name="c", start_ts=V_NS, end_ts=V_NS + 10**9)
    assert keeps("GreaterThan", V + timedelta(milliseconds=999), row=wide)
    assert not keeps("GreaterThan", V + timedelta(seconds=1), row=wide)
    assert keeps("LessThan", V + timedelta(microseconds=1), row=wide)
    assert keeps("In", (V - timedelta(days=1), V + timedelta(seconds=1)), row=wide)
    assert not keeps("In", (V - timedelta(days=1), V + timedelta(days=1)), row=wide)


def test_may_match_zone_maps_kept_where_a_row_may_pass() -> None:
    assert keeps("EqualTo", 10, "n", (ZONE,)) and keeps("EqualTo", 20, "n", (ZONE,))
    assert not keeps("EqualTo", 9, "n", (ZONE,)) and not keeps("EqualTo", 21, "n", (ZONE,))
    assert keeps("In", (1, 15), "n", (ZONE,)) and not keeps("In", (1, 25), "n", (ZONE,))
    assert keeps("GreaterThan", 19, "n", (ZONE,)) and not keeps("GreaterThan", 20, "n", (ZONE,))
    assert keeps("GreaterThanOrEqual", 20, "n", (ZONE,))
    assert not keeps("GreaterThanOrEqual", 21, "n", (ZONE,))
    assert keeps("LessThan", 11, "n", (ZONE,)) and not keeps("LessThan", 10, "n", (ZONE,))
    assert keeps("LessThanOrEqual", 10, "n", (ZONE,))
    assert not keeps("LessThanOrEqual", 9, "n", (ZONE,))
    words = ZoneMap(column="s", min_value="b", max_value="d", null_count=1)
    assert keeps("EqualTo", "c", "s", (words,)) and not keeps("EqualTo", "e", "s", (words,))
    assert keeps("LessThan", "bz", "s", (words,)) and not keeps("LessThan", "b", "s", (words,))
    days = ZoneMap(column="d", min_value=20_089, max_value=20_089, null_count=0)
    assert keeps("EqualTo", date(2025, 1, 1), "d", (days,))
    assert not keeps("EqualTo", date(2025, 1, 2), "d", (days,))
    # Another column's zone map says nothing about this one.
    assert keeps("EqualTo", 99, "n", (ZoneMap(column="x", min_value=0, max_value=1,
                                                null_count=0),))


def test_may_match_without_zone_map_kept_all_null_skipped_other_kind_kept() -> None:
    assert keeps("EqualTo", 99, "n")  # no zone map: kept
    all_null = ZoneMap(column="n", min_value=None, max_value=None, null_count=3)
    assert not keeps("EqualTo", 1, "n", (all_null,))  # no comparison is true on nulls
    assert not keeps("GreaterThan", 1, "n", (all_null,))
    # A zone map of another kind (the column changed type): the comparison cannot be made.
    assert may_match(ROW, [ZONE], [Bound(column="n", op="EqualTo", values=(("x", "x"),))],
                     INGESTED_AT)


def test_may_match_every_bound_must_pass() -> None:
    on_n = to_bound(spark_filter("EqualTo", "n", 15), TYPES)
    off_time = to_bound(spark_filter("GreaterThan", INGESTED_AT, V), TYPES)
    on_time = to_bound(spark_filter("EqualTo", INGESTED_AT, V), TYPES)
    assert on_n is not None and off_time is not None and on_time is not None
    assert may_match(ROW, [ZONE], [on_n, on_time], INGESTED_AT)
    assert not may_match(ROW, [ZONE], [on_n, off_time], INGESTED_AT)
    assert not may_match(ROW, [ZONE], [off_time, on_n], INGESTED_AT)
    assert may_match(ROW, [ZONE], [], INGESTED_AT)
    # Another time column: the catalog's range is not the column's, the zone map is.
    assert may_match(ROW, [], [off_time], "ts")


# ---- row_groups: footer statistics of a real file --------------------------------------------

GROUP_ROWS = 4


def _lake_file(tmp_path: Path, **write: Any) -> pq.ParquetFile:
    """Four row groups of four rows: group g holds n = 10g .. 10g + 3, times V + g s ..."""
    rows = 4 * GROUP_ROWS
    g = [i // GROUP_ROWS for i in range(rows)]
    table = pa.table({
        # Nested columns first: the compared columns' leaf indexes are past their leaves.
        "st": pa.array([{"a": 1000 + i, "b": "z"} for i in range(rows)]),
        "arr": pa.array([[i, 2000 + i] for i in range(rows)], pa.list_(pa.int64())),
        "mp": pa.array([[("k", i)] for i in range(rows)], pa.map_(pa.string(), pa.int64())),
        INGESTED_AT: pa.array([V_NS + g[i] * 10**9 + i for i in range(rows)],
                              pa.timestamp("ns", "UTC")),
        "ms": pa.array([V_NS // 10**6 + g[i] * 1000 for i in range(rows)],
                       pa.timestamp("ms", "UTC")),
        "us": pa.array([V_NS // 1000 + g[i] * 10**6 for i in range(rows)], pa.timestamp("us")),
        "n": pa.array([10 * g[i] + i % GROUP_ROWS for i in range(rows)], pa.int64()),
        "x": pa.array([g[i] + 0.5 for i in range(rows)]),
        "d": pa.array([date(2025, 1, 1 + g[i]) for i in range(rows)], pa.date32()),
        "s": pa.array([f"{'abcd'[g[i]]}{i}" for i in range(rows)]),
        "big": pa.array([f"{'abcd'[g[i]]}" for i in range(rows)], pa.large_string()),
        "word": pa.array(["abcd"[g[i]] for i in range(rows)]).dictionary_encode(),
        "flag": pa.array([g[i] == 2 for i in range(rows)]),
        "half": pa.array([None if g[i] == 1 else g[i] for i in range(rows)], pa.int32()),
        "u": pa.array([g[i] for i in range(rows)], pa.uint8()),
        "dec": pa.array([Decimal(g[i]) for i in range(rows)], pa.decimal128(10, 2)),
    })
    path = tmp_path / "f.parquet"
    pq.write_table(table, path, row_group_size=GROUP_ROWS, **write)
    return pq.ParquetFile(path)


def groups(pf: pq.ParquetFile, op: str, column: str, value: Any, *, since: int | None = None,
           until: int | None = None, time_column: str = INGESTED_AT) -> list[int]:
    types = {**TYPES, "ms": pa.timestamp("us", "UTC"), "us": pa.timestamp("us"),
             "big": pa.string(), "word": pa.string(), "half": pa.int32(), "u": pa.int16()}
    bound = to_bound(spark_filter(op, column, value), types)
    assert bound is not None, (op, column, value)
    return row_groups(pf.metadata, pf.schema_arrow, [bound], time_column, since, until)


def test_row_groups_kept_by_each_columns_statistics(tmp_path: Path) -> None:
    pf = _lake_file(tmp_path)
    assert pf.metadata.num_row_groups == 4
    assert groups(pf, "EqualTo", "n", 21) == [2]
    assert groups(pf, "EqualTo", "n", 24) == []  # between groups 2 and 3
    assert groups(pf, "In", "n", (1, 33, 99)) == [0, 3]
    assert groups(pf, "GreaterThan", "n", 13) == [2, 3]
    assert groups(pf, "LessThanOrEqual", "n", 10) == [0, 1]
    assert groups(pf, "LessThan", "x", 1.5) == [0]
    assert groups(pf, "EqualTo", "d", date(2025, 1, 3)) == [2]
    assert groups(pf, "EqualTo", "s", "b5") == [1]  # strings by code point: "b4".."b7"
    assert groups(pf, "GreaterThanOrEqual", "s", "c") == [2, 3]
    assert groups(pf, "EqualTo", "big", "d") == [3]  # large_string
    assert groups(pf, "EqualTo", "word", "c") == [2]  # dictionary: its values' statistics
    assert groups(pf, "EqualTo", "flag", True) == [2]
    assert groups(pf, "EqualTo", "u", 3) == [3]  # uint8, read by Spark as smallint


def test_row_groups_timestamps_in_ns_whatever_the_stored_unit(tmp_path: Path) -> None:
    pf = _lake_file(tmp_path)
    second = V + timedelta(seconds=1)
    for column in (INGESTED_AT, "ms", "us"):
        assert groups(pf, "EqualTo", column, second) == [1], column
        assert groups(pf, "GreaterThanOrEqual", column, second + timedelta(seconds=1)) == \
            [2, 3], column
    # The ns column's group 1 spans V + 1 s + 4 ns .. + 7 ns: one µs literal covers it.
    assert groups(pf, "LessThan", INGESTED_AT, second + timedelta(microseconds=1)) == [0, 1]
    assert groups(pf, "LessThan", "us", second) == [0]


def test_row_groups_since_until_on_the_time_column(tmp_path: Path) -> None:
    pf = _lake_file(tmp_path)
    group_1 = (V_NS + 10**9 + 4, V_NS + 10**9 + 7)  # its min and max, ns
    every = to_bound(spark_filter("GreaterThan", "n", -1), TYPES)
    assert every is not None

    def ranged(since: int | None, until: int | None, time_column: str = INGESTED_AT
               ) -> list[int]:
        return row_groups(pf.metadata, pf.schema_arrow, [every], time_column, since, until)

    assert ranged(None, None) == [0, 1, 2, 3]
    assert ranged(group_1[0], group_1[1] + 1) == [1]
    assert ranged(group_1[1], None) == [1, 2, 3]  # since == its max: kept
    assert ranged(group_1[1] + 1, None) == [2, 3]
    assert ranged(None, group_1[0]) == [0]  # until is exclusive: its min == until is out
    assert ranged(None, group_1[0] + 1) == [0, 1]
    assert ranged(V_NS + 10 * 10**9, None) == []
    # The range with no bound at all, and on another time column ("ms": whole seconds).
    assert row_groups(pf.metadata, pf.schema_arrow, [], INGESTED_AT, group_1[0],
                      group_1[1] + 1) == [1]
    assert ranged(V_NS + 2 * 10**9, V_NS + 3 * 10**9, "ms") == [2]
    assert ranged(V_NS + 2 * 10**9, None, "nowhere") == [0, 1, 2, 3]  # no such column


def test_row_groups_nested_nulls_and_unknown_types_keep_every_group(tmp_path: Path) -> None:
    pf = _lake_file(tmp_path)
    # All null in group 1: no min/max there, so it is kept; the others compare.
    assert groups(pf, "EqualTo", "half", 3) == [1, 3]
    assert groups(pf, "EqualTo", "half", 1) == [1]
    # Nested columns are not compared; decimals are no Bound at all, so none to compare.
    st_bound = Bound(column="st", op="EqualTo", values=((0, 0),))
    arr_bound = Bound(column="arr", op="EqualTo", values=((0, 0),))
    for bound in (st_bound, arr_bound, Bound(column="mp", op="EqualTo", values=((0, 0),))):
        assert row_groups(pf.metadata, pf.schema_arrow, [bound], INGESTED_AT, None, None) \
            == [0, 1, 2, 3]
    dec = Bound(column="dec", op="EqualTo", values=((99, 99),))
    assert row_groups(pf.metadata, pf.schema_arrow, [dec], INGESTED_AT, None, None) == \
        [0, 1, 2, 3]
    # Values of another kind than the statistics' (the column changed type): kept.
    other = Bound(column="n", op="EqualTo", values=(("x", "x"),))
    assert row_groups(pf.metadata, pf.schema_arrow, [other], INGESTED_AT, None, None) == \
        [0, 1, 2, 3]
    # An unknown column: no statistics to compare, every group.
    missing = Bound(column="gone", op="EqualTo", values=((1, 1),))
    assert row_groups(pf.metadata, pf.schema_arrow, [missing], INGESTED_AT, None, None) == \
        [0, 1, 2, 3]


def test_row_groups_every_bound_must_pass_and_files_without_statistics_keep_all(
        tmp_path: Path) -> None:
    pf = _lake_file(tmp_path)
    a = to_bound(spark_filter("GreaterThanOrEqual", "n", 10), TYPES)
    b = to_bound(spark_filter("EqualTo", "s", "c9"), TYPES)
    assert a is not None and b is not None
    assert row_groups(pf.metadata, pf.schema_arrow, [a, b], INGESTED_AT, None, None) == [2]
    assert row_groups(pf.metadata, pf.schema_arrow, [a, b], INGESTED_AT, None,
                      V_NS + 2 * 10**9) == []
    bare = _lake_file(tmp_path, write_statistics=False)
    assert groups(bare, "EqualTo", "n", 21) == [0, 1, 2, 3]
    assert row_groups(bare.metadata, bare.schema_arrow, [], INGESTED_AT, V_NS + 10 * 10**9,
                      None) == [0, 1, 2, 3]


# ---- helpers ------------------------------------------------------------------------------

def test_datetime_ns_naive_is_utc_and_microseconds_exact(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # Naive is UTC whatever the machine's zone (not local time: Spark's TimestampNTZ).
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert datetime_ns(datetime(1970, 1, 1, 9)) == 9 * 3600 * 10**9
    finally:
        monkeypatch.undo()
        time.tzset()
    assert datetime_ns(V) == V_NS == datetime_ns(V.replace(tzinfo=None))
    assert datetime_ns(datetime(1970, 1, 1)) == 0
    assert datetime_ns(datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)) == -1_000
    assert datetime_ns(datetime(1900, 1, 1, tzinfo=UTC)) == -2_208_988_800 * 10**9
    assert datetime_ns(datetime(2262, 4, 11, 23, 47, 16, 854_775, tzinfo=UTC)) == \
        2**63 - 1 - 807  # the last µs an int64 ns holds; float seconds would round it
    tokyo = timezone(timedelta(hours=9))
    assert datetime_ns(datetime(2025, 1, 1, 9, tzinfo=tokyo)) == V_NS


@pytest.mark.parametrize(("op", "value", "kept"), [
    ("EqualTo", 5, True), ("EqualTo", 11, False), ("GreaterThan", 9, True),
    ("GreaterThan", 10, False), ("LessThan", 6, True), ("LessThan", 5, False),
])
def test_may_match_edges_of_one_zone_map(op: str, value: int, kept: bool) -> None:
    zone = ZoneMap(column="n", min_value=5, max_value=10, null_count=0)
    assert keeps(op, value, "n", (zone,)) is kept
