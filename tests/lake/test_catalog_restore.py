"""The catalog's restore and forget transitions on both backends (SQLite file, real
PostgreSQL): Quarantined -> Evicted (live again, its coverage counted again), refused
when another registered file took its bundles meanwhile; Quarantined -> Lost; retries
answer False; other states are StateConflict, unknown ids KeyError."""

from __future__ import annotations

from collections.abc import Awaitable

import anyio
import pytest

from quiverd.lake.catalog import Catalog, DuplicateCoverage, StateConflict
from quiverd.lake.model import REGISTERED, FileState, ZoneMap
from tests.lake.catalogs import Opener
from tests.lake.test_catalog import cov, row


async def quarantined(catalog: Catalog, file_id: str, *bundles: int) -> None:
    await catalog.register(row(file_id, object_key=f"client=c1/slot=0/{file_id}"),
                           [cov(7, *bundles)])
    await catalog.record_index(file_id, [ZoneMap(column="t", min_value=1, max_value=2,
                                                 null_count=0)], ["zonemap"])
    assert await catalog.set_state_if(file_id, FileState.QUARANTINED, REGISTERED,
                                      local_path="")


@pytest.mark.asyncio
async def test_catalog_restore_makes_a_quarantined_file_live_once(catalog: Catalog) -> None:
    await quarantined(catalog, "F1", 0, 1, 2)
    assert await catalog.covered("SRC", 0, 7) == {}
    feed = await catalog.notifications()  # LISTEN connected (PostgreSQL) before the restore
    assert await catalog.restore("F1") is True
    back = await catalog.get("F1")
    assert back is not None and back.state is FileState.EVICTED and back.local_path == ""
    assert await catalog.covered("SRC", 0, 7) == {0: {0, 1, 2}}
    assert [r.file_id for r in await catalog.list_files(states=REGISTERED)] == ["F1"]
    assert (await catalog.zone_maps(["F1"]))["F1"][0].column == "t"  # kept
    with anyio.fail_after(5):
        assert await feed.__anext__() == "F1"  # as a registration: the indexer wakes
    await feed.aclose()
    assert await catalog.restore("F1") is False  # a retry: nothing changes
    assert (await catalog.get("F1")).state is FileState.EVICTED  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_catalog_restore_refused_when_its_bundles_were_registered_again(
        catalog: Catalog) -> None:
    await quarantined(catalog, "F1", 0, 1, 2)
    # While F1 was out, its bundles 1 and 2 were uploaded again in another file.
    await catalog.register(row("F2", object_key="client=c1/slot=0/F2"), [cov(7, 1, 2)])
    with pytest.raises(DuplicateCoverage, match="F1 covers bundles already held by F2"):
        await catalog.restore("F1")
    assert (await catalog.get("F1")).state is FileState.QUARANTINED  # type: ignore[union-attr]
    assert await catalog.covered("SRC", 0, 7) == {0: {1, 2}}


@pytest.mark.asyncio
async def test_catalog_forget_records_lost_and_restore_still_works(catalog: Catalog) -> None:
    await quarantined(catalog, "F1", 0)
    assert await catalog.forget("F1") is True
    assert (await catalog.get("F1")).state is FileState.LOST  # type: ignore[union-attr]
    assert await catalog.forget("F1") is False
    await catalog.delete_rows(["F1"])  # a Lost row is the record of the loss: kept
    assert await catalog.get("F1") is not None
    assert await catalog.covered("SRC", 0, 7) == {}
    assert await catalog.restore("F1") is True  # a backup found later
    assert (await catalog.get("F1")).state is FileState.EVICTED  # type: ignore[union-attr]


@pytest.mark.asyncio
async def test_catalog_restore_and_forget_refuse_other_states(catalog: Catalog) -> None:
    await catalog.register(row("F1"), [cov(1, 0)])
    assert await catalog.restore("F1") is False  # registered: nothing to do
    with pytest.raises(StateConflict, match="only a quarantined file can be forgotten"):
        await catalog.forget("F1")
    await catalog.insert_file(row("F2"))
    with pytest.raises(StateConflict, match="F2 is Received: only a quarantined or lost"):
        await catalog.restore("F2")
    for op in (catalog.restore, catalog.forget):
        with pytest.raises(KeyError):
            await op("NOPE")


async def outcome(call: Awaitable[bool]) -> bool | DuplicateCoverage:
    try:
        return await call
    except DuplicateCoverage as exc:
        return exc


@pytest.mark.asyncio
async def test_catalog_restore_races_a_register_of_the_same_bundles(
        catalog: Catalog, open_more: Opener) -> None:
    """Two connections: a restore and a register of the same bundle, at once. Exactly
    one wins; the bundle is never held by two registered files."""
    other = await open_more()
    for i in range(5):
        fid, new = f"Q{i}", f"N{i}"
        await catalog.register(row(fid, object_key=f"k/{fid}"), [cov(100 + i, 0)])
        await catalog.set_state(fid, FileState.QUARANTINED)
        outcomes: dict[str, bool | DuplicateCoverage] = {}

        async def put(name: str, call: Awaitable[bool], into: dict[str, object]) -> None:
            into[name] = await outcome(call)

        async with anyio.create_task_group() as tg:
            tg.start_soon(put, "restore", catalog.restore(fid), outcomes)
            tg.start_soon(put, "register", other.register(row(new, object_key=f"k/{new}"),
                                                          [cov(100 + i, 0)]), outcomes)
        assert sorted(type(v).__name__ for v in outcomes.values()) == \
            ["DuplicateCoverage", "bool"], outcomes
        assert await catalog.covered("SRC", 0, 100 + i) == {0: {0}}
        live = {r.file_id for r in await catalog.list_files(states=REGISTERED)}
        assert len(live & {fid, new}) == 1, live
