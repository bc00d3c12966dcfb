"""The dead-letter Iceberg tables (quiverd/lake/iceberg/dead_letters.py) on a real SQLite
catalog and fs warehouse: adds are idempotent by location, removes take files out, one
table per client beside the projection's ``quiver`` namespace, history stays bounded."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from quiverd.kernel.bundle import read_ipc_stream
from quiverd.kernel.config import IcebergConfig, StoreConfig
from quiverd.lake import dead_letters as dl
from quiverd.lake.iceberg import Projection, location, warehouse
from quiverd.lake.iceberg.dead_letters import DEAD_LETTER_NAMESPACE, DeadLetterTables
from quiverd.lake.iceberg.names import parse_table_name

INGESTED_NS = 1_796_000_000_000_000_000


def write_letter(data_dir: Path, client: str, bundle: int, table: pa.Table) -> str:
    """A dead-letter object in the fs store as the uploader writes it; its location."""
    key = dl.object_key("n1", client, 0, 1, bundle, INGESTED_NS)
    path = data_dir / "objects" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    dl.write_local(path, shard=0, segment_seq=1, bundle_index=bundle, client=client,
                   ingestion_ts_ns=INGESTED_NS, tables={0: table}, error="E: x",
                   reason=dl.ENCODE, attempts=3)
    where, _ = warehouse(StoreConfig(), data_dir)
    return location(where, key)


def tables(data_dir: Path, *, keep_snapshots_s: float = 3600.0) -> DeadLetterTables:
    where, io = warehouse(StoreConfig(), data_dir)
    return DeadLetterTables(catalog_uri=f"sqlite:///{data_dir / 'catalog.sqlite'}",
                            warehouse=where, io_properties=io,
                            cfg=IcebergConfig(keep_snapshots_s=keep_snapshots_s))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    (tmp_path / "objects").mkdir()
    return tmp_path


def test_dead_letter_table_add_is_idempotent_and_remove_takes_it_out(data_dir: Path) -> None:
    t = tables(data_dir)
    rows = pa.table({"a": [1, 2, 3]})
    first = write_letter(data_dir, "web", 0, rows)
    second = write_letter(data_dir, "web", 1, rows)
    assert t.add("web", first) is True
    assert t.add("web", first) is False  # a crash between the commit and the REJECT
    assert t.add("web", second) is True
    assert t.locations("web") == {first, second}
    read = SqlCatalog("quiverd", uri=f"sqlite:///{data_dir / 'catalog.sqlite'}")
    got = read.load_table((DEAD_LETTER_NAMESPACE, "web")).scan().to_arrow()
    assert sorted(got["bundle_index"].to_pylist()) == [0, 1]
    assert all(read_ipc_stream(p).equals(rows) for p in got["payload"].to_pylist())
    assert t.remove("web", [first, "file:///not/there.parquet"]) == [first]
    assert t.remove("web", [first]) == []
    assert t.locations("web") == {second}
    t.close()


def test_dead_letter_tables_are_one_per_client_beside_the_projections(data_dir: Path) -> None:
    """Clients ``a``, ``a.b`` and ``..`` get tables of their own (a dotted name is one
    name; ``..`` is no path step in the metadata location), none in namespace ``quiver``,
    whose listing, the projection's, stays empty."""
    t = tables(data_dir)
    for client in ("a", "a.b", ".."):
        t.add(client, write_letter(data_dir, client, 0, pa.table({"c": [client]})))
    assert t.clients() == ["..", "a", "a.b"]
    assert {c: len(t.locations(c)) for c in t.clients()} == {"..": 1, "a": 1, "a.b": 1}
    where, io = warehouse(StoreConfig(), data_dir)
    projection = Projection(catalog_uri=f"sqlite:///{data_dir / 'catalog.sqlite'}",
                            warehouse=where, io_properties=io, cfg=IcebergConfig())
    assert projection.tables() == []
    assert parse_table_name(f"{DEAD_LETTER_NAMESPACE}.a") is None
    assert (data_dir / "objects" / "_iceberg" / DEAD_LETTER_NAMESPACE / "client=..").is_dir()
    projection.close()
    t.close()


def test_dead_letter_table_history_is_expired_after_each_commit(data_dir: Path) -> None:
    t = tables(data_dir, keep_snapshots_s=0.001)
    for bundle in range(4):
        t.add("web", write_letter(data_dir, "web", bundle, pa.table({"a": [bundle]})))
        time.sleep(0.01)
    read = SqlCatalog("quiverd", uri=f"sqlite:///{data_dir / 'catalog.sqlite'}")
    table = read.load_table((DEAD_LETTER_NAMESPACE, "web"))
    assert len(table.snapshots()) == 1 and len(t.locations("web")) == 4
    t.close()
