"""Which lake files a Spark query may skip: comparisons of a top-level column with a
literal, against the catalog's time range and the files' zone maps (see reader.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from pyspark.sql import types as st

from quiverd.lake.model import FileRow, ZoneMap

NS_PER_US = 1_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
COMPARISONS = frozenset({"EqualTo", "GreaterThan", "GreaterThanOrEqual", "LessThan",
                          "LessThanOrEqual", "In"})


@dataclass(frozen=True)
class Bound:
    """One prunable filter: ``column <op> value``, the value as a zone-map interval."""

    column: str
    op: str  # a Spark filter class name from COMPARISONS
    values: tuple[tuple[Any, Any], ...]  # (lo, hi) per literal; several for In only


def to_bound(f: Any, schema: st.StructType) -> Bound | None:
    """The Bound of a Spark filter, or None when it cannot prune (kept by name: the
    filter classes exist in pyspark 4.1+ only)."""
    op = type(f).__name__
    attribute: tuple[str, ...] = tuple(getattr(f, "attribute", ()))
    if op not in COMPARISONS or len(attribute) != 1 or attribute[0] not in schema.names:
        return None
    column = attribute[0]
    spark_type = schema[column].dataType
    literals = f.value if op == "In" else (f.value,)
    values = [_interval(v, spark_type) for v in literals]
    if not values or any(v is None for v in values):
        return None
    return Bound(column=column, op=op, values=tuple(v for v in values if v is not None))


def _interval(value: Any, spark_type: st.DataType) -> tuple[Any, Any] | None:
    """A literal in zone-map terms, as the interval of stored values Spark reads as it."""
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


def may_match(row: FileRow, maps: list[ZoneMap], bounds: list[Bound], time_column: str) -> bool:
    """False only when no row of the file can pass every bound."""
    by_column = {m.column: m for m in maps}
    lo: Any
    hi: Any
    for b in bounds:
        if b.column == time_column:
            lo, hi = row.start_ts, row.end_ts
        elif (m := by_column.get(b.column)) is not None:
            if m.min_value is None or m.max_value is None:
                return False  # all null: no comparison is true
            lo, hi = m.min_value, m.max_value
        else:
            continue
        try:
            if not any(_overlaps(b.op, lo, hi, v_lo, v_hi) for v_lo, v_hi in b.values):
                return False
        except TypeError:  # a zone map of another kind (the column changed type): keep
            continue
    return True


def _overlaps(op: str, lo: Any, hi: Any, v_lo: Any, v_hi: Any) -> bool:
    """May a value in [lo, hi] satisfy ``value <op> literal`` for the literal [v_lo, v_hi]?"""
    if op in ("EqualTo", "In"):
        return bool(lo <= v_hi and hi >= v_lo)
    if op == "GreaterThan":
        return bool(hi > v_hi)
    if op == "GreaterThanOrEqual":
        return bool(hi >= v_lo)
    if op == "LessThan":
        return bool(lo < v_lo)
    assert op == "LessThanOrEqual", op
    return bool(lo <= v_hi)


# ---- helpers ------------------------------------------------------------------------------


def datetime_ns(dt: datetime) -> int:
    """ns since the epoch; a naive datetime is UTC (Spark's TimestampNTZ too)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    delta = dt - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * NS_PER_US
