"""The Iceberg projection on real parts: SQLite and PostgreSQL catalogs, the fs store and
moto's S3, pyiceberg scans and DuckDB 1.5.5 reading the tables offline."""

from __future__ import annotations

import glob
import importlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest

from quiverd.kernel.config import CatalogConfig, IcebergConfig, StoreConfig, loads
from quiverd.kernel.errors import CatalogUnavailable, ConfigError, IcebergCommitFailed
from quiverd.kernel.layout import DataDir
from quiverd.lake.catalog import open_catalog
from quiverd.lake.iceberg import (
    FILE_IDS,
    REMOVED_FILE_IDS,
    DataFileRef,
    Projection,
    catalog_uri,
    parse_table_name,
    table_name,
    warehouse,
)
from tests.lake.catalogs import Log
from tests.lake.iceberg_helpers import HOUR0, TIME, Lake, fs_lake, lake_table, s3_lake, scan_ids

WEB = "quiver.web"


class Setup:
    def __init__(self, uri: str, lake: Lake) -> None:
        self.uri = uri
        self.lake = lake
        self.opened: list[Projection] = []

    def projection(self, **cfg: Any) -> Projection:
        p = self.lake.projection(self.uri, **cfg)
        self.opened.append(p)
        return p


@pytest.fixture(params=[("sqlite", "fs"), ("postgresql", "s3")], ids=lambda p: "-".join(p))
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Setup]:
    """A catalog (quiverd's SQLite file or a fresh PostgreSQL database) and a store."""
    db, store = request.param
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    cfg = (CatalogConfig(dsn=request.getfixturevalue("pg_catalog_dsn")) if db == "postgresql"
           else CatalogConfig())
    if store == "s3":
        lake = s3_lake(request.getfixturevalue("s3_bucket"),
                       request.getfixturevalue("s3_server").client(), data_dir)
    else:
        lake = fs_lake(data_dir)
    s = Setup(catalog_uri(cfg, data_dir), lake)
    yield s
    for p in s.opened:
        p.close()


def test_iceberg_names_round_trip_and_uris(tmp_path: Path) -> None:
    assert table_name("web", 0) == "quiver.web"
    assert table_name("web", 3) == "quiver.web__slot3"
    assert parse_table_name("quiver.web__slot3") == ("web", 3)
    assert parse_table_name("quiver.a.b") == ("a.b", 0)
    assert parse_table_name("other.web") is None
    assert catalog_uri(CatalogConfig(), tmp_path) == f"sqlite:///{tmp_path}/catalog.sqlite"
    dsn = "postgresql://u:p%40ss@db.example:6543/lake?sslmode=require"
    assert catalog_uri(CatalogConfig(dsn=dsn), tmp_path) == (
        "postgresql+psycopg2://u:p%40ss@db.example:6543/lake?sslmode=require")
    assert warehouse(StoreConfig(), tmp_path) == (f"file://{tmp_path}/objects", {})
    where, io = warehouse(StoreConfig(scheme="s3", root="/p/", options={
        "bucket": "b", "region": "r", "endpoint": "http://e", "access_key_id": "k",
        "secret_access_key": "s"}), tmp_path)
    assert where == "s3://b/p"
    assert io == {"s3.endpoint": "http://e", "s3.region": "r", "s3.access-key-id": "k",
                  "s3.secret-access-key": "s"}
    with pytest.raises(ConfigError):
        warehouse(StoreConfig(scheme="gcs", options={"bucket": "b"}), tmp_path)


def test_iceberg_config_defaults_and_validation() -> None:
    assert loads("").lake.iceberg == IcebergConfig()
    with pytest.raises(ConfigError, match="lake.iceberg.keep_snapshots_s"):
        loads("[lake.iceberg]\nkeep_snapshots_s = 0\n")
    with pytest.raises(ConfigError, match="lake.iceberg.commit_retries"):
        loads("[lake.iceberg]\ncommit_retries = -1\n")


def test_iceberg_append_batch_is_one_snapshot_with_file_ids(setup: Setup) -> None:
    p = setup.projection()
    refs = [setup.lake.write(lake_table(100, start=100 * i)) for i in range(3)]
    result = p.commit(WEB, refs, summary={"quiverd.round": "7"})
    assert result.added == [r.file_id for r in refs] and not result.skipped
    tbl = p._catalog.load_table(("quiver", "web"))
    assert len(tbl.metadata.snapshots) == 1
    summary = tbl.metadata.current_snapshot().summary
    assert summary[FILE_IDS] == ",".join(r.file_id for r in refs)
    assert summary[REMOVED_FILE_IDS] == "" and summary["quiverd.round"] == "7"
    assert scan_ids(p, WEB) == list(range(300))
    assert p.live_locations(WEB) == {r.location: r.file_id for r in refs}
    assert p.tables() == [WEB]
    assert tbl.location().endswith("/_iceberg/quiver/web")
    assert [f.transform.__class__.__name__ for f in tbl.spec().fields] == ["HourTransform"]


def test_iceberg_replace_is_one_snapshot_and_expire_keeps_current(setup: Setup) -> None:
    p = setup.projection()
    old = [setup.lake.write(lake_table(50, start=0)), setup.lake.write(lake_table(50, start=50))]
    p.commit(WEB, old)
    new = setup.lake.write(lake_table(100, start=0))
    result = p.commit(WEB, [new], [r.location for r in old])
    assert sorted(result.removed) == sorted(r.location for r in old)
    tbl = p._catalog.load_table(("quiver", "web"))
    assert len(tbl.metadata.snapshots) == 2
    summary = tbl.metadata.current_snapshot().summary
    assert summary[FILE_IDS] == new.file_id
    assert sorted(summary[REMOVED_FILE_IDS].split(",")) == sorted(r.file_id for r in old)
    assert scan_ids(p, WEB) == list(range(100))
    assert p.live_locations(WEB) == {new.location: new.file_id}
    # The removed files stay referenced until their snapshot expires.
    assert p.referenced_locations(WEB) == {new.location, *(r.location for r in old)}
    assert p.expire(WEB, older_than_s=3600) == 0
    first = tbl.metadata.snapshots[0]
    assert tbl.io.new_input(first.manifest_list).exists()
    assert p.expire(WEB, older_than_s=0) == 1  # the first; never the current one
    assert not tbl.io.new_input(first.manifest_list).exists()  # its metadata deleted too
    assert p.referenced_locations(WEB) == {new.location}
    assert p.expire(WEB, older_than_s=0) == 0
    assert scan_ids(p, WEB) == list(range(100))


def test_iceberg_schema_evolves_added_column_and_widened_int(setup: Setup) -> None:
    p = setup.projection()
    first = setup.lake.write(lake_table(10, extra={"n": pa.array(range(10), pa.int32())}))
    p.commit(WEB, [first])
    wide = lake_table(10, start=10, extra={"n": pa.array(range(10), pa.int64()),
                                           "added": pa.array(["x"] * 10)})
    narrow = lake_table(10, start=20, extra={"n": pa.array(range(10), pa.int32())})
    result = p.commit(WEB, [setup.lake.write(wide), setup.lake.write(narrow)])
    assert not result.skipped and len(result.added) == 2
    tbl = p._catalog.load_table(("quiver", "web"))
    schema = tbl.schema()
    assert str(schema.find_field("n").field_type) == "long"
    assert str(schema.find_field("added").field_type) == "string"
    assert not any(f.required for f in schema.fields)
    rows = tbl.scan().to_arrow()
    assert sorted(rows.column("id").to_pylist()) == list(range(30))
    assert rows.column("added").to_pylist().count("x") == 10


def test_iceberg_skips_files_iceberg_cannot_hold_and_commits_the_rest(setup: Setup) -> None:
    p = setup.projection()
    good = setup.lake.write(lake_table(10))
    p.commit(WEB, [good])
    ns = lake_table(10, start=10, extra={"t": pa.array([0] * 10, pa.timestamp("ns", "UTC"))})
    span = lake_table(10, start=20).set_column(
        2, TIME, pa.array([HOUR0.replace(minute=59), HOUR0.replace(hour=6)] * 5,
                          pa.timestamp("us", "UTC")))
    uint = lake_table(10, start=30, extra={"u": pa.array([1] * 10, pa.uint64())})
    retyped = lake_table(10, start=40).set_column(1, "msg", pa.array(range(10), pa.int64()))
    bad = [setup.lake.write(t) for t in (ns, span, uint, retyped)]
    bad.append(DataFileRef(file_id="01JZZZZZZZZZZZZZZZZZZZZZZZ", client="web", slot=0,
                           location=setup.lake.warehouse + "/client=web/slot=0/gone.parquet",
                           partition_column=TIME))
    # Without the time column (null in every row): Iceberg's null partition, added.
    missing = setup.lake.write(lake_table(10, start=50).drop_columns([TIME]))
    fine = setup.lake.write(lake_table(10, start=60))
    result = p.commit(WEB, [*bad, missing, fine])
    assert result.added == [missing.file_id, fine.file_id]
    reasons = dict(result.skipped)
    assert sorted(reasons) == sorted(r.file_id for r in bad)
    assert "timestamp[ns" in reasons[bad[0].file_id]
    assert "span 2 hours" in reasons[bad[1].file_id]
    assert "uint64" in reasons[bad[2].file_id]
    assert "msg" in reasons[bad[3].file_id] or "Cannot change" in reasons[bad[3].file_id]
    assert "no object" in reasons[bad[4].file_id]
    assert scan_ids(p, WEB) == [*range(10), *range(50, 70)]
    tbl = p._catalog.load_table(("quiver", "web"))
    nulls = tbl.scan(row_filter=f"{TIME} IS NULL").to_arrow()
    assert sorted(nulls.column("id").to_pylist()) == list(range(50, 60))
    # Nothing to add at all: no snapshot, no table change.
    again = p.commit(WEB, [bad[0]])
    assert again.snapshot_id is None and again.added == []


def test_iceberg_concurrent_projections_on_postgresql_lose_nothing(
        pg_catalog_dsn: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    lake = fs_lake(data_dir)
    uri = catalog_uri(CatalogConfig(dsn=pg_catalog_dsn), data_dir)
    daemons = [lake.projection(uri, commit_retries=50) for _ in range(2)]
    rounds, per_round = 8, 2
    batches = [[[lake.write(lake_table(5, start=1000 * d + 10 * (r * per_round + f)))
                 for f in range(per_round)] for r in range(rounds)] for d in range(2)]
    barrier = threading.Barrier(2)
    results: list[list[Any]] = [[], []]
    errors: list[BaseException] = []

    def run(d: int) -> None:
        try:
            barrier.wait()  # both create the table and commit at once
            for batch in batches[d]:
                results[d].append(daemons[d].commit(WEB, batch))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    try:
        assert not errors, errors
        expected = sorted(1000 * d + 10 * i + k for d in range(2)
                          for i in range(rounds * per_round) for k in range(5))
        assert scan_ids(daemons[0], WEB) == expected
        snapshots = daemons[1]._catalog.load_table(("quiver", "web")).metadata.snapshots
        assert len(snapshots) == 2 * rounds  # one per commit, none lost, none doubled
        assert len(daemons[1].live_locations(WEB)) == 2 * rounds * per_round
    finally:
        for d in daemons:
            d.close()


@pytest.mark.asyncio
async def test_iceberg_shares_quiverds_sqlite_catalog_file(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    catalog = open_catalog(CatalogConfig(), DataDir(data_dir).catalog_db, log=Log())
    await catalog.start()  # quiverd's catalog: WAL mode, its own tables
    try:
        lake = fs_lake(data_dir)
        p = lake.projection(catalog_uri(CatalogConfig(), data_dir))
        try:
            ref = lake.write(lake_table(5))
            await anyio.to_thread.run_sync(p.commit, WEB, [ref])
            assert await catalog.list_files(client="web") == []  # still answers
            assert p.live_locations(WEB) == {ref.location: ref.file_id}
        finally:
            p.close()
    finally:
        await catalog.close()
    with sqlite3.connect(DataDir(data_dir).catalog_db) as db:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"iceberg_tables", "iceberg_namespace_properties"} <= names and len(names) > 2


def test_iceberg_stale_writer_retries_the_compare_and_swap(setup: Setup) -> None:
    a, b = setup.projection(), setup.projection(commit_retries=0)
    a.commit(WEB, [setup.lake.write(lake_table(5, start=0))])
    b.live_locations(WEB)  # b now holds the table as of a's first snapshot
    a.commit(WEB, [setup.lake.write(lake_table(5, start=5))])
    with pytest.raises(IcebergCommitFailed):  # b's view is stale, and b may not retry
        b.commit(WEB, [setup.lake.write(lake_table(5, start=10))])
    a.live_locations(WEB)
    b.commit(WEB, [setup.lake.write(lake_table(5, start=15))])  # b reloaded after failing
    result = a.commit(WEB, [setup.lake.write(lake_table(5, start=20))])
    assert result.retries == 1  # a's cached table was stale: refreshed, then committed
    assert scan_ids(a, WEB) == [*range(10), *range(15, 25)]


def test_iceberg_catalog_outage_is_catalog_unavailable_then_recovers(
        postgres_server: Any, pg_catalog_dsn: str, tmp_path: Path) -> None:
    lake = fs_lake(tmp_path / "data")
    p = lake.projection(catalog_uri(CatalogConfig(dsn=pg_catalog_dsn), tmp_path / "data"))
    try:
        p.commit(WEB, [lake.write(lake_table(5, start=0))])
        postgres_server.stop()
        try:
            with pytest.raises(CatalogUnavailable) as err:
                p.commit(WEB, [lake.write(lake_table(5, start=5))])
            assert err.value.retryable
        finally:
            postgres_server.start()
        p.commit(WEB, [lake.write(lake_table(5, start=10))])
        assert scan_ids(p, WEB) == [*range(5), *range(10, 15)]
    finally:
        p.close()


def test_iceberg_duckdb_reads_the_table_offline(tmp_path: Path) -> None:
    import duckdb

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lake = fs_lake(data_dir)
    p = lake.projection(catalog_uri(CatalogConfig(), data_dir))
    try:
        old = [lake.write(lake_table(40, start=40 * i)) for i in range(3)]
        p.commit(WEB, old)
        p.commit(WEB, [lake.write(lake_table(80, start=0))], [o.location for o in old[:2]])
        expected = len(scan_ids(p, WEB))
    finally:
        p.close()
    # The current metadata.json, as a user finds it: the catalog's iceberg_tables row.
    with sqlite3.connect(data_dir / "catalog.sqlite") as db:
        (metadata,) = db.execute(
            "SELECT metadata_location FROM iceberg_tables WHERE catalog_name = 'quiverd' "
            "AND table_namespace = 'quiver' AND table_name = 'web'").fetchone()
    con = duckdb.connect(config={"autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    for name in ("avro", "iceberg"):
        con.execute(f"LOAD '{_duckdb_extension(name)}'")
    count, distinct = con.execute(
        f"SELECT count(*), count(DISTINCT id) FROM iceberg_scan('{metadata}')").fetchone()
    assert count == distinct == expected == 120


def _duckdb_extension(name: str) -> str:
    module = importlib.import_module(f"duckdb_extension_{name}")
    (path,) = glob.glob(os.path.join(os.path.dirname(module.__file__ or ""), "extensions", "*",
                                     f"{name}.duckdb_extension"))
    return path


def test_iceberg_expiry_keeps_a_snapshot_current_within_the_window(tmp_path: Path) -> None:
    """A reader loads the table while snapshot 1 is current; snapshot 2 lands a second
    later. Expiry with a one-second window must keep snapshot 1 (it was current a moment
    ago: keyed on its creation it would go) and the reader's scan must still read it."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lake = fs_lake(data_dir)
    uri = catalog_uri(CatalogConfig(), data_dir)
    p, reader = lake.projection(uri), lake.projection(uri)
    try:
        first = lake.write(lake_table(10))
        p.commit(WEB, [first])
        loaded = reader._catalog.load_table(("quiver", "web"))  # the reader's snapshot 1
        time.sleep(1.1)
        p.commit(WEB, [lake.write(lake_table(10, start=10))], [first.location])
        assert p.expire(WEB, older_than_s=1.0) == 0
        assert first.location in p.referenced_locations(WEB)  # the janitor keeps it
        assert sorted(loaded.scan().to_arrow().column("id").to_pylist()) == list(range(10))
        time.sleep(1.1)  # now snapshot 1 stopped being current over a second ago
        assert p.expire(WEB, older_than_s=1.0) == 1
        assert p.referenced_locations(WEB) == set(p.live_locations(WEB))
        assert scan_ids(p, WEB) == list(range(10, 20))
    finally:
        p.close()
        reader.close()
