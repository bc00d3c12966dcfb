"""Staged files (actors/quiverd_actors/uploader/staged.py): a job's rows become Parquet
while it is undecided, and reach the catalog only through the usual publish path.

The uploader in process, real Parquet files, the fs store and the SQLite catalog; the
dispatcher's two kinds of delivery are sent by hand: ``staged=True`` (a held bundle,
given early) and the published one after the decision. Every test checks the registered
files' rows against the bundles acked: each acked bundle's rows once, nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.acks import format as ackfmt
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.jobs import END_OFFSET, JobDecision, Winner, end_marker_table
from quiverd.kernel.metrics import Metrics
from quiverd.lake.health import LakeHealth
from quiverd.lake.model import FileState
from quiverd.lake.tier import Tier
from quiverd_actors.dispatcher import Session
from quiverd_actors.messages import LocalDelivery
from quiverd_actors.uploader import Uploader
from quiverd_actors.uploader import staged as staged_files
from tests.actors.test_uploader import Acks, registered, rows
from tests.daemon.lake_helpers import uri_path
from tests.lake.helpers import open_test_tier

# Files never rotate on time or size here: only a staged file's completion publishes
# one, or the window (two bundles held) an ordinary one.
NO_TIMERS: dict[str, Any] = {"file_duration_ms": 3_600_000, "window_bundles": 4}


def staged(seg: int, idx: int, job: str, partition: int, attempt: int, table: pa.Table, *,
           published: bool = False) -> LocalDelivery:
    return LocalDelivery(shard=0, segment_seq=seg, bundle_index=idx, client="spark",
                         txn=TxnTag(job_id=job, partition=partition, attempt=attempt,
                                    row_offset=0),
                         ingestion_ts_ns=1_700_000_000_000_000_000 + idx, tables={0: table},
                         staged=not published)


def committed(job: str, *winners: tuple[int, int]) -> JobDecision:
    return JobDecision(job_id=job, state="committed", winners=tuple(
        Winner(partition=p, attempt=a, rows=0, checksum=0) for p, a in winners))


@asynccontextmanager
async def running(tier: Tier, decisions: dict[str, JobDecision]
                  ) -> AsyncIterator[tuple[Acks, Uploader, Any]]:
    acks = Acks()
    tx, rx = anyio.create_memory_object_stream[LocalDelivery](256)
    unused_tx, unused_rx = anyio.create_memory_object_stream[LocalDelivery](1)
    session = Session(name="uploader", window=256, deliveries=unused_tx, local=True)
    uploader = Uploader(tier, [acks], session,
                        limiter=anyio.CapacityLimiter(2), log=_log(), metrics=Metrics(),
                        health=LakeHealth(log=_log()), decided=decisions.get)
    with tx, rx, unused_tx, unused_rx:
        async with anyio.create_task_group() as tg:
            await tg.start(uploader.run, rx)
            try:
                yield acks, uploader, tx
            finally:
                tg.cancel_scope.cancel()


def _log() -> Any:
    from tests.lake.helpers import LOG
    return LOG


async def staged_rows(tier: Tier) -> list[Any]:
    """Catalog rows of files not yet finished (staged files waiting, among others)."""
    return [r for r in await tier.catalog.list_files()
            if r.state in (FileState.RECEIVED, FileState.APPENDED)]


async def until(check: Any, within_s: float = 20) -> None:
    for _ in range(int(within_s / 0.02)):
        if await check():
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"not reached in {within_s} s")


async def lake_values(tier: Tier) -> list[int]:
    files = await registered(tier)
    return sorted(v for f in files for v in pq.read_table(uri_path(f.uri))["v"].to_pylist())


def outcome_counts(uploader: Uploader) -> dict[str, float]:
    return {k: v for k, v in uploader.m.lake_staged_files.by_label("outcome").items() if v}


@pytest.mark.asyncio
async def test_a_winners_staged_file_is_published_once_its_bundles_come_published(
        tmp_path: Path) -> None:
    decisions: dict[str, JobDecision] = {}
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 7, rows(5)))
        await tx.send(staged(1, 1, "j", 0, 7, rows(5, 5)))
        await until(lambda: _wrote(uploader, 2))
        assert acks.outcomes == []  # undecided: nothing acked, nothing registered
        assert await registered(tier) == []
        decisions["j"] = committed("j", (0, 7))
        await tx.send(staged(1, 0, "j", 0, 7, rows(5), published=True))
        await tx.send(staged(1, 1, "j", 0, 7, rows(5, 5), published=True))
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.ACK), (1, 1, ackfmt.ACK)]
        files = await registered(tier)
        assert [(f.row_count, f.bundle_count) for f in files] == [(10, 2)]
        assert await lake_values(tier) == list(range(10))
        assert uploader.m.lake_rotations.labels("staged").value == 1
        assert uploader.m.lake_staged_files.labels("published").value == 1
        assert not uploader.staged.every and not uploader.staged.pieces


async def _wrote(uploader: Uploader, bundles: int) -> bool:
    return sum(len(f.bundles) for f in uploader.staged.every) >= bundles


@pytest.mark.asyncio
async def test_a_losing_attempts_staged_file_is_abandoned_and_never_registered(
        tmp_path: Path) -> None:
    decisions: dict[str, JobDecision] = {}
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 1, rows(3)))  # the speculative twin
        await tx.send(staged(1, 1, "j", 0, 2, rows(3, 100)))  # the winner
        await until(lambda: _wrote(uploader, 2))
        decisions["j"] = committed("j", (0, 2))
        await tx.send(staged(1, 1, "j", 0, 2, rows(3, 100), published=True))
        await acks.until(lambda o: len(o) == 1)
        assert acks.outcomes == [(1, 1, ackfmt.ACK)]

        async def gone() -> bool:
            return not uploader.staged.every
        await until(gone, within_s=10)  # the timer's tick (1 s) finds the loser
        assert await lake_values(tier) == [100, 101, 102]
        abandoned = [r for r in await tier.catalog.list_files()
                     if r.state == FileState.ABANDONED]
        assert len(abandoned) == 1
        assert not list(tier.data.staging_active.iterdir())  # its local file is gone
        assert outcome_counts(uploader) == {"published": 1, "lost": 1}


@pytest.mark.asyncio
async def test_an_aborted_jobs_staged_files_are_abandoned(tmp_path: Path) -> None:
    decisions: dict[str, JobDecision] = {}
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 1, rows(3)))
        await tx.send(staged(1, 1, "j", 1, 2, rows(3, 3)))
        await until(lambda: _wrote(uploader, 2))
        decisions["j"] = JobDecision(job_id="j", state="aborted")

        async def gone() -> bool:
            return not uploader.staged.every and not await staged_rows(tier)
        await until(gone, within_s=10)
        assert acks.outcomes == [] and await registered(tier) == []
        assert outcome_counts(uploader) == {"lost": 2}


@pytest.mark.asyncio
async def test_a_staged_file_whose_other_bundles_never_come_is_given_up_rows_land_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention dropped bundle (1, 1) after it was given early: the staged file can never
    complete. It is given up, bundle (1, 0) nacked, and its redelivery takes the usual
    path: the lake holds (1, 0)'s rows once and none of (1, 1)'s."""
    monkeypatch.setattr(staged_files, "STALLED_S", 0.3)
    decisions: dict[str, JobDecision] = {}
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 1, rows(4)))
        await tx.send(staged(1, 1, "j", 0, 1, rows(4, 50)))
        await until(lambda: _wrote(uploader, 2))
        decisions["j"] = committed("j", (0, 1))
        await tx.send(staged(1, 0, "j", 0, 1, rows(4), published=True))
        await acks.until(lambda o: len(o) == 1)
        assert acks.outcomes == [(1, 0, ackfmt.NACK)]
        assert outcome_counts(uploader) == {"stalled": 1}
        # Redelivered after its backoff: an ordinary file now, rotated by the window.
        await tx.send(staged(1, 0, "j", 0, 1, rows(4), published=True))
        await tx.send(LocalDelivery(shard=0, segment_seq=1, bundle_index=2, client="spark",
                                    txn=None, ingestion_ts_ns=1_700_000_000_000_000_002,
                                    tables={0: rows(1, 900)}))
        await acks.until(lambda o: len(o) == 3)
        assert sorted(acks.outcomes[1:]) == [(1, 0, ackfmt.ACK), (1, 2, ackfmt.ACK)]
        assert await lake_values(tier) == [0, 1, 2, 3, 900]


@pytest.mark.asyncio
async def test_a_bundle_not_given_early_takes_the_usual_path_beside_the_staged_file(
        tmp_path: Path) -> None:
    """Bundle (1, 1) was still in the open segment when the job committed: the staged
    file holds only (1, 0) and is published alone; (1, 1) goes into an ordinary file."""
    decisions = {"j": committed("j", (0, 1))}
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 1, rows(2)))
        await until(lambda: _wrote(uploader, 1))
        await tx.send(staged(1, 0, "j", 0, 1, rows(2), published=True))
        await tx.send(staged(1, 1, "j", 0, 1, rows(2, 2), published=True))
        uploader.rush("j", {(0, 1, 1)})  # the commit's read-your-writes request
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.ACK), (1, 1, ackfmt.ACK)]
        files = sorted(await registered(tier), key=lambda f: f.first_bundle)
        assert [(f.first_bundle, f.bundle_count) for f in files] == [(0, 1), (1, 1)]
        assert await lake_values(tier) == [0, 1, 2, 3]


@pytest.mark.asyncio
async def test_a_schema_the_staged_file_cannot_take_opens_another_for_the_attempt(
        tmp_path: Path) -> None:
    decisions: dict[str, JobDecision] = {}
    other = pa.table({"v": pa.array(["x", "y"])})  # int64 -> string: no common type
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 1, rows(2)))
        await tx.send(staged(1, 1, "j", 0, 1, other))
        await until(lambda: _wrote(uploader, 2))
        assert len(uploader.staged.every) == 2
        decisions["j"] = committed("j", (0, 1))
        await tx.send(staged(1, 0, "j", 0, 1, rows(2), published=True))
        await tx.send(staged(1, 1, "j", 0, 1, other, published=True))
        await acks.until(lambda o: len(o) == 2)
        assert sorted(acks.outcomes) == [(1, 0, ackfmt.ACK), (1, 1, ackfmt.ACK)]
        assert sorted(f.row_count for f in await registered(tier)) == [2, 2]
        assert outcome_counts(uploader) == {"published": 2}


@pytest.mark.asyncio
async def test_an_attempts_end_marker_writes_its_staged_rows_before_the_commit(
        tmp_path: Path) -> None:
    """The end marker comes early too: the attempt's buffered rows are written as a row
    group then, so the commit only seals the file."""
    decisions: dict[str, JobDecision] = {}
    async with open_test_tier(tmp_path, **NO_TIMERS) as tier, \
            running(tier, decisions) as (acks, uploader, tx):
        await tx.send(staged(1, 0, "j", 0, 1, rows(3)))
        await until(lambda: _wrote(uploader, 1))
        (f,) = uploader.staged.every
        assert f.active is None and f.parts  # buffered: under a row group's size
        marker = LocalDelivery(shard=0, segment_seq=1, bundle_index=1, client="spark",
                               txn=TxnTag(job_id="j", partition=0, attempt=1,
                                          row_offset=END_OFFSET),
                               ingestion_ts_ns=1, tables={0: end_marker_table(3, 0)},
                               staged=True)
        await tx.send(marker)

        async def written() -> bool:
            return f.active is not None and not f.parts
        await until(written)
        assert not uploader.staged.open and f in uploader.staged.every
        assert tier.cfg.lake.row_group_bytes > 3 * 8  # not the size that wrote it
        decisions["j"] = committed("j", (0, 1))
        await tx.send(staged(1, 0, "j", 0, 1, rows(3), published=True))
        await acks.until(lambda o: len(o) == 1)
        assert acks.outcomes == [(1, 0, ackfmt.ACK)]
        assert await lake_values(tier) == [0, 1, 2]
