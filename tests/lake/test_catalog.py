"""The lake catalog on both backends: SQLite on a real file, PostgreSQL on a real server.

Every test taking ``catalog`` runs twice (ids ``sqlite`` and ``postgresql``), each time on
an empty database. Tests needing a second catalog on the same database (notifications
across connections, concurrent registrations, reopening) get it from ``open_more``. The
PostgreSQL outage test stops the session's server and starts it again in a ``finally``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import msgspec
import pytest

from quiverd.kernel.config import CatalogConfig
from quiverd.kernel.errors import CatalogUnavailable
from quiverd.lake.catalog import (
    NOTIFY_BUFFER,
    Catalog,
    DuplicateCoverage,
    NotificationHub,
    ReplaceConflict,
    StateConflict,
    open_catalog,
)
from quiverd.lake.catalog.sql import FILE_COLUMNS, numbered
from quiverd.lake.model import REGISTERED, Coverage, FileRow, FileState, ZoneMap
from tests.lake.catalogs import Log, Opener, Target, heard_until_closed
from tests.services.postgres import PostgresServer


def row(file_id: str, *, client: str = "c1", start_ts: int = 0, end_ts: int = 10,
        slot: int = 0, shard: int = 0, source_id: str = "SRC", **kw: Any) -> FileRow:
    return FileRow(file_id=file_id, client_name=client, start_ts=start_ts, end_ts=end_ts,
                   slot=slot, shard=shard, source_id=source_id, **kw)


def cov(segment_seq: int, *indexes: int) -> Coverage:
    return Coverage(segment_seq=segment_seq, bundle_indexes=tuple(indexes))


async def raw(target: Target, query: str) -> list[tuple[Any, ...]]:
    """Rows straight from the database, bypassing the catalog."""
    cfg, path = target
    if cfg.dsn:
        conn = await asyncpg.connect(cfg.dsn)
        try:
            return [tuple(r) for r in await conn.fetch(query)]
        finally:
            await conn.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute(query).fetchall()


# ---- schema and rows ------------------------------------------------------------------

@pytest.mark.asyncio
async def test_catalog_start_idempotent_when_started_twice_and_reopened(
        catalog: Catalog, open_more: Opener, target: Target) -> None:
    await catalog.start()
    await catalog.insert_file(row("F1"))
    again = await open_more()
    assert await again.get("F1") == await catalog.get("F1")
    assert [v for v, in await raw(target, "SELECT version FROM schema_version")] == [1]


@pytest.mark.asyncio
async def test_catalog_insert_get_set_state_round_trip_every_field(catalog: Catalog) -> None:
    values = {name: f"v-{name}" for name in FILE_COLUMNS}
    values |= {name: 1_000 + i for i, name in enumerate(FILE_COLUMNS)
               if isinstance(getattr(FileRow(file_id="", client_name=""), name), int)}
    values |= {"indexes": ["zonemap", "bloom:user_id"], "state": FileState.APPENDED,
               "crc32c": 0xFFFF_FFFF, "start_ts": 1_700_000_000_000_000_000}
    full = FileRow(**values)
    await catalog.insert_file(full)
    got = await catalog.get(full.file_id)
    assert got is not None
    assert msgspec.structs.replace(got, updated_at=full.updated_at) == full
    assert got.updated_at > full.updated_at

    changes: dict[str, Any] = {"uri": "s3://b/k", "object_key": "k", "compressed_size": 77,
                               "crc32c": 123, "local_path": "", "row_count": 9, "start_ts": 5,
                               "end_ts": 6, "uncompressed_size": 88, "schema_hash": "ab",
                               "uploaded_at": 42, "indexes": []}
    await catalog.set_state(full.file_id, FileState.UPLOADED, **changes)
    moved = await catalog.get(full.file_id)
    assert moved is not None and moved.updated_at >= got.updated_at
    assert moved == msgspec.structs.replace(full, state=FileState.UPLOADED,
                                            updated_at=moved.updated_at, **changes)
    assert await catalog.get("nope") is None


@pytest.mark.asyncio
async def test_catalog_insert_file_noop_when_file_id_exists(catalog: Catalog) -> None:
    await catalog.insert_file(row("F1", client="first"))
    await catalog.insert_file(row("F1", client="second"))
    assert [r.client_name for r in await catalog.list_files()] == ["first"]


@pytest.mark.asyncio
async def test_catalog_set_state_refuses_bad_fields_and_missing_rows(catalog: Catalog) -> None:
    await catalog.insert_file(row("F1"))
    for bad in ({"colour": 1}, {"file_id": "X"}, {"state": FileState.UPLOADED},
                {"updated_at": 1}, {"row_count": "many"}, {"indexes": "zonemap"}):
        with pytest.raises(ValueError):
            await catalog.set_state("F1", FileState.ROTATED, **bad)
    with pytest.raises(KeyError):
        await catalog.set_state("nope", FileState.ROTATED)
    same = await catalog.get("F1")
    assert same is not None and same.state is FileState.RECEIVED


# ---- registration and coverage ---------------------------------------------------------

@pytest.mark.asyncio
async def test_catalog_register_idempotent_when_repeated(catalog: Catalog,
                                                         target: Target) -> None:
    f = row("F1", slot=2)
    assert await catalog.register(f, [cov(3, 0, 1, 2), cov(4, 0)]) is True
    first = await catalog.get("F1")
    assert await catalog.register(f, [cov(3, 0, 1, 2), cov(4, 0)]) is False
    assert await catalog.list_files() == [first]
    assert sorted(await raw(target, "SELECT segment_seq, bundle_indexes FROM coverage")) == [
        (3, "0-2"), (4, "0")]
    with pytest.raises(ValueError):
        await catalog.register(f, [cov(3, 0, 1)])


@pytest.mark.asyncio
async def test_catalog_register_completes_unfinished_row(catalog: Catalog) -> None:
    await catalog.insert_file(row("F1", local_path="/stable/F1.parquet", created_at=7))
    await catalog.set_state("F1", FileState.UPLOADED)
    done = row("F1", uri="s3://b/F1", row_count=10, local_path="/stable/F1.parquet")
    assert await catalog.register(done, [cov(1, 0)]) is True
    got = await catalog.get("F1")
    assert got is not None and got.state is FileState.META_REGISTERED
    assert (got.uri, got.row_count, got.created_at) == ("s3://b/F1", 10, 7)


@pytest.mark.asyncio
async def test_catalog_register_raises_duplicate_coverage_when_other_file_overlaps(
        catalog: Catalog) -> None:
    await catalog.register(row("A"), [cov(5, 0, 1, 2, 3)])
    await catalog.register(row("B"), [cov(6, 0)])
    await catalog.insert_file(row("D"))
    with pytest.raises(DuplicateCoverage) as caught:
        await catalog.register(row("D"), [cov(4, 0), cov(5, 3, 4), cov(6, 0)])
    assert caught.value.file_id == "D" and caught.value.other_file_ids == ("A", "B")
    d = await catalog.get("D")
    assert d is not None and d.state is FileState.RECEIVED
    assert await catalog.covered("SRC", 0, 4) == {}
    assert await catalog.covered("SRC", 0, 5) == {0: {0, 1, 2, 3}}
    # The same bundle numbers in another slot, shard or source are other bundles.
    assert await catalog.register(row("E", slot=1), [cov(5, 3, 4)]) is True
    assert await catalog.register(row("F", shard=1), [cov(5, 3, 4)]) is True
    assert await catalog.register(row("G", source_id="OTHER"), [cov(5, 3, 4)]) is True
    assert await catalog.register(row("H"), [cov(5, 4, 5)]) is True
    assert await catalog.covered("SRC", 0, 5) == {0: {0, 1, 2, 3, 4, 5}, 1: {3, 4}}


@pytest.mark.asyncio
async def test_catalog_covered_ignores_unfinished_and_abandoned_files(catalog: Catalog) -> None:
    await catalog.register(row("A", slot=0), [cov(9, 0, 1)])
    await catalog.register(row("B", slot=1), [cov(9, 5)])
    await catalog.register(row("C", slot=2), [cov(9, 7)])
    await catalog.set_state("B", FileState.ABANDONED)
    await catalog.set_state("C", FileState.EVICTED)
    await catalog.insert_file(row("D", slot=3))
    assert await catalog.covered("SRC", 0, 9) == {0: {0, 1}, 2: {7}}
    assert await catalog.covered("SRC", 0, 8) == {}
    # An abandoned file's bundles may be registered again, by another file.
    assert await catalog.register(row("E", slot=1), [cov(9, 5)]) is True
    with pytest.raises(StateConflict):
        await catalog.register(row("B", slot=1), [cov(9, 6)])


@pytest.mark.asyncio
async def test_catalog_register_refuses_malformed_coverage(catalog: Catalog) -> None:
    for bad in ([], [cov(1, 2, 1)], [cov(1, 1, 1)], [cov(1)], [cov(1, 0), cov(1, 1)]):
        with pytest.raises(ValueError):
            await catalog.register(row("A"), bad)
    assert await catalog.get("A") is None


@pytest.mark.asyncio
async def test_catalog_register_concurrent_overlap_exactly_one_succeeds(
        open_more: Opener) -> None:
    catalogs = [await open_more() for _ in range(4)]
    for round_ in range(5):
        outcomes: list[object] = []

        async def attempt(cat: Catalog, i: int, round_: int = round_,
                          outcomes: list[object] = outcomes) -> None:
            try:
                outcomes.append(await cat.register(row(f"R{round_}-{i}"),
                                                   [cov(round_, i, 10 + i, 20)]))
            except DuplicateCoverage as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for i, cat in enumerate(catalogs):
                tg.start_soon(attempt, cat, i)
        assert outcomes.count(True) == 1, outcomes
        assert sum(isinstance(o, DuplicateCoverage) for o in outcomes) == 3, outcomes
        live = await catalogs[0].list_files(states=REGISTERED)
        assert len([f for f in live if f.file_id.startswith(f"R{round_}-")]) == 1


# ---- listing and indexes ----------------------------------------------------------------

@pytest.mark.asyncio
async def test_catalog_list_files_filters_and_orders(catalog: Catalog) -> None:
    rows = [row("B", start_ts=10, end_ts=20), row("A", start_ts=10, end_ts=12),
            row("C", client="c2", start_ts=0, end_ts=9, node_id="n2", slot=1),
            row("D", start_ts=30, end_ts=40, source_id="S2"), row("E", start_ts=21, end_ts=29)]
    for r in rows:
        await catalog.insert_file(r)
    await catalog.set_state("E", FileState.ABANDONED)

    async def ids(**kw: Any) -> list[str]:
        return [f.file_id for f in await catalog.list_files(**kw)]

    assert await ids() == ["C", "A", "B", "E", "D"]
    assert await ids(client="c1") == ["A", "B", "E", "D"]
    assert await ids(since_ns=20) == ["B", "E", "D"]  # B ends at 20: overlaps [20, …)
    assert await ids(until_ns=10) == ["C"]  # A and B start at 10: outside [… , 10)
    assert await ids(since_ns=12, until_ns=22) == ["A", "B", "E"]
    assert await ids(states=[FileState.ABANDONED]) == ["E"]
    assert await ids(states=[FileState.RECEIVED, FileState.ABANDONED], client="c1",
                     limit=2) == ["A", "B"]
    assert await ids(states=[]) == []
    assert await ids(node_id="n2") == ["C"]
    assert await ids(source_id="S2") == ["D"]
    assert await ids(slot=1) == ["C"]
    assert await ids(limit=0) == []


@pytest.mark.asyncio
async def test_catalog_record_index_stores_zone_maps_of_every_value_kind(
        catalog: Catalog) -> None:
    await catalog.register(row("A"), [cov(1, 0)])
    await catalog.register(row("B"), [cov(1, 1)])
    old = [ZoneMap(column="gone", min_value=1, max_value=2, null_count=0)]
    await catalog.record_index("A", old, ["zonemap"])
    maps = [ZoneMap(column="ts", min_value=-5, max_value=1 << 62, null_count=0),
            ZoneMap(column="f", min_value=-0.5, max_value=2.0, null_count=3),
            ZoneMap(column="s", min_value="", max_value="zé\"x", null_count=1),
            ZoneMap(column="b", min_value=False, max_value=True, null_count=0),
            ZoneMap(column="n", min_value=None, max_value=None, null_count=100)]
    await catalog.record_index("A", maps, ["zonemap", "bloom:s"])
    await catalog.set_state("B", FileState.EVICTED)
    await catalog.record_index("B", maps[:1], ["zonemap"])

    got = await catalog.zone_maps(["A", "B", "missing"])
    assert got == {"A": sorted(maps, key=lambda z: z.column), "B": maps[:1]}
    assert type(got["A"][1].max_value) is float and type(got["A"][0].max_value) is bool
    a, b = await catalog.get("A"), await catalog.get("B")
    assert a is not None and (a.state, a.indexes) == (FileState.INDEXED, ["zonemap", "bloom:s"])
    assert b is not None and b.state is FileState.EVICTED


@pytest.mark.asyncio
async def test_catalog_record_index_refuses_unregistered_files_and_bad_values(
        catalog: Catalog) -> None:
    await catalog.insert_file(row("A"))
    zm = [ZoneMap(column="x", min_value=1, max_value=2, null_count=0)]
    with pytest.raises(StateConflict):
        await catalog.record_index("A", zm, ["zonemap"])
    with pytest.raises(KeyError):
        await catalog.record_index("nope", zm, ["zonemap"])
    await catalog.register(row("A"), [cov(1, 0)])
    with pytest.raises(ValueError):
        await catalog.record_index("A", [ZoneMap(column="x", min_value=float("nan"),
                                                 max_value=1.0, null_count=0)], [])
    with pytest.raises(ValueError):
        await catalog.record_index("A", zm + zm, [])
    assert await catalog.zone_maps(["A"]) == {}


# ---- compaction and the janitor ---------------------------------------------------------

@pytest.mark.asyncio
async def test_catalog_replace_moves_coverage_and_compacts_old_rows(
        catalog: Catalog, target: Target) -> None:
    await catalog.register(row("A"), [cov(1, 0, 1, 2, 3, 4)])
    await catalog.register(row("B"), [cov(1, 5, 6, 7, 8, 9), cov(2, 0, 1)])
    await catalog.record_index("B", [], ["zonemap"])
    await catalog.replace(["A", "B"], row("C", row_count=99))

    c = await catalog.get("C")
    assert c is not None and (c.state, c.row_count) == (FileState.META_REGISTERED, 99)
    for old in ("A", "B"):
        o = await catalog.get(old)
        assert o is not None and (o.state, o.compacted_into) == (FileState.COMPACTED, "C")
    assert await catalog.covered("SRC", 0, 1) == {0: set(range(10))}
    assert sorted(await raw(target, "SELECT file_id, segment_seq, bundle_indexes "
                                    "FROM coverage")) == [("C", 1, "0-9"), ("C", 2, "0-1")]
    await catalog.replace(["A", "B"], row("C", row_count=99))  # a retry: nothing changes
    assert await catalog.get("C") == c
    with pytest.raises(DuplicateCoverage):
        await catalog.register(row("X"), [cov(2, 1)])


@pytest.mark.asyncio
async def test_catalog_set_state_if_leaves_compacted_row_alone(catalog: Catalog) -> None:
    # The indexer evicts a file while compaction replaces it: the replaced row must
    # stay Compacted, or readers would see its rows twice.
    await catalog.register(row("A", local_path="/x/a"), [cov(1, 0)])
    await catalog.register(row("B"), [cov(1, 1)])
    await catalog.replace(["A", "B"], row("C"))
    live = (FileState.META_REGISTERED, FileState.INDEXED)
    assert not await catalog.set_state_if("A", FileState.EVICTED, live, local_path="")
    a = await catalog.get("A")
    assert a is not None and (a.state, a.local_path) == (FileState.COMPACTED, "/x/a")
    assert await catalog.set_state_if("C", FileState.EVICTED, live, local_path="")
    c = await catalog.get("C")
    assert c is not None and c.state == FileState.EVICTED
    assert not await catalog.set_state_if("missing", FileState.EVICTED, live)


@pytest.mark.asyncio
async def test_catalog_replace_conflict_when_old_row_not_registered(catalog: Catalog) -> None:
    await catalog.register(row("A"), [cov(1, 0)])
    await catalog.insert_file(row("B"))
    with pytest.raises(ReplaceConflict):
        await catalog.replace(["A", "B"], row("C"))
    with pytest.raises(ReplaceConflict):
        await catalog.replace(["A", "missing"], row("C"))
    assert await catalog.get("C") is None
    assert (await catalog.get("A") or row("")).state is FileState.META_REGISTERED
    assert await catalog.covered("SRC", 0, 1) == {0: {0}}
    # Two compactions of the same input: the second loses.
    await catalog.replace(["A"], row("C"))
    with pytest.raises(ReplaceConflict):
        await catalog.replace(["A"], row("D"))
    assert await catalog.get("D") is None


@pytest.mark.asyncio
async def test_catalog_delete_rows_drops_only_abandoned_and_compacted(
        catalog: Catalog, target: Target) -> None:
    await catalog.register(row("A"), [cov(1, 0)])
    await catalog.record_index("A", [ZoneMap(column="x", min_value=1, max_value=1,
                                             null_count=0)], ["zonemap"])
    await catalog.replace(["A"], row("B"))
    await catalog.insert_file(row("C"))
    await catalog.set_state("C", FileState.ABANDONED)
    await catalog.insert_file(row("D"))
    await catalog.delete_rows(["A", "B", "C", "D", "missing"])
    assert [f.file_id for f in await catalog.list_files()] == ["B", "D"]
    assert await raw(target, "SELECT file_id FROM zone_maps") == []
    assert await catalog.covered("SRC", 0, 1) == {0: {0}}


# ---- notifications ----------------------------------------------------------------------

@pytest.mark.asyncio
async def test_catalog_notifications_receive_registered_ids_across_connections(
        catalog: Catalog, open_more: Opener, target: Target) -> None:
    # PostgreSQL: another catalog (its own pool) registers; SQLite notifies in-process only.
    writer = await open_more() if target[0].dsn else catalog
    async with catalog.notifications() as feed:
        await writer.register(row("A"), [cov(1, 0)])
        await writer.register(row("A"), [cov(1, 0)])  # a repeat registers nothing
        await writer.register(row("B"), [cov(1, 1)])
        await writer.replace(["A", "B"], row("C"))
        with anyio.fail_after(5):
            assert [await anext(feed) for _ in range(3)] == ["A", "B", "C"]
        with anyio.move_on_after(0.2):
            extra = await anext(feed)
            pytest.fail(f"unexpected notification {extra}")


@pytest.mark.asyncio
async def test_catalog_notifications_end_when_catalog_closed(catalog: Catalog) -> None:
    feed = await catalog.notifications()
    assert await heard_until_closed(
        catalog, feed, lambda: catalog.register(row("A"), [cov(1, 0)])) == ["A"]
    with pytest.raises(RuntimeError):
        await catalog.start()


@pytest.mark.asyncio
async def test_catalog_notifications_iterable_without_await(catalog: Catalog) -> None:
    """``async for … in catalog.notifications()`` works, subscribed once iteration starts
    (PostgreSQL's LISTEN opens then: registrations repeat until one is heard)."""
    received: list[str] = []
    heard = anyio.Event()

    async def listen() -> None:
        async for file_id in catalog.notifications():
            received.append(file_id)
            heard.set()
            return

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            for seq in range(100):
                await catalog.register(row(f"A{seq:02}"), [cov(seq, 0)])
                with anyio.move_on_after(0.05):
                    await heard.wait()
                if heard.is_set():
                    break
    assert len(received) == 1 and received[0].startswith("A")
    await catalog.close()
    assert [file_id async for file_id in catalog.notifications()] == []


def test_notification_hub_drops_oldest_when_reader_is_slow() -> None:
    log = Log()
    hub = NotificationHub(backend="test", log=log)
    feed = hub.subscribe()
    hub.publish(str(i) for i in range(NOTIFY_BUFFER + 5))
    assert feed.dropped == 5
    assert [e for e, _ in log.events] == ["catalog_notifications_dropped"]
    assert feed._receive.receive_nowait() == "5"
    hub.close()


def test_numbered_turns_question_marks_into_dollar_placeholders() -> None:
    assert numbered("a = ? AND b IN (?, ?)") == "a = $1 AND b IN ($2, $3)"


# ---- outages ----------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_catalog_postgres_down_raises_unavailable_then_recovers(
        pg_catalog_dsn: str, postgres_server: PostgresServer, tmp_path: Path) -> None:
    async with open_catalog(CatalogConfig(dsn=pg_catalog_dsn, connect_timeout_ms=1_000),
                            tmp_path / "unused", log=Log()) as cat:
        await cat.register(row("A"), [cov(1, 0)])
        feed = await cat.notifications()
        try:
            await anyio.to_thread.run_sync(postgres_server.stop)
            with pytest.raises(CatalogUnavailable, match="postgresql"):
                await cat.get("A")
            with pytest.raises(CatalogUnavailable, match="postgresql"):
                await cat.register(row("B"), [cov(1, 1)])
            with anyio.fail_after(5), pytest.raises(CatalogUnavailable):
                await anext(feed)
            with pytest.raises(CatalogUnavailable):
                await cat.notifications()
        finally:
            await anyio.to_thread.run_sync(postgres_server.start)
        assert (await cat.get("A") or row("")).state is FileState.META_REGISTERED
        async with await cat.notifications() as again:
            assert await cat.register(row("B"), [cov(1, 1)]) is True
            with anyio.fail_after(5):
                assert await anext(again) == "B"


@pytest.mark.asyncio
async def test_catalog_postgres_start_raises_unavailable_when_server_unreachable(
        tmp_path: Path) -> None:
    dsn = f"postgresql://postgres@/quiver?host={tmp_path}&port=1"
    cat = open_catalog(CatalogConfig(dsn=dsn, connect_timeout_ms=500), tmp_path, log=Log())
    try:
        with pytest.raises(CatalogUnavailable, match="postgresql"):
            await cat.start()
    finally:
        await cat.close()


@pytest.mark.asyncio
async def test_catalog_sqlite_start_raises_unavailable_when_file_cannot_open(
        tmp_path: Path) -> None:
    cat = open_catalog(CatalogConfig(), tmp_path / "no" / "such" / "catalog.sqlite", log=Log())
    with pytest.raises(CatalogUnavailable, match="sqlite"):
        await cat.start()
    await cat.close()
