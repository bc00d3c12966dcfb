"""lake.schema_mode: "strict" refuses a conflicting bundle at ingest (SCHEMA_CONFLICT),
before anything is stored, across restarts; "evolve" (the default) accepts it."""

from __future__ import annotations

import pyarrow as pa
import pytest

from quiverd.client import Client
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.config import loads
from quiverd.kernel.errors import ConfigError, ProtocolError, SchemaConflict
from quiverd.lake.schema_record import SCHEMAS_DIR
from quiverd.protocol.frames import ErrorCode
from tests.daemon.helpers import stored_bundles

STRICT = {"lake.enabled": False, "lake.schema_mode": "strict",
          "segment.max_open_duration_ms": 100}


def _users(values: list[object], t: pa.DataType) -> pa.Table:
    return pa.table({"user": pa.array(values, t), "n": pa.array(range(len(values)), pa.int32())})


def test_schema_mode_strict_refuses_conflict_names_column_and_types(daemon_factory):
    d = daemon_factory(STRICT, in_process=True).start()
    with Client.connect(d.socket) as c:
        first = c.send(_users(["a", "b"], pa.string()), client="web")
        with pytest.raises(SchemaConflict) as refused:
            c.send(_users([1, 2], pa.int32()), client="web")
        # Compatible drift is accepted: int32 → int64, a new column, large_string.
        widened = pa.table({"user": pa.array(["c"], pa.large_string()),
                            "n": pa.array([7], pa.int64()), "extra": [1.5]})
        ok = [c.send(widened, client="web"),
              c.send(_users([5], pa.int32()).rename_columns(["id", "n"]), client="web"),
              c.send(_users(["d"], pa.string()), client="web")]
        # Another slot, another client: their own established schemas.
        ok.append(c.send({1: _users([1], pa.int32())}, client="web"))
        ok.append(c.send(_users([1], pa.int32()), client="api"))
        # After widening, the old int32 'n' still fits; a string 'n' does not.
        with pytest.raises(SchemaConflict) as narrowed:
            c.send(pa.table({"n": ["x"]}), client="web")
    text = str(refused.value)
    assert "'user'" in text and "int32" in text and "string" in text and "'web'" in text
    assert "'n'" in str(narrowed.value) and "int64" in str(narrowed.value)
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    assert set(stored) == {(a.shard, a.sequence) for a in [first, *ok]}  # nothing refused


def test_schema_mode_strict_established_schema_survives_restart(daemon_factory):
    d = daemon_factory(STRICT).start()
    with Client.connect(d.socket) as c:
        c.send(_users(["a"], pa.string()), client="web")
    d.kill()  # the record was durable before the ack
    assert len(list((d.data_dir / SCHEMAS_DIR).iterdir())) == 1
    d.start()
    with Client.connect(d.socket) as c:
        with pytest.raises(SchemaConflict, match="'user' is int64"):
            c.send(_users([1], pa.int64()), client="web")
        c.send(_users(["b"], pa.string()), client="web")  # the connection is still good
        # A column named twice: no lake file could take it; refused, not a closed connection.
        twice = pa.table([pa.array([1]), pa.array([2])], names=["a", "a"])
        with pytest.raises(SchemaConflict, match="names repeat"):
            c.send(twice, client="dupes")
        c.send(_users(["c"], pa.string()), client="web")
    # A damaged record: that (client, slot)'s bundles are refused naming the file, until it
    # is deleted; the next bundle establishes the schema again.
    (record,) = (d.data_dir / SCHEMAS_DIR).glob("*.schema")
    d.kill()
    record.write_bytes(record.read_bytes()[:-3] + b"xyz")
    d.start()
    with Client.connect(d.socket) as c, pytest.raises(ProtocolError) as damaged:
        c.send(_users(["d"], pa.string()), client="web")
    assert damaged.value.code == ErrorCode.INTERNAL and str(record) in str(damaged.value)
    record.unlink()
    with Client.connect(d.socket) as c:
        c.send(_users([1], pa.int64()), client="web")
    assert d.stop() == 0


def test_schema_mode_strict_refuses_staged_bundle_once(daemon_factory):
    d = daemon_factory(STRICT, in_process=True).start()
    tag = TxnTag(job_id="job-1", partition=0, attempt=1, row_offset=0)
    with Client.connect(d.socket) as c:
        c.send(_users(["a"], pa.string()), client="web")
        with pytest.raises(SchemaConflict):
            c.send(_users([1], pa.int32()), client="web", txn=tag)


def test_schema_mode_evolve_accepts_conflicting_bundle(daemon_factory):
    d = daemon_factory({"lake.enabled": False}, in_process=True).start()
    with Client.connect(d.socket) as c:
        c.send(_users(["a"], pa.string()), client="web")
        c.send(_users([1], pa.int32()), client="web")
    assert not (d.data_dir / SCHEMAS_DIR).exists()


def test_schema_mode_bad_value_is_config_error():
    with pytest.raises(ConfigError, match="lake.schema_mode.*'evolve', 'strict'"):
        loads('data_dir = "/x"\n[lake]\nschema_mode = "strcit"\n')
