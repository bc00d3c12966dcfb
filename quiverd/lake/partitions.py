"""Time partitions of the lake: which column a file is partitioned by, the hour of each
row, the object key's Hive-style directories, and reading a key back (pure functions).

Object keys (SPEC §6, "Object keys"):

    client=<c>/slot=<k>/date=YYYY-MM-DD/hour=HH/<file name>         since issue 20
    client=<c>/slot=<k>/date=<D>/hour=<D>/<file name>               D: __HIVE_DEFAULT_PARTITION__,
                                                                    the rows whose value is null
    client=<c>/slot=<k>/<node_id>/<file name>                       before: still valid

The partition column is ``lake.time_column`` when the file has it as a timestamp
column, else ``_quiver_ingested_at`` (an integer time column is not a time Iceberg or
Hive can partition by). A file never spans two hours of its partition column: the
uploader splits each incoming table with ``split_by_hour`` and keeps one open file per
hour. An hour is a whole number of hours since the Unix epoch, UTC (``None``: the null
partition); any timestamp unit gives the same hour, tz-naive timestamps count as UTC.
Spark's partition discovery reads ``date``/``hour`` and ``__HIVE_DEFAULT_PARTITION__``
as null; Iceberg's ``hour(...)`` transform has the same hours.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from quiverd.lake.model import INGESTED_AT
from quiverd.lake.parquet import parse_file_name

DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__"  # Hive's (and Spark's) name for null
NS_PER_HOUR = 3600 * 10**9
_PER_HOUR = {"s": 3600, "ms": 3600 * 10**3, "us": 3600 * 10**6, "ns": NS_PER_HOUR}
_FIRST_HOUR = int(datetime(1, 1, 1, tzinfo=UTC).timestamp()) // 3600  # key dates: years
_LAST_HOUR = int(datetime(9999, 12, 31, 23, tzinfo=UTC).timestamp()) // 3600  # 1..9999

Hour = int | None  # hours since the epoch (UTC); None: the null partition


class ObjectKey(NamedTuple):
    """A lake object key read back; ``partitioned`` False for the layout before issue 20
    (``node_id`` from its ``<node_id>/`` level, ``hour`` None)."""

    client: str
    slot: int
    partitioned: bool
    hour: Hour
    node_id: str | None  # None: a new-layout key whose file name is not a lake file name
    name: str


def partition_column(schema: pa.Schema, time_column: str) -> str:
    """The column a file of ``schema`` is partitioned by: ``time_column``
    (``lake.time_column``) when the schema has it as a timestamp column, else
    ``_quiver_ingested_at``. The uploader and the Iceberg projection both ask here."""
    i = schema.get_field_index(time_column) if time_column else -1
    if i >= 0 and pa.types.is_timestamp(schema.field(i).type):
        return time_column
    return INGESTED_AT


def hour_of_ns(ts_ns: int) -> Hour:
    """The hour holding ``ts_ns`` (ns since the epoch, UTC; always a nameable hour)."""
    return canonical_hour(ts_ns // NS_PER_HOUR)


def canonical_hour(hour: Hour) -> Hour:
    """``hour``, or None (the null partition) for an hour no key date can name (outside
    the years 1..9999): every file's hour has a key of its own."""
    return hour if hour is not None and _FIRST_HOUR <= hour <= _LAST_HOUR else None


def hours_of(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Each timestamp's hour (int64, floor division: right for times before 1970 too),
    any unit; null for a null value and for an hour ``canonical_hour`` makes null."""
    kind = values.type
    assert pa.types.is_timestamp(kind), kind
    ints = pc.cast(values, pa.int64())
    per_hour = pa.scalar(_PER_HOUR[kind.unit], pa.int64())
    quotient = pc.divide(ints, per_hour)  # truncates toward zero
    behind = pc.and_(pc.less(ints, 0), pc.not_equal(pc.multiply(quotient, per_hour), ints))
    hours = pc.subtract(quotient, pc.cast(behind, pa.int64()))
    named = pc.and_(pc.greater_equal(hours, _FIRST_HOUR), pc.less_equal(hours, _LAST_HOUR))
    return pc.if_else(named, hours, pa.scalar(None, pa.int64()))


def split_by_hour(table: pa.Table, column: str) -> list[tuple[Hour, pa.Table]]:
    """``table``'s rows by hour of ``column`` (a timestamp column), hours ascending, the
    null partition last. One hour and no nulls (the usual batch) returns ``table`` as it
    is, after one min/max pass; otherwise rows keep their order within an hour."""
    values = table.column(column)
    per_hour = _PER_HOUR[values.type.unit]
    if values.null_count == 0:
        bounds = pc.min_max(values.cast(pa.int64()))
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low is None:
            return []  # no rows
        hour = canonical_hour(low // per_hour)
        if low // per_hour == high // per_hour and hour is not None:
            return [(hour, table)]
    elif values.null_count == len(values):
        return [(None, table)]
    hours = hours_of(values)
    order = pc.array_sort_indices(hours, null_placement="at_end")  # stable
    counts = pc.value_counts(pc.take(hours, order))
    ordered = table.take(order)
    pieces: list[tuple[Hour, pa.Table]] = []
    offset = 0
    for entry in counts.to_pylist():
        pieces.append((entry["values"], ordered.slice(offset, entry["counts"])))
        offset += entry["counts"]
    return pieces


def hour_dirs(hour: Hour) -> str:
    """``date=YYYY-MM-DD/hour=HH`` of ``hour``; the null partition (and an hour outside
    the years 1..9999, which no date can name) is ``__HIVE_DEFAULT_PARTITION__``."""
    named = canonical_hour(hour)
    if named is None:
        return f"date={DEFAULT_PARTITION}/hour={DEFAULT_PARTITION}"
    at = datetime.fromtimestamp(named * 3600, UTC)
    return f"date={at:%Y-%m-%d}/hour={at:%H}"


def parse_object_key(key: str) -> ObjectKey | None:
    """A lake object key (either layout) read back; None for any other key."""
    parts = key.split("/")
    if len(parts) < 4 or not parts[0].startswith("client=") or not parts[1].startswith(
            "slot=") or not parts[1][5:].isdigit() or not parts[-1]:
        return None
    client, slot, name = parts[0][7:], int(parts[1][5:]), parts[-1]
    if len(parts) == 4:
        return ObjectKey(client, slot, False, None, parts[2], name)
    if len(parts) != 5 or not (parts[2].startswith("date=") and parts[3].startswith("hour=")):
        return None
    date, hh = parts[2][5:], parts[3][5:]
    hour: Hour = None
    if date != DEFAULT_PARTITION or hh != DEFAULT_PARTITION:
        try:
            at = datetime.strptime(f"{date} {hh}", "%Y-%m-%d %H").replace(tzinfo=UTC)
        except ValueError:
            return None
        hour = int(at.timestamp()) // 3600
    parsed = parse_file_name(name)
    return ObjectKey(client, slot, True, hour, parsed.node_id if parsed else None, name)


def key_partition(key: str) -> str:
    """The ``date=../hour=..`` of a lake object key; "" for any other key (the layout
    before hours: its file holds whole slots of its bundles)."""
    parsed = parse_object_key(key)
    if parsed is None or not parsed.partitioned:
        return ""
    return hour_dirs(parsed.hour)


def same_partition(a: str, b: str) -> bool:
    """Could files of partitions ``a`` and ``b`` (``key_partition``) hold the same rows
    of one bundle's slot? Yes unless both are hours and they differ."""
    return a == "" or b == "" or a == b


def is_node_key(key: str, node_id: str) -> bool:
    """An object node ``node_id`` wrote: its id in the file name (new layout) or its
    ``<node_id>/`` level (old layout). Other nodes' objects are never theirs to judge."""
    parsed = parse_object_key(key)
    return parsed is not None and parsed.node_id == node_id


__all__ = ["DEFAULT_PARTITION", "Hour", "ObjectKey", "canonical_hour", "hour_dirs",
           "hour_of_ns", "hours_of", "is_node_key", "key_partition", "parse_object_key",
           "partition_column", "same_partition", "split_by_hour"]
