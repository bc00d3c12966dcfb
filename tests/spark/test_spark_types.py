"""The two places quiverd.spark.types meets pyspark's own types, without a session:
``filter_types`` (what pruning compares a literal with) prunes exactly what the Spark-type
dispatch before it pruned, and ``spark_type_name`` (the drift error's DDL, computed
without pyspark) is pyspark's own ``simpleString`` of ``spark_schema``'s type."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

pytest.importorskip("pyspark", reason="pip install 'quiverd[spark]' (scripts/setup)")

from pyspark.sql import types as st  # noqa: E402 - after the skip

from quiverd.spark.pruning import datetime_ns, to_bound  # noqa: E402
from quiverd.spark.types import filter_types, spark_schema, spark_type_name  # noqa: E402


class _PointUDT(st.UserDefinedType):
    """A user-defined type stored as a long: never pruned."""

    @classmethod
    def sqlType(cls) -> st.DataType:  # noqa: N802 - pyspark's name
        return st.LongType()


SPARK_TYPES = [
    st.TimestampType(), st.TimestampNTZType(), st.DateType(), st.ByteType(), st.ShortType(),
    st.IntegerType(), st.LongType(), st.FloatType(), st.DoubleType(), st.StringType(),
    st.BooleanType(), st.DecimalType(10, 2), st.BinaryType(), st.CharType(3),
    st.VarcharType(3), st.DayTimeIntervalType(), st.YearMonthIntervalType(), st.TimeType(),
    st.CalendarIntervalType(), st.NullType(), st.VariantType(), st.ArrayType(st.LongType()),
    st.MapType(st.StringType(), st.LongType()),
    st.StructType([st.StructField("a", st.LongType())]), _PointUDT(),
]
LITERALS = [datetime(2025, 1, 1, tzinfo=UTC), datetime(1969, 12, 31, 23, 59, 59),
            date(2025, 1, 1), 3, -2**63, 2.5, float("nan"), True, "web", None, Decimal("1.5"),
            b"x", (1, 2)]


def _interval_before(value: Any, spark_type: st.DataType) -> tuple[Any, Any] | None:
    """pruning._interval as it was before issue 27, dispatching on the Spark type."""
    if isinstance(spark_type, st.TimestampType | st.TimestampNTZType):
        if not isinstance(value, datetime):
            return None
        v = datetime_ns(value)
        return (v - 999 if v <= 0 else v), (v + 999 if v >= 0 else v)
    if isinstance(spark_type, st.DateType):
        if not isinstance(value, date) or isinstance(value, datetime):
            return None
        days = (value - date(1970, 1, 1)).days
        return days, days
    numeric = (st.ByteType, st.ShortType, st.IntegerType, st.LongType, st.FloatType,
               st.DoubleType)
    if isinstance(spark_type, numeric):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value
        return (value, value) if ok else None
    if isinstance(spark_type, st.StringType) and isinstance(value, str):
        return value, value
    if isinstance(spark_type, st.BooleanType) and isinstance(value, bool):
        return value, value
    return None


def test_filter_types_prune_exactly_what_the_spark_type_dispatch_pruned() -> None:
    schema = st.StructType([st.StructField(f"c{i}", t) for i, t in enumerate(SPARK_TYPES)])
    types = filter_types(schema)
    assert set(types) < set(schema.names)  # CHAR, VARCHAR, the UDT, ...: left out
    pruned = 0
    for i, spark_type in enumerate(SPARK_TYPES):
        for value in LITERALS:
            f = type("EqualTo", (), {"attribute": (f"c{i}",), "value": value})()
            bound = to_bound(f, types)
            want = _interval_before(value, spark_type)
            assert (None if bound is None else bound.values) == \
                (None if want is None else (want,)), (spark_type, value)
            pruned += bound is not None
    assert pruned == 2 * 2 + 1 + 6 * 3 + 2  # timestamps, date, numbers, string, boolean


LAKE_TYPES = [
    pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
    pa.uint32(), pa.uint64(), pa.float16(), pa.float32(), pa.float64(), pa.string(),
    pa.large_string(), pa.binary(), pa.large_binary(), pa.binary(16), pa.date32(),
    pa.date64(), pa.timestamp("s"), pa.timestamp("ns", "UTC"), pa.timestamp("us", "+05:00"),
    pa.decimal128(5, 1), pa.decimal128(38, 10), pa.decimal256(50, 2), pa.null(),
    pa.dictionary(pa.int8(), pa.string()), pa.dictionary(pa.uint16(), pa.large_string()),
    pa.time64("us"), pa.duration("ms"),
    pa.list_(pa.int64()), pa.large_list(pa.dictionary(pa.int32(), pa.string())),
    pa.list_(pa.float32(), 3), pa.map_(pa.string(), pa.uint64()),
    pa.map_(pa.int32(), pa.list_(pa.timestamp("ns"))),
    pa.struct([("a", pa.int32()), ("b c", pa.list_(pa.string())),
               ("d", pa.struct([("e", pa.date32())]))]),
    pa.struct([]), pa.list_(pa.time64("ns")), pa.struct([("t", pa.duration("s"))]),
]


@pytest.mark.parametrize("t", LAKE_TYPES, ids=str)
def test_spark_type_name_is_spark_s_simple_string(t: pa.DataType) -> None:
    field = pa.field("c", t)
    assert spark_type_name(field) == spark_schema(pa.schema([field]))[0].dataType.simpleString()


@pytest.mark.parametrize("t", [pa.time32("s"), pa.month_day_nano_interval(),
                               pa.list_(pa.time32("ms"))], ids=str)
def test_spark_type_name_without_a_spark_type_raises_as_spark_schema_does(t: pa.DataType
                                                                          ) -> None:
    with pytest.raises(TypeError, match="column 'x': Spark has no type for"):
        spark_type_name(pa.field("x", t))
    with pytest.raises(TypeError, match="column 'x': Spark has no type for"):
        spark_schema(pa.schema([pa.field("x", t)]))
