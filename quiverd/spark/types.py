"""Arrow as Spark's Python data sources expect it: the types Spark has, in UTC.

Dictionaries become their values, large strings/binaries plain ones, uint8/16/32 the next
wider signed int, uint64 decimal(20, 0); timestamps with a zone become TimestampType in
UTC, without one TimestampNTZType. Spark keeps microseconds: nanoseconds are truncated
toward zero, as Arrow casts. Files of one client read as one schema (``drift.unify``, or
the user's ``.schema(...)``) are cast to it safely: a value the cast would change fails.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import types as st
from pyspark.sql.pandas.types import from_arrow_type

from quiverd.lake.drift import conform


def spark_schema(schema: pa.Schema) -> st.StructType:
    fields = []
    for f in schema:
        try:
            spark_type = from_arrow_type(spark_arrow_type(f.type), prefer_timestamp_ntz=True)
        except Exception as exc:
            raise TypeError(f"column {f.name!r}: Spark has no type for {f.type} "
                            f"({exc})") from exc
        fields.append(st.StructField(f.name, spark_type, nullable=True))
    return st.StructType(fields)


def spark_arrow_type(t: pa.DataType) -> pa.DataType:
    """The Arrow type Spark can take for lake type ``t`` (see the module doc)."""
    if pa.types.is_dictionary(t):
        return spark_arrow_type(t.value_type)
    if pa.types.is_unsigned_integer(t):
        wider = {8: pa.int16(), 16: pa.int32(), 32: pa.int64()}
        return wider.get(t.bit_width, pa.decimal128(20, 0))
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    simple = {pa.float16(): pa.float32(), pa.date64(): pa.date32(),
              pa.large_string(): pa.string(), pa.large_binary(): pa.binary()}
    if t in simple:
        return simple[t]
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(i).name, spark_arrow_type(t.field(i).type))
                          for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(spark_arrow_type(t.key_type), spark_arrow_type(t.item_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return pa.list_(spark_arrow_type(t.value_type))
    return t


def to_spark(batch: pa.RecordBatch, target: pa.Schema) -> pa.Table:
    """``batch`` laid out as ``target`` (Spark's Arrow): missing columns null, types cast."""
    columns: dict[str, pa.Array] = {}
    for name in batch.schema.names:
        if name in target.names:
            columns[name] = _cast(batch.column(name), target.field(name).type)
    return conform(pa.table(columns), target)


def _cast(column: pa.Array, t: pa.DataType) -> pa.Array:
    if column.type == t:
        return column
    # Safe casts only: a value the cast would change (an int past 2**53 into a double, a
    # string that is no number into an int) fails the read (the reader names the file)
    # rather than come back different. Within one file the uploader already chose.
    try:
        return column.cast(t, safe=True)
    except pa.ArrowInvalid:
        if "timestamp" not in str(column.type):
            raise
        # Spark holds microseconds: the nanoseconds are dropped, not refused.
        return column.cast(t, safe=False)


# ---- pruning ------------------------------------------------------------------------------

def as_ns(column: pa.Array) -> pa.Array:
    if pa.types.is_timestamp(column.type):
        per_unit = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[column.type.unit]
        return pc.multiply(column.cast(pa.int64()), per_unit)
    return column
