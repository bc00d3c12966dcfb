"""SchemaCache: schema-only checks once per schema, every per-bundle check every time."""

from __future__ import annotations

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import (
    ReservedColumnName,
    encode_ipc_stream,
    fingerprint,
    inspect_ipc_stream,
)
from quiverd.kernel.schema_cache import SchemaCache


def stream(t: pa.Table, *, compression: str | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, t.schema, options=opts) as w:
        w.write_table(t, max_chunksize=50)
    return sink.getvalue().to_pybytes()


def table(n: int = 120) -> pa.Table:
    return pa.table({"id": pa.array(range(n), pa.int64()), "s": [f"v{i}" for i in range(n)]})


def test_second_bundle_of_a_schema_skips_schema_checks_and_gives_same_facts(monkeypatch):
    cache = SchemaCache()
    payload = stream(table())
    first = cache.inspect(payload)
    full = inspect_ipc_stream(payload)
    calls = []
    import quiverd.kernel.bundle as b

    monkeypatch.setattr(b, "check_field_names", lambda s: calls.append(s))
    monkeypatch.setattr(b, "fingerprint", lambda s: calls.append(s) or b"x" * 32)
    second = cache.inspect(stream(table(77)))
    assert calls == []  # the schema was known: no name check, no fingerprint
    assert (first.rows, first.batches, first.fingerprint) == (full.rows, full.batches,
                                                              full.fingerprint)
    assert (second.rows, second.batches) == (77, 2)
    assert second.schema.equals(first.schema) and second.fingerprint == first.fingerprint
    assert len(cache) == 1


def test_compressed_body_refused_even_when_the_schema_is_known():
    cache = SchemaCache()
    cache.inspect(stream(table()))  # the same schema, uncompressed, is now cached
    with pytest.raises(ValueError, match="compressed IPC bodies"):
        cache.inspect(stream(table(), compression="zstd"))


def test_reserved_column_refused_every_time_and_never_cached():
    cache = SchemaCache()
    bad = stream(pa.table({"_quiver_x": [1, 2]}))
    for _ in range(2):
        with pytest.raises(ReservedColumnName):
            cache.inspect(bad)
    assert len(cache) == 0


def test_bad_batch_bytes_under_a_known_schema_still_fail_validation():
    cache = SchemaCache()
    good = stream(table())
    cache.inspect(good)
    broken = bytearray(good)
    broken[-200:-150] = b"\xff" * 50  # offsets/data of the last batch
    with pytest.raises((pa.ArrowException, ValueError, OSError)):
        cache.inspect(bytes(broken))


def test_dictionary_stream_takes_the_full_path_with_the_same_result():
    cache = SchemaCache()
    t = pa.table({"d": pa.array(["a", "b"] * 30).dictionary_encode()})
    payload = encode_ipc_stream(t)
    for _ in range(2):
        facts = cache.inspect(payload)
        assert (facts.rows, facts.fingerprint) == (60, fingerprint(t.schema))


def test_cache_holds_at_most_capacity_schemas():
    cache = SchemaCache(capacity=3)
    for i in range(5):
        cache.inspect(stream(pa.table({f"c{i}": [1]})))
    assert len(cache) == 3
