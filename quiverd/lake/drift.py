"""One representative schema per lake file, out of the drifting schemas of its bundles.

Producers drift (design doc 003): an optional column appears in some batches only, a
string column arrives as dictionary<uint8, utf8>, then dictionary<uint16, utf8> once
its cardinality grows, then as plain utf8 past a threshold. A Parquet file has one
schema, so the uploader folds the schema of every table it appends into the file's
*representative* schema with ``unify`` and lays each table out as that schema with
``conform``. When ``unify`` returns None the file is rotated and a new one starts with
``normalize(incoming)``.

Rules, applied recursively to struct fields and list values:

    columns            union by name; order = first seen, new ones appended at the end
    nullability        every field nullable (a column missing from a table is null there)
    dictionary<I, V>   a top-level dictionary column stays one, with int32 indices:
                       dictionary<uint8, utf8> + dictionary<uint16, utf8> is
                       dictionary<int32, utf8> (written as is: no decode, no re-encode);
                       with plain V anywhere, plain V (Parquet dictionary-encodes on its
                       own). Nested dictionaries are represented by their values.
    null + T           T
    int + int          int8 < int16 < int32 < int64, uint8 < uint16 < uint32 < uint64;
                       signed + unsigned: the smallest signed int holding both
                       (uint64 + any signed: not unifiable)
    float + float      float16 < float32 < float64
    int + float        float64
    utf8 + large_utf8  large_utf8;  binary + large_binary: large_binary
    timestamps         same time zone (compared as written): the finest unit, s < ms < us < ns
    struct + struct    union of fields by name, unified
    list + list        list of unified values (list + large_list: large_list)
    anything else      equal, or not unifiable (utf8 vs int64, timestamps of different tz)

Nanoseconds. A producer's timestamp[ns] column (any time zone, top level or nested) is
cast to timestamp[us] (same zone) by ``micros_where_lossless`` before its table meets
the file's schema, when every value of that table's column is a whole microsecond (nulls
do not count); otherwise the column stays ns, as sent, and the file holding it is not
projected into Iceberg (``has_ns_timestamps``; Iceberg v2 and Spark have no ns). A table
whose ns column stays ns, next to a file that took the column as us, unifies to ns: the
uploader rotates a file whose first row group is written (its schema is frozen), as for
any widening. Which columns to try is decided once per schema (cached); the check is
Arrow's safe cast, one vectorised pass over each ns column, no Python per row.

Metadata (schema and field level) is dropped: quiverd puts its own key-value metadata in
the Parquet footer, and ``schema_hash`` must not depend on what a producer attached.
A schema naming a column twice cannot be laid out by name: ``normalize`` and ``unify``
raise ValueError for it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable

import pyarrow as pa

_SIGNED = {8: pa.int8(), 16: pa.int16(), 32: pa.int32(), 64: pa.int64()}
_UNIT_RANK = {"s": 0, "ms": 1, "us": 2, "ns": 3}
# Bumped if the canonical form below ever changes, so old and new hashes never collide.
_HASH_VERSION = "quiverd.schema.v1"
_SCHEMAS_CACHED = 256  # distinct table schemas whose ns columns are remembered

TypePredicate = Callable[[pa.DataType], bool]


def unify(current: pa.Schema | None, incoming: pa.Schema) -> pa.Schema | None:
    """The representative schema covering ``current`` and ``incoming``, or None when
    they cannot be unified (the rules in the module doc)."""
    new = normalize(incoming)
    if current is None:
        return new
    fields = _union({f.name: f.type for f in normalize(current)},
                    [(f.name, f.type) for f in new], _unify_top)
    return None if fields is None else pa.schema([pa.field(n, t) for n, t in fields.items()])


def conflict(current: pa.Schema, incoming: pa.Schema
             ) -> tuple[str, pa.DataType, pa.DataType] | None:
    """The first top-level column of ``incoming`` whose type cannot be unified with its
    type in ``current``: (name, type in ``current``, type in ``incoming``), or None."""
    before = {f.name: f.type for f in normalize(current)}
    for f in normalize(incoming):
        seen = before.get(f.name)
        if seen is not None and _unify_top(seen, f.type) is None:
            return f.name, seen, f.type
    return None


def micros_where_lossless(table: pa.Table) -> pa.Table:
    """``table`` with each column holding timestamp[ns] cast to timestamp[us] (same time
    zone, nested ones too) when no value loses precision; a column with a value that
    is not a whole microsecond is left as it is (see the module doc)."""
    targets = _micros_targets(table.schema)
    for i, target in targets:
        try:
            cast = table.column(i).cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue  # a sub-microsecond value (or no cast kernel): the column stays ns
        old = table.schema.field(i)
        table = table.set_column(i, pa.field(old.name, target, old.nullable, old.metadata),
                                 cast)
    return table


def has_ns_timestamps(schema: pa.Schema) -> bool:
    """Does ``schema`` hold a timestamp[ns] anywhere (nested too)? A lake file that does
    is read by quiverd but not projected into Iceberg (SPEC §6)."""
    return any(_as_micros(f.type) is not None for f in schema)


def normalize(schema: pa.Schema) -> pa.Schema:
    """``schema`` under the rules of one file: dictionaries as their value types, every
    field nullable, no metadata."""
    _check_unique(schema.names, "column")
    return pa.schema([pa.field(f.name, _normalize_top(f.type)) for f in schema])


def _normalize_top(t: pa.DataType) -> pa.DataType:
    """A top-level column keeps its dictionary (indices widened to int32)."""
    if pa.types.is_dictionary(t):
        return pa.dictionary(pa.int32(), _normalize_type(t.value_type))
    return _normalize_type(t)


def conform(table: pa.Table | pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """``table`` laid out as ``schema`` (a ``unify`` result covering it): columns
    reordered, dictionaries decoded, types widened by safe casts, missing columns null."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    names = table.schema.names
    extra = set(names) - set(schema.names)
    assert not extra, f"columns {sorted(extra)} are not in the file schema: unify() first"
    columns: list[pa.ChunkedArray | pa.Array] = []
    for f in schema:
        if f.name not in names:
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table.column(f.name)
        # Arrow's cast decodes dictionaries (nested ones too), matches struct fields by
        # name and fills the missing ones with nulls; ``safe`` refuses any lossy value,
        # except integers into float64: unify chose float64 for ints mixed with floats,
        # and rounding past 2**53 is what a float64 column means (refusing would leave
        # the rows nowhere).
        safe = not (pa.types.is_integer(column.type) and pa.types.is_floating(f.type))
        columns.append(column if column.type == f.type else column.cast(f.type, safe=safe))
    return pa.Table.from_arrays(columns, schema=schema)


def schema_hash(schema: pa.Schema) -> str:
    """Hex SHA-256 of ``schema``'s canonical form: names, types, nullability and order,
    no metadata. Equal schemas hash alike in every process."""
    canonical = [_HASH_VERSION, [_canonical_field(f) for f in schema]]
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _normalize_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(t):
        return _normalize_type(t.value_type)
    if pa.types.is_struct(t):
        children = [t.field(i) for i in range(t.num_fields)]
        _check_unique([c.name for c in children], "struct field")
        return pa.struct([pa.field(c.name, _normalize_type(c.type)) for c in children])
    if pa.types.is_map(t):
        # A map's keys are never null: only its items become nullable.
        key = pa.field(t.key_field.name, _normalize_type(t.key_type), nullable=False)
        item = pa.field(t.item_field.name, _normalize_type(t.item_type))
        return pa.map_(key, item, keys_sorted=t.keys_sorted)
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_normalize_value_field(t.value_field), t.list_size)
    if pa.types.is_large_list(t):
        return pa.large_list(_normalize_value_field(t.value_field))
    if pa.types.is_list(t):
        return pa.list_(_normalize_value_field(t.value_field))
    return t


def _normalize_value_field(value: pa.Field) -> pa.Field:
    return pa.field(value.name, _normalize_type(value.type))


def _unify_top(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """Top-level columns: dictionaries stay dictionaries while both sides are."""
    a_dict, b_dict = pa.types.is_dictionary(a), pa.types.is_dictionary(b)
    if a_dict and b_dict:
        values = _unify_type(a.value_type, b.value_type)
        return None if values is None else pa.dictionary(pa.int32(), values)
    return _unify_type(a.value_type if a_dict else a, b.value_type if b_dict else b)


def _unify_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type holding values of both normalized types ``a`` and ``b``, or None."""
    if a == b:
        return a
    if pa.types.is_null(a) or pa.types.is_null(b):
        return b if pa.types.is_null(a) else a
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return _unify_int(a, b)
    if _is_number(a) and _is_number(b):
        if pa.types.is_floating(a) and pa.types.is_floating(b):
            return a if a.bit_width >= b.bit_width else b
        return pa.float64()
    if _both(a, b, pa.types.is_string, pa.types.is_large_string):
        return pa.large_string()
    if _both(a, b, pa.types.is_binary, pa.types.is_large_binary):
        return pa.large_binary()
    if pa.types.is_timestamp(a) and pa.types.is_timestamp(b):
        if a.tz != b.tz:
            return None
        return a if _UNIT_RANK[a.unit] >= _UNIT_RANK[b.unit] else b
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return _unify_struct(a, b)
    if _both(a, b, pa.types.is_list, pa.types.is_large_list):
        return _unify_list(a, b)
    return None


def _unify_int(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    a_signed, b_signed = pa.types.is_signed_integer(a), pa.types.is_signed_integer(b)
    if a_signed == b_signed:
        return a if a.bit_width >= b.bit_width else b
    signed, unsigned = (a, b) if a_signed else (b, a)
    # An unsigned int of n bits needs a signed int of 2n bits; uint64 fits none.
    width = max(signed.bit_width, unsigned.bit_width * 2)
    return _SIGNED.get(width)


def _unify_struct(a: pa.StructType, b: pa.StructType) -> pa.DataType | None:
    fields = _union({a.field(i).name: a.field(i).type for i in range(a.num_fields)},
                    [(b.field(i).name, b.field(i).type) for i in range(b.num_fields)],
                    _unify_type)
    return None if fields is None else pa.struct([pa.field(n, t) for n, t in fields.items()])


def _union(fields: dict[str, pa.DataType], more: list[tuple[str, pa.DataType]],
           combine: Callable[[pa.DataType, pa.DataType], pa.DataType | None]
           ) -> dict[str, pa.DataType] | None:
    """Columns (or struct fields) by name, first seen first, each type combined with the
    one already there; None when one pair cannot be combined."""
    for name, t in more:
        seen = fields.get(name)
        unified = t if seen is None else combine(seen, t)
        if unified is None:
            return None
        fields[name] = unified
    return fields


def _unify_list(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    values = _unify_type(a.value_type, b.value_type)
    if values is None:
        return None
    # The first seen list's value field name is kept ("item", "element", ...).
    value = pa.field(a.value_field.name, values)
    if pa.types.is_large_list(a) or pa.types.is_large_list(b):
        return pa.large_list(value)
    return pa.list_(value)


def _both(a: pa.DataType, b: pa.DataType, small: TypePredicate, large: TypePredicate) -> bool:
    """Both types are of the family made of the ``small`` and ``large`` predicates."""
    return bool((small(a) or large(a)) and (small(b) or large(b)))


def _is_number(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def _check_unique(names: list[str], what: str) -> None:
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{what} names repeat: {dupes}; a lake file needs unique names")


@functools.lru_cache(maxsize=_SCHEMAS_CACHED)
def _micros_targets(schema: pa.Schema) -> tuple[tuple[int, pa.DataType], ...]:
    """(index, type with ns as us) of each column of ``schema`` holding ns: the
    schema-only half of ``micros_where_lossless``, a pure function, so memoized."""
    found = ((i, _as_micros(f.type)) for i, f in enumerate(schema))
    return tuple((i, t) for i, t in found if t is not None)


def _as_micros(t: pa.DataType) -> pa.DataType | None:
    """``t`` with every timestamp[ns] in it as timestamp[us]; None when it has none."""
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz=t.tz) if t.unit == "ns" else None
    if pa.types.is_dictionary(t):
        values = _as_micros(t.value_type)
        return None if values is None else pa.dictionary(t.index_type, values, t.ordered)
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        changed = [_as_micros(f.type) for f in fields]
        if all(c is None for c in changed):
            return None
        return pa.struct([f if c is None else f.with_type(c)
                          for f, c in zip(fields, changed, strict=True)])
    if pa.types.is_map(t):
        key, item = _as_micros(t.key_type), _as_micros(t.item_type)
        if key is None and item is None:
            return None
        return pa.map_(t.key_field.with_type(key or t.key_type),
                       t.item_field.with_type(item or t.item_type), keys_sorted=t.keys_sorted)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        values = _as_micros(t.value_type)
        if values is None:
            return None
        field = t.value_field.with_type(values)
        if pa.types.is_fixed_size_list(t):
            return pa.list_(field, t.list_size)
        return pa.large_list(field) if pa.types.is_large_list(t) else pa.list_(field)
    return None


def _canonical_field(f: pa.Field) -> list[object]:
    return [f.name, _canonical_type(f.type), f.nullable]


def _canonical_type(t: pa.DataType) -> object:
    """A JSON-able description of ``t``. Leaves use Arrow's own spelling
    (``timestamp[ns, tz=UTC]``); list and map child names are left out because Arrow
    does not compare them either."""
    if pa.types.is_struct(t):
        return ["struct", [_canonical_field(t.field(i)) for i in range(t.num_fields)]]
    if pa.types.is_dictionary(t):
        return ["dictionary", str(t.index_type), _canonical_type(t.value_type), t.ordered]
    if pa.types.is_map(t):
        return ["map", _canonical_type(t.key_type), _canonical_type(t.item_type),
                t.item_field.nullable, t.keys_sorted]
    if pa.types.is_fixed_size_list(t):
        return ["fixed_size_list", t.list_size, _canonical_type(t.value_type),
                t.value_field.nullable]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        kind = "large_list" if pa.types.is_large_list(t) else "list"
        return [kind, _canonical_type(t.value_type), t.value_field.nullable]
    return str(t)
