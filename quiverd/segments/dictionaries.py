"""Dictionary columns inside a segment stream: unify at finalize, restore on read.

An Arrow IPC *file* allows one dictionary per column, but producers send a new
dictionary with every batch. At finalize each top-level dictionary column of a
stream is rebuilt against one vocabulary U (first-seen order over the chunks'
dictionaries), and the index type widens (u8 → u16 → u32 → u64; i8 → i16 →
i32 → i64 for signed producers) when U outgrows it. Past the configured
cardinality the column is stored as its plain value type instead.

To give every bundle back exactly as sent, each chunk keeps a *map*: for every
entry j of the chunk's original dictionary D, ``map[j]`` = position of D[j] in
U. Reading inverts it: D = U.take(map), original index = inverse(map)[stored
index]. A null map means "D is U itself" (the common case: a producer that
resends the same dictionary), so only the index type is cast back. A column
stored plain is re-encoded with ``dictionary_encode`` (first-appearance order,
what Arrow builders and ``dictionary_encode`` produce).

Known limits, by design: a dictionary holding the same value twice, or a null
value referenced by a valid index, reads back with equal values but a
different dictionary layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

_SIGNED = (pa.int8(), pa.int16(), pa.int32(), pa.int64())
_UNSIGNED = (pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64())


@dataclass(frozen=True, slots=True)
class UnifiedColumn:
    """One dictionary column of a stream after unification.

    ``chunks`` are the stored arrays (dictionary or plain); ``maps`` holds one
    entry per chunk: the int32 map described in the module doc, or None.
    """

    field: pa.Field
    chunks: list[pa.Array]
    maps: list[pa.Array | None]


def widen_index_type(index_type: pa.DataType, cardinality: int) -> pa.DataType:
    """Smallest index type of the same signedness, at least ``index_type``, for
    ``cardinality`` distinct values (never narrows: readers cast back anyway)."""
    ladder = _SIGNED if pa.types.is_signed_integer(index_type) else _UNSIGNED
    for candidate in ladder[ladder.index(index_type):]:
        signed_bit = 1 if candidate in _SIGNED else 0
        if cardinality - 1 <= (1 << (candidate.bit_width - signed_bit)) - 1:
            return candidate
    raise ValueError(f"{cardinality} dictionary values do not fit any {index_type} widening")


def is_unifiable(field: pa.Field) -> bool:
    """Only hashable value types can be unified (pc.unique / index_in)."""
    value_type = field.type.value_type
    return not pa.types.is_nested(value_type) and not pa.types.is_dictionary(value_type)


def has_dictionary(data_type: pa.DataType) -> bool:
    """Does ``data_type`` contain a dictionary anywhere (itself included)?"""
    if pa.types.is_dictionary(data_type):
        return True
    return any(has_dictionary(data_type.field(i).type) for i in range(data_type.num_fields))


def unify_column(
    field: pa.Field, chunks: Sequence[pa.DictionaryArray], max_cardinality: int
) -> UnifiedColumn:
    """Rebuild one dictionary column's chunks over a single vocabulary."""
    dtype = field.type
    first = chunks[0].dictionary
    if all(c.dictionary.equals(first) for c in chunks[1:]):
        # Fast path: every chunk already shares one dictionary (fixed-vocabulary
        # producers); the chunks are written untouched.
        if len(first) > max_cardinality:
            return _plain(field, chunks)
        return UnifiedColumn(field, list(chunks), [None] * len(chunks))
    # One hash pass over all chunk dictionaries yields both the vocabulary
    # (first-seen order) and every chunk's map, back to back.
    encoded = pc.dictionary_encode(
        pa.concat_arrays([c.dictionary for c in chunks]), null_encoding="encode"
    )
    vocabulary = encoded.dictionary
    if len(vocabulary) > max_cardinality:
        return _plain(field, chunks)
    index_type = widen_index_type(dtype.index_type, len(vocabulary))
    stored: list[pa.Array] = []
    maps: list[pa.Array | None] = []
    start = 0
    for chunk in chunks:
        mapping = encoded.indices.slice(start, len(chunk.dictionary))
        start += len(chunk.dictionary)
        if len(mapping) == len(vocabulary) and chunk.dictionary.equals(vocabulary):
            maps.append(None)
            indices = chunk.indices.cast(index_type)
        else:
            maps.append(mapping)
            indices = pc.take(mapping, chunk.indices).cast(index_type)
        stored.append(pa.DictionaryArray.from_arrays(indices, vocabulary, ordered=dtype.ordered))
    stored_type = pa.dictionary(index_type, dtype.value_type, dtype.ordered)
    return UnifiedColumn(field.with_type(stored_type), stored, maps)


def _plain(field: pa.Field, chunks: Sequence[pa.DictionaryArray]) -> UnifiedColumn:
    """Cardinality fallback: the column is stored as its value type."""
    plain = [c.dictionary_decode() for c in chunks]
    return UnifiedColumn(field.with_type(field.type.value_type), plain, [None] * len(chunks))


def unify_batches(
    schema: pa.Schema, batches: Sequence[pa.RecordBatch], max_cardinality: int
) -> tuple[pa.Schema, list[pa.RecordBatch], list[list[pa.Array | None]]]:
    """Unify every top-level dictionary column of one stream.

    Returns the stored schema, the stored batches and, per batch, the maps of
    its dictionary columns in field order. Non-dictionary columns are never
    copied: stored batches reuse their arrays.
    """
    positions = [i for i, f in enumerate(schema) if pa.types.is_dictionary(f.type)]
    if not positions:
        return schema, list(batches), [[] for _ in batches]
    columns = [list(b.columns) for b in batches]
    maps: list[list[pa.Array | None]] = [[] for _ in batches]
    stored_schema = schema
    for i in positions:
        unified = unify_column(schema.field(i), [b.column(i) for b in batches], max_cardinality)
        stored_schema = stored_schema.set(i, unified.field)
        for k, chunk in enumerate(unified.chunks):
            columns[k][i] = chunk
            maps[k].append(unified.maps[k])
    stored = [pa.RecordBatch.from_arrays(cols, schema=stored_schema) for cols in columns]
    return stored_schema, stored, maps


def restore_batch(
    batch: pa.RecordBatch, original: pa.Schema, maps: Sequence[pa.Array | None]
) -> pa.RecordBatch:
    """Turn a stored chunk back into the batch the producer sent (``original``
    carries its exact types and metadata)."""
    columns = batch.columns
    k = 0
    for i, field in enumerate(original):
        if pa.types.is_dictionary(field.type):
            mapping = maps[k] if k < len(maps) else None
            k += 1
            if columns[i].type != field.type or mapping is not None:
                columns[i] = restore_column(columns[i], field.type, mapping)
    return pa.RecordBatch.from_arrays(columns, schema=original)


def restore_column(
    stored: pa.Array, dtype: pa.DictionaryType, mapping: pa.Array | None
) -> pa.DictionaryArray:
    """One dictionary column back to its original dictionary and index type."""
    if not pa.types.is_dictionary(stored.type):
        # Stored plain (cardinality fallback): re-encode in first-appearance order.
        encoded = pc.dictionary_encode(stored)
        dictionary = encoded.dictionary.cast(dtype.value_type)
        return pa.DictionaryArray.from_arrays(
            encoded.indices.cast(dtype.index_type), dictionary, ordered=dtype.ordered
        )
    if mapping is None:
        indices = stored.indices.cast(dtype.index_type)
        dictionary = stored.dictionary
    else:
        dictionary = stored.dictionary.take(mapping)
        # inverse[u] = original position j with mapping[j] == u.
        inverse = pc.inverse_permutation(
            mapping, max_index=max(len(stored.dictionary) - 1, 0), output_type=pa.int64()
        )
        indices = pc.take(inverse, stored.indices).cast(dtype.index_type)
    return pa.DictionaryArray.from_arrays(indices, dictionary, ordered=dtype.ordered)


def needs_solo_stream(schema: pa.Schema) -> bool:
    """Dictionaries we cannot unify (nested ones) force one stream per chunk."""
    for f in schema:
        if pa.types.is_dictionary(f.type):
            if not is_unifiable(f):
                return True
        elif has_dictionary(f.type):
            return True
    return False
