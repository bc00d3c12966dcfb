"""quiverd.spark.types without Spark: the lake's Arrow as the Arrow Spark takes (types,
casts, ns truncated toward zero), the error that names a file whose value a cast would
change, the drifted-schema error with its ``.schema(...)`` DDL, and as_ns."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pytest

from quiverd.lake.drift import unify
from quiverd.spark.types import (
    as_ns,
    as_target,
    drift_error,
    spark_arrow_type,
    spark_type_name,
    to_spark,
)

UTC_US = pa.timestamp("us", "UTC")


@pytest.mark.parametrize(("lake", "taken"), [
    (pa.dictionary(pa.uint8(), pa.utf8()), pa.string()),
    (pa.dictionary(pa.int32(), pa.large_string()), pa.string()),
    (pa.uint8(), pa.int16()), (pa.uint16(), pa.int32()), (pa.uint32(), pa.int64()),
    (pa.uint64(), pa.decimal128(20, 0)),
    (pa.timestamp("ns", "Europe/Paris"), UTC_US), (pa.timestamp("s", "UTC"), UTC_US),
    (pa.timestamp("ns"), pa.timestamp("us")), (pa.timestamp("ms"), pa.timestamp("us")),
    (pa.float16(), pa.float32()), (pa.date64(), pa.date32()),
    (pa.large_string(), pa.string()), (pa.large_binary(), pa.binary()),
    (pa.int8(), pa.int8()), (pa.int64(), pa.int64()), (pa.float64(), pa.float64()),
    (pa.string(), pa.string()), (pa.bool_(), pa.bool_()), (pa.date32(), pa.date32()),
    (pa.decimal128(12, 3), pa.decimal128(12, 3)), (pa.binary(), pa.binary()),
    (pa.struct([("a", pa.uint32()), ("b", pa.dictionary(pa.int8(), pa.utf8()))]),
     pa.struct([("a", pa.int64()), ("b", pa.string())])),
    (pa.map_(pa.large_string(), pa.uint8()), pa.map_(pa.string(), pa.int16())),
    (pa.large_list(pa.timestamp("ns")), pa.list_(pa.timestamp("us"))),
    (pa.list_(pa.uint64(), 2), pa.list_(pa.decimal128(20, 0))),
    (pa.list_(pa.struct([("t", pa.timestamp("ns", "UTC"))])),
     pa.list_(pa.struct([("t", UTC_US)]))),
])
def test_spark_arrow_type_of_each_lake_type(lake: pa.DataType, taken: pa.DataType) -> None:
    assert spark_arrow_type(lake) == taken


def test_to_spark_decodes_truncates_widens_fills_nulls() -> None:
    batch = pa.record_batch({
        "w": pa.array(["x", "y", "x"]).dictionary_encode().cast(
            pa.dictionary(pa.uint8(), pa.utf8())),
        "t": pa.array([1_500, 2_000_999, -1_500], pa.timestamp("ns", "UTC")),
        "u": pa.array([2**64 - 1, 0, None], pa.uint64()),
        "s": pa.array(["a", None, "c"], pa.large_string()),
        "dropped": pa.array([1, 2, 3]),  # read for since/until only, not asked by Spark
    })
    lake = unify(pa.schema([pa.field("gone", pa.int32())]), batch.schema)
    assert lake is not None
    # What to_arrow_schema(spark_schema(lake), "UTC") gives, minus "dropped".
    target = pa.schema([(f.name, spark_arrow_type(f.type)) for f in lake if f.name != "dropped"])
    assert target == pa.schema([("gone", pa.int32()), ("w", pa.string()), ("t", UTC_US),
                                ("u", pa.decimal128(20, 0)), ("s", pa.string())])
    out = to_spark(batch, target)
    assert out.schema == target  # what Spark checks the first batch against
    assert out["gone"].null_count == 3 and out["w"].to_pylist() == ["x", "y", "x"]
    assert out["t"].cast(pa.int64()).to_pylist() == [1, 2_000, -1]  # toward zero
    assert out["u"].to_pylist() == [Decimal(2**64 - 1), Decimal(0), None]
    assert out["s"].to_pylist() == ["a", None, "c"]


def test_to_spark_timestamps_truncate_at_and_around_the_epoch() -> None:
    ns = [0, 999, -999, -1_000, -1_001, 1_000, None]
    batch = pa.record_batch({"t": pa.array(ns, pa.timestamp("ns"))})
    out = to_spark(batch, pa.schema([("t", pa.timestamp("us"))]))
    assert out["t"].cast(pa.int64()).to_pylist() == [0, 0, 0, -1, -1, 1, None]
    ms = pa.record_batch({"t": pa.array([-1, 0, 1], pa.timestamp("ms", "UTC"))})
    assert to_spark(ms, pa.schema([("t", UTC_US)]))["t"].cast(pa.int64()).to_pylist() == \
        [-1_000, 0, 1_000]


def test_to_spark_casts_lossless_values_to_the_unified_type() -> None:
    batch = pa.record_batch({"k": pa.array([1, -2, None], pa.int32()),
                             "x": pa.array([3, 2**53], pa.int64()).take([0, 1, 1]),
                             "big": pa.array(["a", "b", "c"], pa.large_string())})
    target = pa.schema([("k", pa.int64()), ("x", pa.float64()), ("big", pa.string())])
    out = to_spark(batch, target)
    assert out.to_pydict() == {"k": [1, -2, None], "x": [3.0, 2.0**53, 2.0**53],
                               "big": ["a", "b", "c"]}


def test_as_target_names_the_file_column_and_types_when_a_cast_would_change_a_value() -> None:
    inexact = pa.record_batch({"ok": pa.array([1]), "x": pa.array([2**53 + 1], pa.int64())})
    target = pa.schema([("ok", pa.int64()), ("x", pa.float64())])
    with pytest.raises(ValueError, match=r"^lake file F1 \(file:///l/a\.parquet\): column 'x' "
                       r"is int64 there and cannot be read as double without changing "
                       r"values \(.*\); pass \.schema\(\.\.\.\) with a type that holds "
                       r"every file's values \(e\.g\. STRING\), or narrow the read"):
        as_target(inexact, target, "F1", "file:///l/a.parquet")
    words = pa.record_batch({"n": pa.array(["7", "seven"])})
    with pytest.raises(ValueError, match=r"lake file F2 \(k\): column 'n' is string there "
                       "and cannot be read as int32"):
        as_target(words, pa.schema([("n", pa.int32())]), "F2", "k")
    fits = pa.record_batch({"n": pa.array(["7", None, "-8"])})
    assert as_target(fits, pa.schema([("n", pa.int32())]), "F3", "k")["n"].to_pylist() == \
        [7, None, -8]
    # A cast Arrow does not have at all is named the same way.
    nested = pa.record_batch({"n": pa.array([[1]])})
    with pytest.raises(ValueError, match=r"lake file F4 \(k\): column 'n' is list<item: "
                       r"int64> there and cannot be read as int64"):
        as_target(nested, pa.schema([("n", pa.int64())]), "F4", "k")


# ---- drift_error --------------------------------------------------------------------------

F1, F2, F3 = ("F1", "file:///l/1.parquet"), ("F2", "file:///l/2.parquet"), ("F3", "s3://b/3")


def _ddl(text: str) -> str:
    return text.split('.schema("')[1].split('")')[0]


def test_drift_error_names_both_files_and_the_schema_that_reads_them_as_one() -> None:
    first = pa.schema([("user", pa.string()), ("n", pa.int32())])
    middle = pa.schema([("n", pa.int64())])
    found = pa.schema([("user", pa.int32()), ("n", pa.int32()), ("extra", pa.uint64())])
    unified = unify(first, middle)
    assert unified is not None
    text = drift_error(unified, found, F3, [(F1, first), (F2, middle)])
    assert text.startswith("column 'user' is int32 in lake file F3 (s3://b/3) but string in "
                           "lake file F1 (file:///l/1.parquet): no type holds both without "
                           "loss, so the client has no one schema. Read the column as "
                           "STRING, e.g. .schema(")
    assert _ddl(text) == "`user` string, `n` bigint, `extra` decimal(20,0)"
    assert text.endswith("or narrow the read with since/until to one side")
    # The earlier file is the one that holds the column as a clashing type, not the first.
    later = pa.schema([("user", pa.string())])
    text = drift_error(pa.schema([("user", pa.string())]), found, F3,
                       [(F1, pa.schema([("n", pa.int32())])), (F2, later)])
    assert "but string in lake file F2 (file:///l/2.parquet)" in text
    text = drift_error(pa.schema([("user", pa.string())]), found, F3, [])
    assert "but string in an earlier file:" in text
    # Whichever side held it as a number, the DDL reads the column as STRING.
    ints = pa.schema([("user", pa.int64()), ("n", pa.int32())])
    text = drift_error(ints, pa.schema([("user", pa.string())]), F2, [(F1, ints)])
    assert "column 'user' is string in lake file F2" in text and "but int64 in lake file F1" \
        in text
    assert _ddl(text) == "`user` string, `n` int"


def test_drift_error_ddl_names_each_type_as_spark_reads_it() -> None:
    schema = pa.schema([
        ("flip", pa.string()), ("ts", pa.timestamp("ns", "UTC")), ("ntz", pa.timestamp("us")),
        ("d", pa.date32()), ("b", pa.bool_()), ("f", pa.float16()), ("i8", pa.int8()),
        ("u16", pa.uint16()), ("bin", pa.large_binary()), ("fixed", pa.binary(4)),
        ("w", pa.dictionary(pa.int32(), pa.utf8())), ("dec", pa.decimal128(7, 2)),
        ("arr", pa.large_list(pa.int64())), ("m", pa.map_(pa.string(), pa.float64())),
        ("st", pa.struct([("a", pa.uint8()), ("tags", pa.list_(pa.string()))])),
        ("nothing", pa.null()),
    ])
    text = drift_error(schema, pa.schema([("flip", pa.int64())]), F2, [(F1, schema)])
    assert _ddl(text) == (
        "`flip` string, `ts` timestamp, `ntz` timestamp_ntz, `d` date, `b` boolean, "
        "`f` float, `i8` tinyint, `u16` int, `bin` binary, `fixed` binary, `w` string, "
        "`dec` decimal(7,2), `arr` array<bigint>, `m` map<string,double>, "
        "`st` struct<a:smallint,tags:array<string>>, `nothing` void")
    for f in schema:
        assert spark_type_name(f) == _ddl(text).split(f"`{f.name}` ")[1].split(", `")[0]


def test_drift_error_nested_clash_asks_for_a_type_both_cast_to() -> None:
    schema = pa.schema([("s", pa.struct([("a", pa.int32())]))])
    found = pa.schema([("s", pa.int64())])
    text = drift_error(schema, found, F2, [(F1, schema)])
    assert "column 's' is int64 in lake file F2" in text and "struct<a: int32>" in text
    assert "Read the column with .schema(...) in a type both can be cast to, or narrow" in text
    assert '.schema("' not in text


def test_drift_error_without_a_clashing_column_says_the_schema_cannot_be_unified() -> None:
    same = pa.schema([("a", pa.int32())])
    assert drift_error(same, same, F2, [(F1, same)]) == \
        "lake file F2 (file:///l/2.parquet): its schema cannot be unified"


# ---- as_ns --------------------------------------------------------------------------------

@pytest.mark.parametrize(("unit", "per_unit"), [("s", 10**9), ("ms", 10**6), ("us", 1_000),
                                                ("ns", 1)])
def test_as_ns_timestamps_of_each_unit_are_ns_since_the_epoch(unit: str, per_unit: int
                                                              ) -> None:
    column = pa.array([0, 5, -3, None], pa.timestamp(unit, "UTC"))
    assert as_ns(column).to_pylist() == [0, 5 * per_unit, -3 * per_unit, None]
    assert as_ns(column).type == pa.int64()


def test_as_ns_other_columns_unchanged() -> None:
    column = pa.array([1, 2], pa.int64())
    assert as_ns(column) is column
    day = pa.array([1], pa.date32())
    assert as_ns(day) is day
