"""Arrow as Spark's Python data sources expect it: the types Spark has, in UTC.

Dictionaries become their values, large strings/binaries plain ones, uint8/16/32 the next
wider signed int, uint64 decimal(20, 0); timestamps with a zone become TimestampType in
UTC, without one TimestampNTZType. Spark keeps microseconds: nanoseconds are truncated
toward zero, as Arrow casts. Files of one client read as one schema (``drift.unify``, or
the user's ``.schema(...)``) are cast to it safely: a value the cast would change fails.

Only ``spark_schema`` and ``filter_types``, which make or read Spark's types, import
pyspark (when called); the rest is Arrow and runs without it, on the driver and the
executors alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from quiverd.lake.drift import conflict, conform

if TYPE_CHECKING:
    from pyspark.sql import types as st


def spark_schema(schema: pa.Schema) -> st.StructType:
    """Spark's schema for lake schema ``schema``: each column as Spark reads it."""
    from pyspark.sql import types as st
    from pyspark.sql.pandas.types import from_arrow_type

    fields = []
    for f in schema:
        try:
            spark_type = from_arrow_type(spark_arrow_type(f.type), prefer_timestamp_ntz=True)
        except Exception as exc:
            raise TypeError(f"column {f.name!r}: Spark has no type for {f.type} "
                            f"({exc})") from exc
        fields.append(st.StructField(f.name, spark_type, nullable=True))
    return st.StructType(fields)


def filter_types(schema: st.StructType) -> dict[str, pa.DataType]:
    """The Arrow type Spark reads each top-level column of ``schema`` (the reader's)
    as, for pruning's literals (``pruning.to_bound``). A column of a user-defined type,
    or of one Arrow has no type for, is left out: it is not pruned."""
    from pyspark.sql import types as st
    from pyspark.sql.pandas.types import to_arrow_type

    out: dict[str, pa.DataType] = {}
    for f in schema.fields:
        if isinstance(f.dataType, st.UserDefinedType):
            continue  # its literals are the UDT's Python objects, not its storage type's
        try:
            out.setdefault(f.name, to_arrow_type(f.dataType, timezone="UTC"))
        except TypeError:  # PySparkTypeError: CHAR, VARCHAR, intervals of months, ...
            continue
    return out


def spark_type_name(field: pa.Field) -> str:
    """Spark's name (``simpleString``, as in a ``.schema("...")`` DDL) of the type Spark
    reads lake column ``field`` as: "bigint", "timestamp_ntz", "array<string>". The usual
    types are named here, without pyspark; the rare rest (times, intervals, decimal256)
    by ``spark_schema``, which raises TypeError when Spark has no type for it."""
    name = _simple_name(spark_arrow_type(field.type))
    if name is None:
        return str(spark_schema(pa.schema([field]))[0].dataType.simpleString())
    return name


# from_arrow_type's Spark type for each Arrow type, by its simpleString.
_SIMPLE = {pa.bool_(): "boolean", pa.int8(): "tinyint", pa.int16(): "smallint",
           pa.int32(): "int", pa.int64(): "bigint", pa.float32(): "float",
           pa.float64(): "double", pa.string(): "string", pa.binary(): "binary",
           pa.date32(): "date", pa.null(): "void"}


def _simple_name(t: pa.DataType) -> str | None:
    """``simpleString`` of from_arrow_type(t) for ``t`` already as spark_arrow_type
    makes it (its structs carry no field metadata: never a variant), None if not here."""
    if t in _SIMPLE:
        return _SIMPLE[t]
    if pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_decimal128(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz else "timestamp_ntz"
    if pa.types.is_list(t):
        item = _simple_name(t.value_type)
        return None if item is None else f"array<{item}>"
    if pa.types.is_map(t):
        key, value = _simple_name(t.key_type), _simple_name(t.item_type)
        return None if key is None or value is None else f"map<{key},{value}>"
    if pa.types.is_struct(t):
        fields = [(t.field(i).name, _simple_name(t.field(i).type)) for i in range(t.num_fields)]
        if any(name is None for _, name in fields):
            return None
        return "struct<" + ",".join(f"{n}:{name}" for n, name in fields) + ">"
    return None


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


# ---- one schema for files that drifted -------------------------------------------------

def drift_error(schema: pa.Schema, found: pa.Schema, file: tuple[str, str],
                seen: list[tuple[tuple[str, str], pa.Schema]]) -> str:
    """Lake file ``file`` (id, uri) with schema ``found`` cannot join ``schema``, the
    unified schema of the files ``seen`` before it: name the column, both files and the
    ``.schema(...)`` that reads every file of the client as one."""
    clash = conflict(schema, found)
    if clash is None:
        return f"lake file {file[0]} ({file[1]}): its schema cannot be unified"
    name, before, here = clash
    other = next((f for f, s in seen if name in s.names
                  and conflict(pa.schema([s.field(name)]), pa.schema([found.field(name)]))),
                 None)
    where = f"lake file {other[0]} ({other[1]})" if other else "an earlier file"
    fields = {f.name: f.type for f in schema}
    fields.update({f.name: f.type for f in found if f.name not in fields})
    scalar = not any(_nested(t) for t in (before, here))
    fields[name] = pa.string() if scalar else fields[name]
    ddl = ", ".join(f"`{n}` {spark_type_name(pa.field(n, t))}" for n, t in fields.items())
    cast = (f"as STRING, e.g. .schema(\"{ddl}\") (each file's values are cast to the given "
            "types; a value that does not fit fails the read naming its file)"
            if scalar else "with .schema(...) in a type both can be cast to")
    return (f"column {name!r} is {here} in lake file {file[0]} ({file[1]}) but {before} "
            f"in {where}: no type holds both without loss, so the client has no one schema. "
            f"Read the column {cast}, or narrow the read with since/until to one side")


def _nested(t: pa.DataType) -> bool:
    return bool(pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_list(t)
                or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def as_target(batch: pa.RecordBatch, target: pa.Schema, file_id: str, uri: str) -> pa.Table:
    """``to_spark``; a value the cast would change (a string that is no number, an int
    past 2**53 into a double) fails naming the file, column and types, not Arrow's
    words alone."""
    try:
        return to_spark(batch, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        column = next((f.name for f in batch.schema if f.name in target.names
                       and _cast_fails(batch.column(f.name), target.field(f.name).type)), None)
        if column is None:
            raise
        raise ValueError(
            f"lake file {file_id} ({uri}): column {column!r} is "
            f"{batch.schema.field(column).type} there and cannot be read as "
            f"{target.field(column).type} without changing values ({exc}); pass "
            ".schema(...) with a type that holds every file's values (e.g. STRING), or "
            "narrow the read with since/until") from None


def _cast_fails(column: pa.Array, t: pa.DataType) -> bool:
    try:
        to_spark(pa.record_batch([column], names=["c"]), pa.schema([pa.field("c", t)]))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return True
    return False


# ---- pruning ------------------------------------------------------------------------------

def as_ns(column: pa.Array) -> pa.Array:
    """A timestamp column as int64 ns since the epoch (the catalog's unit); any other
    column as it is."""
    if pa.types.is_timestamp(column.type):
        per_unit = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[column.type.unit]
        return pc.multiply(column.cast(pa.int64()), per_unit)
    return column
