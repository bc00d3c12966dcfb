"""Representative schemas: one stable schema per slot across streams and segments.

A slot's streams differ when producers drift (a new optional column, a type
change). Readers present their union: columns in first-seen order, every field
nullable, each at the widest type of its versions. Promotion rules, in order:

    same type                        itself
    null + T                         T
    dictionary + dictionary          dictionary(widest index, promoted values)
    dictionary + plain T             promoted(value type, T), plain
    int + int, same signedness       the wider one
    uint + int                       the smallest signed type holding both
                                     (uint64 + int: decimal128(20, 0), lossless)
    int/float + float                float64 (float16/32 pairs: the wider one)
    string-likes                     large_string;  binary-likes: large_binary
    string-like + binary-like        large_binary
    timestamps, same time zone       the finer unit
    struct + struct                  struct of the union of fields, promoted
    list-likes                       large_list(promoted values) (list + list: list)
    anything else ("incompatible")   large_string, values rendered as text

The function is pure and associative in effect, so schemas from many segments
can be folded in any grouping as long as their order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

INCOMPATIBLE = pa.large_string()
_UNIT_RANK = {"s": 0, "ms": 1, "us": 2, "ns": 3}


def representative_schema(schemas: Iterable[pa.Schema]) -> pa.Schema:
    """Union of ``schemas``: stable first-seen column order, widest types, all nullable."""
    types: dict[str, pa.DataType] = {}
    for schema in schemas:
        for f in schema:
            seen = types.get(f.name)
            types[f.name] = f.type if seen is None else promote(seen, f.type)
    return pa.schema([pa.field(name, t, nullable=True) for name, t in types.items()])


def promote(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The widest type that holds values of both ``a`` and ``b`` (rules above)."""
    if a == b:
        return a
    if pa.types.is_null(a) or pa.types.is_null(b):
        return b if pa.types.is_null(a) else a
    if pa.types.is_dictionary(a) and pa.types.is_dictionary(b):
        values = promote(a.value_type, b.value_type)
        return pa.dictionary(_promote_int(a.index_type, b.index_type), values)
    if pa.types.is_dictionary(a) or pa.types.is_dictionary(b):
        plain_a = a.value_type if pa.types.is_dictionary(a) else a
        plain_b = b.value_type if pa.types.is_dictionary(b) else b
        return promote(plain_a, plain_b)
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return _promote_int(a, b)
    if _is_number(a) and _is_number(b):
        if pa.types.is_floating(a) and pa.types.is_floating(b):
            return a if a.bit_width >= b.bit_width else b
        return pa.float64()
    return _promote_other(a, b)


def to_representative(data: pa.Table | pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """``data`` laid out as ``schema``: columns reordered, cast up, missing ones null."""
    table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
    names = table.schema.names
    columns: list[pa.ChunkedArray | pa.Array] = []
    for f in schema:
        if f.name not in names:
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(names.index(f.name))
        if column.type != f.type:
            column = pa.chunked_array([conform(c, f.type) for c in column.chunks], f.type)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


def conform(array: pa.Array, target: pa.DataType) -> pa.Array:
    """Cast one array to a promoted ``target`` type (struct fields by name)."""
    if array.type == target:
        return array
    if pa.types.is_struct(target) and pa.types.is_struct(array.type):
        names = [array.type.field(i).name for i in range(array.type.num_fields)]
        children = []
        for i in range(target.num_fields):
            child = target.field(i)
            if child.name in names:
                children.append(conform(array.field(names.index(child.name)), child.type))
            else:
                children.append(pa.nulls(len(array), child.type))
        # field() slices the child to this array's window; the parent's
        # validity is carried over as the new struct's mask.
        return pa.StructArray.from_arrays(
            children, fields=list(target), mask=array.is_null() if array.null_count else None
        )
    try:
        return array.cast(target)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        if target != INCOMPATIBLE:
            raise
        # Incompatible types meet only in the documented text fallback: slow,
        # per value, and only for data that drifted to a foreign type.
        text = [None if v is None else str(v) for v in array.to_pylist()]
        return pa.array(text, INCOMPATIBLE)


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def _promote_int(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    a_signed, b_signed = pa.types.is_signed_integer(a), pa.types.is_signed_integer(b)
    if a_signed == b_signed:
        return a if a.bit_width >= b.bit_width else b
    unsigned, signed = (b, a) if a_signed else (a, b)
    width = max(signed.bit_width, unsigned.bit_width * 2)
    if width > 64:
        return pa.decimal128(20, 0)
    return {8: pa.int8(), 16: pa.int16(), 32: pa.int32(), 64: pa.int64()}[width]


def _promote_other(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    if _is_string(a) and _is_string(b):
        return pa.large_string()
    if (_is_string(a) or _is_binary(a)) and (_is_string(b) or _is_binary(b)):
        return pa.large_binary()
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b) and a.tz == b.tz:
        return a if _UNIT_RANK[a.unit] >= _UNIT_RANK[b.unit] else b
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        merged = representative_schema([pa.schema(list(a)), pa.schema(list(b))])
        return pa.struct(list(merged))
    if _is_list(a) and _is_list(b):
        values = promote(a.value_type, b.value_type)
        both_small = pa.types.is_list(a) and pa.types.is_list(b)
        return pa.list_(values) if both_small else pa.large_list(values)
    return INCOMPATIBLE


def _is_string(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_string_view(t))


def _is_binary(t: pa.DataType) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or pa.types.is_binary_view(t) or pa.types.is_fixed_size_binary(t))


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))
