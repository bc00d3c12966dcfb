"""Which lake files, and which row groups inside a file, a Spark query may skip:
comparisons of a top-level column with a literal, against the catalog's time range and
the files' zone maps (``may_match``, on the driver), then against each row group's footer
statistics (``row_groups``, on the executor: the file's min/max per column and row group,
written by Parquet for every column). See reader.py.

No pyspark here: a filter's literal is judged by the Arrow type Spark reads its column
as (``types.filter_types`` of the reader's Spark schema), so all of it runs, and is
tested, without Spark."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.lake.model import FileRow, ZoneMap

NS_PER_US = 1_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
COMPARISONS = frozenset({"EqualTo", "GreaterThan", "GreaterThanOrEqual", "LessThan",
                          "LessThanOrEqual", "In"})
# Spark's ByteType ... DoubleType as Arrow (to_arrow_type): the numbers a literal compares
# with. Spark reads no column as an unsigned int or a float16 (types.spark_arrow_type).
NUMBERS = frozenset({pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(),
                     pa.float64()})


@dataclass(frozen=True)
class Bound:
    """One prunable filter: ``column <op> value``, the value as a zone-map interval."""

    column: str
    op: str  # a Spark filter class name from COMPARISONS
    values: tuple[tuple[Any, Any], ...]  # (lo, hi) per literal; several for In only


def to_bound(f: Any, types: Mapping[str, pa.DataType]) -> Bound | None:
    """The Bound of a Spark filter, or None when it cannot prune (kept by name: the
    filter classes exist in pyspark 4.1+ only). ``types``: the Arrow type Spark reads
    each top-level column as (``types.filter_types``); a column not there is not pruned."""
    op = type(f).__name__
    attribute: tuple[str, ...] = tuple(getattr(f, "attribute", ()))
    if op not in COMPARISONS or len(attribute) != 1 or attribute[0] not in types:
        return None
    column = attribute[0]
    literals = f.value if op == "In" else (f.value,)
    values = [_interval(v, types[column]) for v in literals]
    if not values or any(v is None for v in values):
        return None
    return Bound(column=column, op=op, values=tuple(v for v in values if v is not None))


def _interval(value: Any, t: pa.DataType) -> tuple[Any, Any] | None:
    """A literal in zone-map terms, as the interval of stored values Spark reads as it
    (``t``: the column's type as Spark reads it, in Arrow terms)."""
    if pa.types.is_timestamp(t):  # TimestampType and TimestampNTZType
        if not isinstance(value, datetime):
            return None
        v = datetime_ns(value)
        return (v - 999 if v <= 0 else v), (v + 999 if v >= 0 else v)
    if pa.types.is_date32(t):  # DateType
        if not isinstance(value, date) or isinstance(value, datetime):
            return None
        days = (value - date(1970, 1, 1)).days
        return days, days
    if t in NUMBERS:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value == value
        return (value, value) if ok else None
    if pa.types.is_string(t) and isinstance(value, str):  # StringType
        return value, value
    if pa.types.is_boolean(t) and isinstance(value, bool):
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


def row_groups(metadata: pq.FileMetaData, schema: pa.Schema, bounds: list[Bound],
               time_column: str, since_ns: int | None, until_ns: int | None) -> list[int]:
    """The row groups of a file that may hold a row passing every bound and
    since <= time < until, by the footer's statistics; a column without statistics in a
    row group (or of a type not compared here) keeps it."""
    count = metadata.num_row_groups
    wanted = {b.column for b in bounds}
    ranged = since_ns is not None or until_ns is not None
    if ranged:
        wanted.add(time_column)
    leaves = _leaf_index(schema, wanted)
    if not leaves:
        return list(range(count))
    kept = []
    for index in range(count):
        group = metadata.row_group(index)
        ranges = {name: _stat_range(group.column(leaf).statistics, schema.field(name).type)
                  for name, leaf in leaves.items()}
        if _group_may_match(ranges, bounds, time_column, since_ns, until_ns):
            kept.append(index)
    return kept


def _group_may_match(ranges: dict[str, tuple[Any, Any] | None], bounds: list[Bound],
                     time_column: str, since_ns: int | None, until_ns: int | None) -> bool:
    time = ranges.get(time_column)
    if time is not None and ((since_ns is not None and time[1] < since_ns)
                             or (until_ns is not None and time[0] >= until_ns)):
        return False
    for b in bounds:
        found = ranges.get(b.column)
        if found is None:
            continue
        try:
            if not any(_overlaps(b.op, found[0], found[1], v_lo, v_hi) for v_lo, v_hi in b.values):
                return False
        except TypeError:  # values of another kind: keep
            continue
    return True


def _leaf_index(schema: pa.Schema, names: set[str]) -> dict[str, int]:
    """Parquet's leaf column index of each top-level column in ``names`` that is a
    single leaf (nested columns are not compared)."""
    out, leaf = {}, 0
    for f in schema:
        width = _leaves(f.type)
        if f.name in names and width == 1 and not _is_nested(f.type):
            out[f.name] = leaf
        leaf += width
    return out


def _leaves(t: pa.DataType) -> int:
    if pa.types.is_dictionary(t):
        return _leaves(t.value_type)
    if pa.types.is_struct(t):
        return sum(_leaves(t.field(i).type) for i in range(t.num_fields)) or 1
    if pa.types.is_map(t):
        return _leaves(t.key_type) + _leaves(t.item_type)
    if _is_nested(t):
        return _leaves(t.value_type)
    return 1


def _is_nested(t: pa.DataType) -> bool:
    return bool(pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_list(t)
                or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _stat_range(stats: Any, t: pa.DataType) -> tuple[Any, Any] | None:
    """A row group's (min, max) of a column, in the terms Bound values use (timestamps
    in ns, dates in days), or None when unknown."""
    if stats is None or not stats.has_min_max:
        return None
    if pa.types.is_dictionary(t):
        t = t.value_type
    try:
        if pa.types.is_timestamp(t):
            per_unit = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[t.unit]
            return int(stats.min_raw) * per_unit, int(stats.max_raw) * per_unit
        if pa.types.is_date32(t):
            return int(stats.min_raw), int(stats.max_raw)
        if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
                or pa.types.is_string(t) or pa.types.is_large_string(t)):
            lo, hi = stats.min, stats.max
            if isinstance(lo, bytes) or isinstance(hi, bytes):
                return None  # not valid UTF-8 (not written by quiverd): keep
            return lo, hi
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    return None


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
