"""Representative schemas (quiverd.segment_schema): promotion rules and filling."""

from __future__ import annotations

import pyarrow as pa
import pytest

from quiverd.segments.schema import INCOMPATIBLE, promote, representative_schema, to_representative


@pytest.mark.parametrize(
    ("a", "b", "widest"),
    [
        (pa.int32(), pa.int64(), pa.int64()),
        (pa.uint8(), pa.uint32(), pa.uint32()),
        (pa.uint16(), pa.int16(), pa.int32()),
        (pa.uint64(), pa.int8(), pa.decimal128(20, 0)),
        (pa.int64(), pa.float32(), pa.float64()),
        (pa.float16(), pa.float32(), pa.float32()),
        (pa.utf8(), pa.large_utf8(), pa.large_utf8()),
        (pa.binary(), pa.utf8(), pa.large_binary()),
        (pa.null(), pa.int8(), pa.int8()),
        (pa.timestamp("ms", "UTC"), pa.timestamp("ns", "UTC"), pa.timestamp("ns", "UTC")),
        (pa.timestamp("ms"), pa.timestamp("ms", "UTC"), INCOMPATIBLE),
        (pa.dictionary(pa.uint8(), pa.utf8()), pa.dictionary(pa.uint16(), pa.utf8()),
         pa.dictionary(pa.uint16(), pa.utf8())),
        (pa.dictionary(pa.int8(), pa.utf8()), pa.large_utf8(), pa.large_utf8()),
        (pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.large_list(pa.int64())),
        (pa.int32(), pa.utf8(), INCOMPATIBLE),
    ],
)
def test_promote_widest_type_either_order(
    a: pa.DataType, b: pa.DataType, widest: pa.DataType
) -> None:
    assert promote(a, b) == widest
    assert promote(b, a) == widest


def test_promote_struct_unions_fields_in_first_seen_order() -> None:
    a, b = pa.struct([("x", pa.int8())]), pa.struct([("y", pa.utf8()), ("x", pa.int16())])
    assert promote(a, b) == pa.struct([("x", pa.int16()), ("y", pa.utf8())])
    assert promote(b, a) == pa.struct([("y", pa.utf8()), ("x", pa.int16())])


def test_representative_schema_stable_order_all_nullable() -> None:
    s1 = pa.schema([pa.field("a", pa.int32(), nullable=False), ("b", pa.utf8())])
    s2 = pa.schema([("c", pa.float64()), ("a", pa.int64())])
    rep = representative_schema([s1, s2, s1])
    assert rep.names == ["a", "b", "c"]
    assert rep.field("a").type == pa.int64() and all(f.nullable for f in rep)
    # Folding segment by segment gives the same answer as one pass.
    assert representative_schema([representative_schema([s1]), s2]) == rep


def test_to_representative_fills_missing_and_casts_up() -> None:
    rep = representative_schema([
        pa.schema([("a", pa.int64()), ("s", pa.struct([("x", pa.int8()), ("y", pa.utf8())]))]),
        pa.schema([("k", pa.dictionary(pa.int16(), pa.utf8())), ("z", pa.utf8())]),
    ])
    batch = pa.record_batch({
        "z": pa.array([7, None], pa.int32()),  # int32 + utf8: the text fallback
        "a": pa.array([1, 2], pa.int8()),
        "s": pa.array([{"x": 1}, None], pa.struct([("x", pa.int8())])),
        "k": pa.array(["p", "q"]).dictionary_encode(),
    })
    out = to_representative(batch, rep)
    assert out.schema == rep
    assert out.to_pydict() == {
        "a": [1, 2], "s": [{"x": 1, "y": None}, None], "k": ["p", "q"], "z": ["7", None],
    }
    missing = to_representative(pa.table({"a": [5]}), rep)
    assert missing.column("k").null_count == 1 and missing.column("a").to_pylist() == [5]
