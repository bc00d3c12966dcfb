"""lake.drift: representative schemas, conforming tables, schema hashes; and a seeded
loop writing drifting tables through ActiveFile and reading them back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.lake.drift import conform, normalize, schema_hash, unify
from quiverd.lake.parquet import ActiveFile, ParquetSettings


def _unify_types(*types: pa.DataType) -> pa.DataType | None:
    schema: pa.Schema | None = None
    for t in types:
        schema = unify(schema, pa.schema([pa.field("c", t)]))
        if schema is None:
            return None
    assert schema is not None
    return schema.field("c").type


def test_unify_dictionaries_stay_dictionaries_with_int32_indices() -> None:
    words = pa.array(["a", "b", None, "a"]).dictionary_encode()
    t8 = pa.table({"s": words.cast(pa.dictionary(pa.uint8(), pa.string()))})
    t16 = pa.table({"s": pa.array(["c", "a"]).dictionary_encode().cast(
        pa.dictionary(pa.uint16(), pa.string()))})
    schema = unify(unify(None, t8.schema), t16.schema)
    assert schema == pa.schema([pa.field("s", pa.dictionary(pa.int32(), pa.string()))])
    both = pa.concat_tables([conform(t8, schema), conform(t16, schema)])
    assert both["s"].to_pylist() == ["a", "b", None, "a", "c", "a"]
    # Written as is (each chunk its own dictionary) and read back as the same values.
    sink = pa.BufferOutputStream()
    pq.write_table(both, sink)
    back = pq.read_table(pa.BufferReader(sink.getvalue()))
    assert back["s"].to_pylist() == ["a", "b", None, "a", "c", "a"]


def test_unify_dictionaries_and_plain_utf8_become_utf8() -> None:
    words = ["a", "b", None, "a"]
    tables = [
        pa.table({"s": pa.array(words).dictionary_encode().cast(
            pa.dictionary(pa.uint8(), pa.string()))}),
        pa.table({"s": pa.array(words).dictionary_encode().cast(
            pa.dictionary(pa.uint16(), pa.string()))}),
        pa.table({"s": pa.array(words)}),
    ]
    schema = None
    for t in tables:
        schema = unify(schema, t.schema)
    assert schema == pa.schema([pa.field("s", pa.string())])
    for t in tables:
        out = conform(t, schema)
        assert out.schema == schema
        assert out.column("s").to_pylist() == words


def test_conform_fills_nulls_when_optional_column_missing() -> None:
    full = pa.table({"a": [1, 2], "opt": ["x", "y"]})
    short = pa.table({"a": [3]})
    schema = unify(unify(None, full.schema), short.schema)
    assert schema is not None
    assert conform(short, schema).to_pylist() == [{"a": 3, "opt": None}]


def test_unify_appends_new_column_at_end_when_first_seen_later() -> None:
    first = pa.schema([("b", pa.int64()), ("a", pa.int64())])
    later = pa.schema([("c", pa.string()), ("a", pa.int64())])
    schema = unify(first, later)
    assert schema is not None
    assert schema.names == ["b", "a", "c"]
    batch = pa.record_batch({"c": ["z"], "a": [1]})
    assert conform(batch, schema).to_pylist() == [{"b": None, "a": 1, "c": "z"}]


@pytest.mark.parametrize(("a", "b", "expected"), [
    (pa.int32(), pa.int64(), pa.int64()),
    (pa.int64(), pa.int8(), pa.int64()),
    (pa.uint8(), pa.uint32(), pa.uint32()),
    (pa.uint8(), pa.int8(), pa.int16()),
    (pa.int8(), pa.uint16(), pa.int32()),
    (pa.uint32(), pa.int16(), pa.int64()),
    (pa.int32(), pa.float32(), pa.float64()),
    (pa.uint64(), pa.float16(), pa.float64()),
    (pa.float16(), pa.float32(), pa.float32()),
    (pa.float64(), pa.float32(), pa.float64()),
    (pa.string(), pa.large_string(), pa.large_string()),
    (pa.large_binary(), pa.binary(), pa.large_binary()),
    (pa.null(), pa.int8(), pa.int8()),
    (pa.date32(), pa.null(), pa.date32()),
    (pa.list_(pa.int8()), pa.large_list(pa.int32()), pa.large_list(pa.int32())),
])
def test_unify_widens_types_when_compatible(a: pa.DataType, b: pa.DataType,
                                            expected: pa.DataType) -> None:
    assert _unify_types(a, b) == expected
    assert _unify_types(b, a) == expected


@pytest.mark.parametrize(("a", "b"), [
    (pa.uint64(), pa.int64()),
    (pa.uint64(), pa.int8()),
    (pa.string(), pa.int64()),
    (pa.string(), pa.binary()),
    (pa.timestamp("ms", "UTC"), pa.timestamp("ms", "Europe/Paris")),
    (pa.timestamp("ms", "UTC"), pa.timestamp("ms")),
    (pa.date32(), pa.date64()),
    (pa.list_(pa.int8()), pa.list_(pa.string())),
])
def test_unify_returns_none_when_types_conflict(a: pa.DataType, b: pa.DataType) -> None:
    assert _unify_types(a, b) is None
    assert _unify_types(b, a) is None


def test_unify_widens_timestamps_to_finest_unit_when_tz_matches() -> None:
    assert _unify_types(pa.timestamp("s", "UTC"), pa.timestamp("us", "UTC"),
                        pa.timestamp("ms", "UTC")) == pa.timestamp("us", "UTC")
    seconds = pa.table({"c": pa.array([1, None], pa.timestamp("s", "UTC"))})
    schema = pa.schema([pa.field("c", pa.timestamp("ns", "UTC"))])
    assert conform(seconds, schema).column("c").cast(pa.int64()).to_pylist() == [10**9, None]


def test_unify_unions_struct_fields_when_nested_types_drift() -> None:
    a = pa.struct([("x", pa.int8()), ("name", pa.dictionary(pa.uint8(), pa.string()))])
    b = pa.struct([("y", pa.string()), ("x", pa.int32())])
    unified = _unify_types(a, b)
    assert unified == pa.struct([("x", pa.int32()), ("name", pa.string()), ("y", pa.string())])
    assert _unify_types(a, pa.struct([("x", pa.string())])) is None
    table = pa.table({"c": pa.array([{"y": "q", "x": 7}, None], b)})
    out = conform(table, pa.schema([pa.field("c", unified)]))
    assert out.column("c").to_pylist() == [{"x": 7, "name": None, "y": "q"}, None]


def test_normalize_makes_fields_nullable_and_drops_metadata() -> None:
    schema = pa.schema(
        [pa.field("k", pa.dictionary(pa.int8(), pa.large_string()), nullable=False,
                  metadata={"m": "1"}),
         pa.field("s", pa.struct([pa.field("i", pa.int8(), nullable=False)]), nullable=False)],
        metadata={"producer": "x"})
    out = normalize(schema)
    assert out.metadata is None
    assert out.field("k").metadata is None
    assert out == pa.schema([("k", pa.dictionary(pa.int32(), pa.large_string())),
                             ("s", pa.struct([("i", pa.int8())]))])
    assert all(f.nullable for f in out) and out.field("s").type.field("i").nullable


def test_normalize_raises_when_column_names_repeat() -> None:
    schema = pa.schema([("a", pa.int8()), ("a", pa.int16())])
    with pytest.raises(ValueError, match="repeat"):
        normalize(schema)


def test_conform_asserts_when_column_not_in_schema() -> None:
    with pytest.raises(AssertionError, match="unify"):
        conform(pa.table({"a": [1], "b": [2]}), pa.schema([("a", pa.int64())]))


def test_conform_raises_when_value_does_not_fit() -> None:
    # unify never narrows, so this only happens when a caller skips it.
    with pytest.raises(pa.ArrowInvalid):
        conform(pa.table({"a": pa.array([300], pa.int32())}), pa.schema([("a", pa.int8())]))


def test_conform_rounds_large_ints_into_float64_when_unified_with_floats() -> None:
    big = 2**53 + 1  # not representable in float64: a safe cast would refuse it
    schema = unify(pa.schema([("a", pa.float64())]), pa.schema([("a", pa.int64())]))
    assert schema is not None and schema.field("a").type == pa.float64()
    out = conform(pa.table({"a": pa.array([big, 1], pa.int64())}), schema)
    assert out["a"].to_pylist() == [float(big), 1.0]


GOLDEN_HASH = "0af2df0f82c5b820c5bec50e96a68dcbee4a64ae6beecbb205241e171a88c743"


def test_schema_hash_stable_when_metadata_differs() -> None:
    schema = pa.schema([("a", pa.int64()), ("t", pa.timestamp("ns", "UTC")),
                        ("s", pa.struct([("x", pa.list_(pa.string()))]))])
    # A golden value: the hash must not change across processes or releases.
    assert schema_hash(schema) == GOLDEN_HASH
    assert schema_hash(schema.with_metadata({"k": "v"})) == schema_hash(schema)


def test_schema_hash_differs_when_type_name_order_or_nullability_change() -> None:
    base = pa.schema([("a", pa.int64()), ("b", pa.string())])
    variants = [
        pa.schema([("a", pa.int32()), ("b", pa.string())]),
        pa.schema([("b", pa.string()), ("a", pa.int64())]),
        pa.schema([("a", pa.int64()), ("c", pa.string())]),
        pa.schema([pa.field("a", pa.int64(), nullable=False), ("b", pa.string())]),
        pa.schema([("a", pa.int64()), ("b", pa.large_string())]),
    ]
    hashes = {schema_hash(base), *(schema_hash(v) for v in variants)}
    assert len(hashes) == 1 + len(variants)


# ---- seeded property loop: drifting tables -> unify/conform -> ActiveFile -> read back ----

_UTF8_TYPES = [pa.string(), pa.large_string(), pa.dictionary(pa.uint8(), pa.string()),
               pa.dictionary(pa.uint16(), pa.string()), pa.dictionary(pa.int32(), pa.string())]
_COLUMNS: dict[str, list[pa.DataType]] = {
    "id": [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16()],
    "x": [pa.float16(), pa.float32(), pa.float64(), pa.int32()],
    "name": _UTF8_TYPES,
    "blob": [pa.binary(), pa.large_binary()],
    "ts": [pa.timestamp(u, "UTC") for u in ("s", "ms", "us", "ns")],
    "tags": [pa.struct([("a", pa.int16()), ("b", pa.string())]),
             pa.struct([("b", pa.dictionary(pa.uint8(), pa.string()))]),
             pa.struct([("c", pa.int8()), ("a", pa.int32())])],
    "empty": [pa.null()],
}


def _value(rng: random.Random, t: pa.DataType) -> Any:
    if rng.random() < 0.2:
        return None
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        return rng.randint(0, 100)
    if pa.types.is_floating(t):
        return rng.randint(-200, 200) / 2  # exact in float16 and up
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return rng.choice(["alpha", "beta", "gamma", "δ"])
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return rng.randbytes(rng.randint(0, 4))
    if pa.types.is_struct(t):
        return {t.field(i).name: _value(rng, t.field(i).type) for i in range(t.num_fields)}
    return None


def _random_table(rng: random.Random) -> pa.Table:
    names = rng.sample(sorted(_COLUMNS), rng.randint(1, len(_COLUMNS)))
    rows = rng.randint(0, 30)
    columns = {}
    for name in names:
        t = rng.choice(_COLUMNS[name])
        if name == "id" and rng.random() < 0.08:
            t = pa.string()  # a producer changing a column's type: the file rotates
        values = [_value(rng, t) for _ in range(rows)]
        if pa.types.is_dictionary(t):
            columns[name] = pa.array(values, t.value_type).dictionary_encode().cast(t)
        else:
            columns[name] = pa.array(values, t)
    return pa.table(columns)


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    """Rows as Python values, timestamps as ns ints (to_pylist refuses ns datetimes)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_timestamp(f.type):
            ns = table.column(i).cast(pa.timestamp("ns", f.type.tz)).cast(pa.int64())
            table = table.set_column(i, f.name, ns)
        elif pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(f.type.value_type))
    return table.to_pylist()


def _expected(row: dict[str, Any], schema: pa.Schema) -> dict[str, Any]:
    return {f.name: _fill(row.get(f.name), f.type) for f in schema}


def _fill(value: Any, t: pa.DataType) -> Any:
    if value is None or not pa.types.is_struct(t):
        return value
    return {t.field(i).name: _fill(value.get(t.field(i).name), t.field(i).type)
            for i in range(t.num_fields)}


def _write(path: Path, schema: pa.Schema, tables: list[pa.Table]) -> None:
    settings = ParquetSettings(bloom_filter_columns=("name",), row_group_rows=16)
    active = ActiveFile.create(path, schema, settings, metadata={}, time_column="_ts")
    for table in tables:
        active.append(conform(table, schema))
    assert active.close().rows == sum(t.num_rows for t in tables)


def test_drifting_tables_read_back_equal_when_written_through_unify_and_conform(
        tmp_path: Path) -> None:
    # Like the uploader: tables buffer while unify() covers them, then one file takes
    # them all under the representative schema; a conflict (None) rotates to a new file.
    rng = random.Random(20240611)
    files: list[tuple[Path, list[pa.Table]]] = []
    schema: pa.Schema | None = None
    pending: list[pa.Table] = []
    for n in range(80):
        table = _random_table(rng)
        # Every table carries the time column, as the uploader adds _quiver_ingested_at.
        table = table.append_column("_ts", pa.array([n] * table.num_rows, pa.int64()))
        unified = unify(schema, table.schema)
        if unified is None:
            assert schema is not None
            files.append((tmp_path / f"f{len(files)}.parquet", pending))
            _write(files[-1][0], schema, pending)
            unified, pending = normalize(table.schema), []
        schema = unified
        pending.append(table)
    assert schema is not None
    files.append((tmp_path / f"f{len(files)}.parquet", pending))
    _write(files[-1][0], schema, pending)
    assert len(files) >= 3
    for path, originals in files:
        back = pq.read_table(path)
        want = [_expected(r, back.schema) for t in originals for r in _rows(t)]
        assert _rows(back) == want
