"""runtime.staging: verdicts for staged bundles, decisions through a real (SQLite) catalog."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from quiverd.kernel.config import Config, LakeConfig, StagingConfig
from quiverd.kernel.errors import CatalogUnavailable, JobConflict
from quiverd.kernel.jobs import Verdict, Winner
from quiverd.kernel.metrics import Metrics
from quiverd.runtime import staging as staging_mod
from quiverd.runtime.staging import Staging
from quiverd.segments.table import SegmentInfo, StagedRef


def ref(job: str, p: int, a: int, end: tuple[int, int] | None = None) -> StagedRef:
    if end is None:
        return StagedRef(job_id=job, partition=p, attempt=a)
    return StagedRef(job_id=job, partition=p, attempt=a, end_rows=end[0], end_checksum=end[1])


def segment(seq: int, refs: list[StagedRef], *, ts_ns: int | None = None) -> SegmentInfo:
    ts = time.time_ns() if ts_ns is None else ts_ns
    return SegmentInfo(segment_seq=seq, path=Path(f"/nonexistent/{seq}"), size_bytes=1000,
                       bundle_count=len(refs), first_sequence=seq, last_sequence=seq,
                       min_ts_ns=ts, max_ts_ns=ts, staged=dict(enumerate(refs)))


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        for _ in itertools.count():
            if predicate():
                return
            await anyio.sleep(0.02)


@asynccontextmanager
async def running(tmp_path: Path, node_id: str = "", **staging: int
                  ) -> AsyncIterator[Staging]:
    """A Staging on the embedded catalog of ``tmp_path`` (several with other node ids share
    it, as daemons on one catalog do)."""
    cfg = Config(data_dir=str(tmp_path), lake=LakeConfig(node_id=node_id),
                 staging=StagingConfig(**{"poll_interval_ms": 20, **staging}))
    s = Staging(cfg, metrics=Metrics())
    async with anyio.create_task_group() as tg:
        await tg.start(s.run)
        await eventually(lambda: s.catalog is not None)
        yield s
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_commit_publishes_the_winner_only(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        s.add_segment(segment(1, [ref("j", 0, 1), ref("j", 0, 2), ref("j", 0, 2, (100, 7)),
                                  ref("j", 1, 3), ref("j", 1, 3, (5, 9))]))
        assert s.verdict(ref("j", 0, 2)) is Verdict.HOLD
        decision, already = await s.commit("j", [Winner(partition=0, attempt=2, rows=100,
                                                        checksum=7),
                                                 Winner(partition=1, attempt=3, rows=5,
                                                        checksum=8)],
                                            remote=[1])  # not checked at the commit here
        assert decision.state == "committed" and not already
        assert s.verdict(ref("j", 0, 2)) is Verdict.PUBLISH
        assert s.verdict(ref("j", 0, 1)) is Verdict.DISCARD  # the losing attempt
        assert s.verdict(ref("j", 0, 2, (100, 7))) is Verdict.DISCARD  # markers never go out
        # The commit's checksum differs from the marker's: never published, counted.
        assert s.verdict(ref("j", 1, 3)) is Verdict.DISCARD
        assert s.m.staged_invalid.total() == 1
        assert (await s.commit("j", decision.winners))[1]  # idempotent: already


@pytest.mark.asyncio
async def test_a_commit_naming_winners_without_their_end_marker_here_is_refused(
        tmp_path: Path) -> None:
    """Issue 26: such a commit was recorded, and `visible` then answered true with 0
    bundles: the rows were discarded as invalid after MARKER_WAIT_S."""
    async with running(tmp_path) as s:
        s.add_segment(segment(1, [ref("j", 0, 1), ref("j", 1, 2), ref("j", 1, 2, (5, 9)),
                                  ref("j", 2, 3), ref("j", 2, 3, (4, 4))]))
        with pytest.raises(JobConflict) as info:
            await s.commit("j", [Winner(partition=0, attempt=1, rows=100, checksum=7),
                                 Winner(partition=1, attempt=2, rows=5, checksum=9),
                                 Winner(partition=2, attempt=3, rows=4, checksum=5),
                                 Winner(partition=3, attempt=4, rows=1, checksum=1)])
        text = str(info.value)
        assert "no end-of-partition marker on this daemon for partitions 0 (attempt 1), " \
               "3 (attempt 4)" in text
        assert "a different end marker for partitions 2 (attempt 3: marker rows=4 " \
               "checksum=4, commit rows=4 checksum=5)" in text
        assert "j" not in s.decisions and (await s.lookup("j"))["state"] == "staged"
        decision, _ = await s.commit("j", [Winner(partition=1, attempt=2, rows=5, checksum=9),
                                           Winner(partition=3, attempt=4, rows=1,
                                                  checksum=1)], remote=[3])
        assert decision.state == "committed"
        assert s.verdict(ref("j", 1, 2)) is Verdict.PUBLISH
        # Committed: the same commit again is answered as it stands, unchecked.
        assert (await s.commit("j", decision.winners))[1]


@pytest.mark.asyncio
async def test_a_winner_whose_marker_is_not_here_is_held_then_discarded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_mod, "MARKER_WAIT_S", 0.2)
    async with running(tmp_path) as s:
        s.add_segment(segment(1, [ref("j", 0, 1)]))
        await s.commit("j", [Winner(partition=0, attempt=1, rows=1, checksum=1)], remote=[0])
        assert s.verdict(ref("j", 0, 1)) is Verdict.HOLD  # the marker may still come
        await anyio.sleep(0.3)
        assert s.verdict(ref("j", 0, 1)) is Verdict.DISCARD


@pytest.mark.asyncio
async def test_abort_after_commit_and_commit_after_abort_conflict(tmp_path: Path) -> None:
    async with running(tmp_path) as s:
        await s.commit("c", [])
        with pytest.raises(JobConflict, match="already committed"):
            await s.abort("c")
        await s.abort("a", "task failed")
        with pytest.raises(JobConflict, match="already aborted"):
            await s.commit("a", [])
        with pytest.raises(ValueError):
            await s.commit("x", [Winner(partition=0, attempt=1, rows=1, checksum=1),
                                 Winner(partition=0, attempt=2, rows=1, checksum=1)])


@pytest.mark.asyncio
async def test_a_decision_made_elsewhere_is_found_by_polling(tmp_path: Path) -> None:
    async with running(tmp_path) as a, running(tmp_path) as b:  # one catalog file, two nodes
        b.add_segment(segment(1, [ref("j", 0, 1), ref("j", 0, 1, (1, 1))]))
        await a.commit("j", [Winner(partition=0, attempt=1, rows=1, checksum=1)], remote=[0])
        await eventually(lambda: b.verdict(ref("j", 0, 1)) is not Verdict.HOLD)
        assert b.verdict(ref("j", 0, 1)) is Verdict.PUBLISH


@pytest.mark.asyncio
async def test_an_undecided_job_expires_after_the_ttl_and_leaves_with_its_segments(
        tmp_path: Path) -> None:
    async with running(tmp_path, ttl_s=1) as s:
        old = time.time_ns() - 2 * 10**9
        info = segment(1, [ref("old", 0, 1)], ts_ns=old)
        s.add_segment(info)
        s.add_segment(segment(2, [ref("new", 0, 1)]))
        await eventually(lambda: "old" in s.decisions)
        assert s.decisions["old"].state == "expired"
        assert s.verdict(ref("old", 0, 1)) is Verdict.DISCARD
        assert s.verdict(ref("new", 0, 1)) is Verdict.HOLD
        assert s.status()["undecided_jobs"] == 1
        s.remove_segment(info)
        assert "old" not in s.jobs and "old" not in s.decisions
        assert (await s.lookup("old"))["state"] == "expired"  # the catalog still knows


@pytest.mark.asyncio
async def test_commit_without_a_catalog_is_refused_as_retryable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_mod, "CATALOG_WAIT_S", 0.1)
    s = Staging(Config(data_dir=str(tmp_path)), metrics=Metrics())
    with pytest.raises(CatalogUnavailable):
        await s.commit("j", [])


@pytest.mark.asyncio
async def test_status_without_the_catalog_is_retryable_unless_the_decision_is_known(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: with the catalog unreachable, status answered "staged"/"unknown" from local
    state, which another daemon's decision may already contradict."""
    monkeypatch.setattr(staging_mod, "CATALOG_WAIT_S", 0.1)
    async with running(tmp_path) as s:
        s.add_segment(segment(1, [ref("j", 0, 1, (100, 7)), ref("k", 0, 1)]))
        await s.commit("j", [Winner(partition=0, attempt=1, rows=100, checksum=7)])
        assert (await s.lookup("k"))["state"] == "staged"
    assert s.catalog is None  # the catalog is gone
    assert (await s.lookup("j"))["state"] == "committed"  # a decision is final: known here
    for job in ("k", "never-seen"):
        with pytest.raises(CatalogUnavailable, match="catalog is unreachable") as info:
            await s.lookup(job)
        assert info.value.retryable and "retry" in info.value.hint


@pytest.mark.asyncio
async def test_status_asked_before_the_catalog_connects_waits_for_it(tmp_path: Path) -> None:
    s = Staging(Config(data_dir=str(tmp_path)), metrics=Metrics())
    s.add_segment(segment(1, [ref("k", 0, 1)]))
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.run)  # connects while the lookup below already waits
        assert s.catalog is None
        assert (await s.lookup("k"))["state"] == "staged"
        tg.cancel_scope.cancel()
