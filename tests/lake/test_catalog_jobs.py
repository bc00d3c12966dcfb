"""Job decisions in the catalog (SPEC §7) on both backends: SQLite on a real file,
PostgreSQL on a real server.

Every test taking ``catalog`` runs twice (ids ``sqlite`` and ``postgresql``), each time on
an empty database, as in ``test_catalog``. Tests needing a second catalog on the same
database (racing decisions, notifications across connections) get it from ``open_more``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from quiverd.kernel.config import CatalogConfig
from quiverd.kernel.errors import CatalogUnavailable
from quiverd.kernel.jobs import MAX_JOB_ID_BYTES, JobDecision, Winner
from quiverd.lake.catalog import Catalog, open_catalog
from quiverd.lake.catalog.jobs import INSERT_JOB, decision_values
from quiverd.lake.catalog.sql import numbered
from quiverd.lake.model import Coverage, FileRow
from tests.lake.catalogs import Log, Opener, Target, heard_until_closed

U64_MAX = 2**64 - 1


def commit(job_id: str, *winners: Winner, at: int = 0, by: str = "n1") -> JobDecision:
    return JobDecision(job_id=job_id, state="committed", winners=winners, decided_at_ns=at,
                       decided_by=by)


def expire(job_id: str, *, at: int = 0, by: str = "n2") -> JobDecision:
    return JobDecision(job_id=job_id, state="expired", decided_at_ns=at, decided_by=by,
                       reason="ttl")


async def raw(target: Target, query: str, args: list[tuple[Any, ...]] | None = None
              ) -> list[tuple[Any, ...]]:
    """Rows straight from the database (or ``query`` run once per ``args``), bypassing
    the catalog."""
    cfg, path = target
    if cfg.dsn:
        conn = await asyncpg.connect(cfg.dsn)
        try:
            if args is not None:
                await conn.executemany(numbered(query), args)
                return []
            return [tuple(r) for r in await conn.fetch(query)]
        finally:
            await conn.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        if args is not None:
            db.executemany(query, args)
            return []
        return db.execute(query).fetchall()


# ---- first writer wins -------------------------------------------------------------------

@pytest.mark.asyncio
async def test_decide_job_records_first_decision_and_returns_true(
        catalog: Catalog, target: Target) -> None:
    winners = (Winner(partition=0, attempt=7, rows=10, checksum=U64_MAX),
               Winner(partition=3, attempt=0, rows=0, checksum=0))
    stands, recorded = await catalog.decide_job(commit("job-1", *winners))
    assert recorded is True
    assert stands.decided_at_ns > 0  # 0 is recorded as now
    assert stands == commit("job-1", *winners, at=stands.decided_at_ns)
    assert await catalog.job_decisions(["job-1"]) == {"job-1": stands}
    assert stands.winner(3) == winners[1] and stands.winner(1) is None
    assert await raw(target, "SELECT job_id, state, decided_by FROM quiver_jobs") == [
        ("job-1", "committed", "n1")]


@pytest.mark.asyncio
async def test_decide_job_returns_standing_decision_when_already_decided(
        catalog: Catalog, open_more: Opener) -> None:
    first, recorded = await catalog.decide_job(commit("job-1", Winner(
        partition=0, attempt=1, rows=5, checksum=9), at=1_000))
    assert recorded is True
    assert await catalog.decide_job(expire("job-1", at=2_000)) == (first, False)
    assert await catalog.decide_job(first) == (first, False)  # a retry that committed
    other = await open_more()  # another daemon on the same database
    assert await other.decide_job(expire("job-1")) == (first, False)
    assert await other.job_decisions(["job-1"]) == {"job-1": first}


@pytest.mark.asyncio
async def test_decide_job_concurrent_from_two_catalogs_exactly_one_wins(
        open_more: Opener) -> None:
    # A commit through one daemon races an expiry through another, for many jobs at once.
    catalogs = [await open_more(), await open_more()]
    job_ids = [f"race-{i}" for i in range(20)]
    results: dict[str, list[tuple[JobDecision, bool]]] = {j: [] for j in job_ids}

    async def decide(cat: Catalog, decision: JobDecision) -> None:
        results[decision.job_id].append(await cat.decide_job(decision))

    async with anyio.create_task_group() as tg:
        for job_id in job_ids:
            tg.start_soon(decide, catalogs[0], commit(job_id, by="n0"))
            tg.start_soon(decide, catalogs[1], expire(job_id, by="n1"))
    stored = await catalogs[1].job_decisions(job_ids)
    for job_id in job_ids:
        (a, a_won), (b, b_won) = results[job_id]
        assert sorted([a_won, b_won]) == [False, True], results[job_id]
        assert a == b == stored[job_id]


@pytest.mark.asyncio
async def test_decide_job_refuses_malformed_decisions(catalog: Catalog) -> None:
    w = Winner(partition=0, attempt=1, rows=1, checksum=1)
    for bad in (commit(""), commit("x" * (MAX_JOB_ID_BYTES + 1)),
                JobDecision(job_id="j", state="aborted", winners=(w,)),
                commit("j", w, Winner(partition=0, attempt=2, rows=1, checksum=1)),
                JobDecision(job_id="j", state="published", winners=()),  # type: ignore[arg-type]
                commit("j", Winner(partition=0, attempt=1, rows="many",  # type: ignore[arg-type]
                                   checksum=1))):
        with pytest.raises(ValueError):
            await catalog.decide_job(bad)
    assert await catalog.job_decisions(["", "j"]) == {}


# ---- reading and pruning -------------------------------------------------------------------

@pytest.mark.asyncio
async def test_job_decisions_returns_known_ids_only(catalog: Catalog) -> None:
    a, _ = await catalog.decide_job(commit("a", Winner(partition=1, attempt=2, rows=3,
                                                       checksum=4)))
    b, _ = await catalog.decide_job(expire("b"))
    assert await catalog.job_decisions(["a", "nope", "b", "a"]) == {"a": a, "b": b}
    assert await catalog.job_decisions(iter(["b"])) == {"b": b}
    assert await catalog.job_decisions([]) == {}


@pytest.mark.asyncio
async def test_job_decisions_answers_thousands_of_ids(catalog: Catalog, target: Target) -> None:
    decisions = [commit(f"job-{i:04}", Winner(partition=i, attempt=i, rows=i, checksum=i),
                        at=1_000 + i) for i in range(3000)]
    await raw(target, INSERT_JOB, [decision_values(d) for d in decisions])
    asked = [d.job_id for d in decisions] + [f"unknown-{i}" for i in range(100)]
    got = await catalog.job_decisions(reversed(asked))
    assert got == {d.job_id: d for d in decisions}


@pytest.mark.asyncio
async def test_prune_job_decisions_deletes_only_older_ones(catalog: Catalog) -> None:
    for i, at in enumerate((100, 200, 300)):
        await catalog.decide_job(expire(f"j{i}", at=at))
    assert await catalog.prune_job_decisions(200) == 1
    assert sorted(await catalog.job_decisions(["j0", "j1", "j2"])) == ["j1", "j2"]
    assert await catalog.prune_job_decisions(200) == 0
    assert await catalog.prune_job_decisions(301) == 2
    assert await catalog.job_decisions(["j0", "j1", "j2"]) == {}
    # A pruned job has no decision: a late one stands anew.
    assert (await catalog.decide_job(commit("j0")))[1] is True


@pytest.mark.asyncio
async def test_catalog_start_creates_jobs_table_on_previous_version_database(
        catalog: Catalog, open_more: Opener, target: Target) -> None:
    await catalog.close()
    await raw(target, "DROP TABLE quiver_jobs")  # as the previous release left it
    again = await open_more()
    assert (await again.decide_job(expire("j")))[1] is True
    assert [v for v, in await raw(target, "SELECT version FROM schema_version")] == [1]
    await open_more()  # and starting on a database that has it changes nothing
    assert list(await again.job_decisions(["j"])) == ["j"]


# ---- notifications -------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_job_notifications_receive_decided_job_ids(
        catalog: Catalog, open_more: Opener, target: Target) -> None:
    # PostgreSQL: another catalog (its own pool) decides; SQLite notifies in-process only.
    writer = await open_more() if target[0].dsn else catalog
    async with catalog.job_notifications() as jobs, catalog.notifications() as files:
        await writer.decide_job(commit("A"))
        await writer.decide_job(expire("A"))  # already decided: no notification
        await writer.decide_job(expire("B"))
        await writer.register(FileRow(file_id="F", client_name="c"),
                              [Coverage(segment_seq=1, bundle_indexes=(0,))])
        with anyio.fail_after(5):
            assert [await anext(jobs) for _ in range(2)] == ["A", "B"]
            assert await anext(files) == "F"  # each feed hears its own channel only
        with anyio.move_on_after(0.2):
            extra = await anext(jobs)
            pytest.fail(f"unexpected job notification {extra}")
        with anyio.move_on_after(0.1):
            extra = await anext(files)
            pytest.fail(f"unexpected file notification {extra}")


@pytest.mark.asyncio
async def test_job_notifications_end_when_catalog_closed(catalog: Catalog) -> None:
    feed = await catalog.job_notifications()
    assert await heard_until_closed(
        catalog, feed, lambda: catalog.decide_job(expire("A"))) == ["A"]
    assert [job_id async for job_id in catalog.job_notifications()] == []


@pytest.mark.asyncio
async def test_job_notifications_raise_unavailable_when_listener_dropped(
        pg_catalog_dsn: str, tmp_path: Path) -> None:
    async with open_catalog(CatalogConfig(dsn=pg_catalog_dsn), tmp_path / "unused",
                            log=Log()) as cat:
        jobs, files = await cat.job_notifications(), await cat.notifications()
        killer = await asyncpg.connect(pg_catalog_dsn)
        try:
            killed = await killer.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN %'")
        finally:
            await killer.close()
        assert killed == 1
        with anyio.fail_after(5):
            for feed in (jobs, files):
                with pytest.raises(CatalogUnavailable):
                    await anext(feed)
        async with cat.job_notifications() as again:  # subscribing again reconnects
            assert (await cat.decide_job(expire("B")))[1] is True
            with anyio.fail_after(5):
                assert await anext(again) == "B"


@pytest.mark.asyncio
async def test_job_leases_newest_renewal_by_other_nodes_and_old_rows_pruned(
        catalog: Catalog) -> None:
    """Writer leases (runtime/leases.py): a daemon with a live writer of a job renews it;
    another daemon holding staged rows of it reads the newest renewal by anyone else."""
    day = 86_400 * 10**9
    await catalog.renew_job_leases("a", ["j", "k"], 10 * day)
    await catalog.renew_job_leases("b", ["j"], 10 * day + 5)
    await catalog.renew_job_leases("b", ["j"], 10 * day + 7)  # renewed: upserted
    assert await catalog.job_leases(["j", "k", "x"], exclude_node="c") == {
        "j": 10 * day + 7, "k": 10 * day}
    assert await catalog.job_leases(["j", "k"], exclude_node="a") == {"j": 10 * day + 7}
    assert await catalog.job_leases(["k"], exclude_node="a") == {}
    await catalog.renew_job_leases("b", [], 11 * day + 6)  # a's rows are a day old
    assert await catalog.job_leases(["j", "k"], exclude_node="c") == {"j": 10 * day + 7}
    assert await catalog.job_leases([], exclude_node="c") == {}
