"""AckState: marks, gap sets, deletability, drops; live state always equals replay."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quiverd.acks import format as fmt
from quiverd.acks.log import AckLogFile, compact, replay_ack_log
from quiverd.acks.registry import SubscriberExists, UnknownSubscriber
from quiverd.acks.state import AckState, UnknownBundle
from quiverd.kernel.errors import AtCapacity
from quiverd.kernel.names import InvalidSubscriberName
from tests.tiers import size

LOG = structlog.get_logger("test")


class Harness:
    """The ack_logger's loop in miniature: propose -> append -> sync -> apply."""

    def __init__(self, tmp_path: Path, state: AckState | None = None) -> None:
        self.path = tmp_path / "ack.log"
        self.qdir = tmp_path / "quarantine"
        self.state = state or AckState()
        self.file = AckLogFile.open(self.path)

    def commit(self, *records: fmt.Record | None) -> None:
        real = [r for r in records if r is not None]
        self.file.append([fmt.encode(r) for r in real])
        self.file.sync()
        for r in real:
            self.state.apply(r)

    def segment(self, seq: int, count: int) -> None:
        self.commit(self.state.segment_finalized(seq, count))

    def ack(self, sub: str, seq: int, *idxs: int, outcome: int = fmt.ACK) -> None:
        self.commit(*(self.state.record_outcome(sub, seq, i, outcome) for i in idxs))

    def replayed(self) -> AckState:
        return replay_ack_log(self.path, self.qdir, log=LOG)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.file.close()


def test_deletable_nothing_when_one_subscriber_acked_nothing(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.commit(h.state.add_subscriber("b"))
    for seq in (1, 2):
        h.segment(seq, 3)
        h.ack("a", seq, 0, 1, 2)
    assert h.state.deletable_segments() == []
    h.ack("b", 1, 0, 1, 2)
    assert h.state.deletable_segments() == [1]
    assert h.replayed().deletable_segments() == [1]


def test_deletable_nothing_without_subscribers(h: Harness) -> None:
    h.segment(1, 1)
    assert h.state.deletable_segments() == []


def test_mark_does_not_pass_gap_until_acked(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    for seq in (1, 2, 3):
        h.segment(seq, 2)
    h.ack("a", 1, 1)
    h.ack("a", 2, 0, 1)
    h.ack("a", 3, 0, 1)
    assert h.state.high_water_mark("a") is None
    assert h.state.gap_set("a") == {(1, 1), (2, 0), (2, 1), (3, 0), (3, 1)}
    assert list(h.state.pending_for("a")) == [(1, 0)]
    assert h.replayed().checkpoint_record() == h.state.checkpoint_record()
    h.ack("a", 1, 0)
    assert h.state.high_water_mark("a") == 3 and h.state.gap_set("a") == set()
    assert h.state.deletable_segments() == [1, 2, 3]
    replayed = h.replayed()
    assert replayed.high_water_mark("a") == 3
    assert replayed.checkpoint_record() == h.state.checkpoint_record()


def test_dropped_advances_mark_and_counts_per_subscriber(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.commit(h.state.add_subscriber("b"))
    h.segment(1, 3)
    h.segment(2, 1)
    h.ack("a", 1, 0, 1, 2)
    h.ack("b", 1, 1)
    h.ack("b", 2, 0)
    plan = h.state.drop_segment(1)
    assert plan.dropped_by_subscriber == {"b": 2}
    assert [(r.segment_seq, r.bundle_index, r.outcome) for r in plan.records] == [
        (1, 0, fmt.DROPPED), (1, 2, fmt.DROPPED)]
    h.commit(*plan.records)
    assert h.state.high_water_mark("b") == 2
    assert h.state.deletable_segments() == [1]
    h.commit(h.state.segment_deleted(1))
    assert h.state.live_segments() == {2: 1}
    assert h.replayed().checkpoint_record() == h.state.checkpoint_record()


def test_reject_is_final_advances_the_mark_and_survives_compaction(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.segment(1, 3)
    h.ack("a", 1, 1, outcome=fmt.REJECTED)
    assert h.state.is_done("a", 1, 1) and list(h.state.pending_for("a")) == [(1, 0), (1, 2)]
    # The first final outcome wins: an ack or a nack after the reject changes nothing.
    assert h.state.record_outcome("a", 1, 1, fmt.ACK) is None
    assert h.state.record_outcome("a", 1, 1, fmt.NACK) is None
    replayed = h.replayed()
    assert replayed.checkpoint_record() == h.state.checkpoint_record()
    assert (1, 1, fmt.REJECTED, 0) in replayed.checkpoint_record().subscribers[0].entries
    h.file.compact(h.state)  # the checkpoint keeps the rejected outcome
    assert h.replayed().checkpoint_record() == h.state.checkpoint_record()
    h.ack("a", 1, 0, 2)
    assert h.state.high_water_mark("a") == 1 and h.state.deletable_segments() == [1]


def test_from_latest_ignores_old_segments(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.segment(1, 2)
    h.segment(2, 2)
    h.commit(h.state.add_subscriber("late", from_="latest"))
    assert list(h.state.pending_for("late")) == []
    assert h.state.record_outcome("late", 1, 0, fmt.ACK) is None
    h.ack("a", 1, 0, 1)
    assert h.state.deletable_segments() == [1]
    h.segment(3, 1)
    assert list(h.state.pending_for("late")) == [(3, 0)]
    assert list(h.state.pending_for("a")) == [(2, 0), (2, 1), (3, 0)]


def test_remove_subscriber_releases_hold(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.commit(h.state.add_subscriber("slow"))
    h.segment(1, 1)
    h.ack("a", 1, 0)
    assert h.state.deletable_segments() == []
    h.commit(h.state.remove_subscriber("slow"))
    assert h.state.deletable_segments() == [1]
    with pytest.raises(UnknownSubscriber):
        h.state.lag("slow")
    replayed = h.replayed()
    assert "slow" not in replayed.registry and replayed.deletable_segments() == [1]
    # Ids are never reused: a re-added name gets a new id.
    h.commit(h.state.add_subscriber("slow"))
    assert h.state.registry.get("slow").subscriber_id == 3


def test_nack_counts_and_ack_after_nack(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.segment(1, 2)
    h.ack("a", 1, 0, outcome=fmt.NACK)
    h.ack("a", 1, 0, outcome=fmt.NACK)
    assert h.state.nack_count("a", 1, 0) == 2
    assert h.state.lag("a") == h.state.lag("a").__class__(
        segments_behind=1, bundles_pending=2, gap_entries=0, nacked_bundles=1)
    compact(h.path, h.state)  # nack counts survive compaction too
    assert h.replayed().nack_count("a", 1, 0) == 2
    h.file.close()
    h.file = AckLogFile.open(h.path)
    h.ack("a", 1, 0, 1)
    assert h.state.nack_count("a", 1, 0) == 0 and h.state.high_water_mark("a") == 1
    assert h.state.record_outcome("a", 1, 0, fmt.NACK) is None  # after the mark: stale


def test_record_outcome_validates(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.segment(1, 2)
    with pytest.raises(UnknownBundle):
        h.state.record_outcome("a", 1, 2, fmt.ACK)
    with pytest.raises(UnknownBundle):
        h.state.record_outcome("a", 5, 0, fmt.ACK)
    with pytest.raises(UnknownSubscriber):
        h.state.record_outcome("zz", 1, 0, fmt.ACK)
    with pytest.raises(ValueError):
        h.state.record_outcome("a", 1, 0, 99)  # not an outcome
    # ``dropped`` is the dispatcher's for a discarded staged bundle (SPEC §7), and is
    # never refused for a full gap set: it must always let the mark move on.
    assert h.state.record_outcome("a", 1, 1, fmt.DROPPED) is not None
    with pytest.raises(ValueError, match="increasing"):
        h.state.segment_finalized(0, 1)


@pytest.mark.parametrize("name", ["", "A", "a b", "x" * 65, "é", "a/b"])
def test_add_subscriber_invalid_name_clear_error(h: Harness, name: str) -> None:
    with pytest.raises(InvalidSubscriberName, match=r"\[a-z0-9_-\]\{1,64\}"):
        h.state.add_subscriber(name)


def test_add_subscriber_twice_refused(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    with pytest.raises(SubscriberExists):
        h.state.add_subscriber("a")


def test_gap_set_bounded(tmp_path: Path) -> None:
    h = Harness(tmp_path, AckState(max_gap_entries=2))
    h.commit(h.state.add_subscriber("a"))
    for seq in (1, 2, 3):
        h.segment(seq, 2)
    h.ack("a", 2, 0, 1)
    with pytest.raises(AtCapacity):
        h.state.record_outcome("a", 3, 0, fmt.ACK)
    h.ack("a", 1, 1)  # the frontier segment is always accepted
    h.ack("a", 1, 0)
    assert h.state.high_water_mark("a") == 2
    h.file.close()


def test_reconcile_matches_disk(h: Harness) -> None:
    h.segment(1, 1)
    h.segment(2, 1)
    h.segment(3, 1)
    h.commit(h.state.segment_deleted(1))
    rec = h.state.reconcile({1: 1, 3: 1, 4: 2})
    assert rec.records == [fmt.SegmentFinalized(segment_seq=4, bundle_count=2),
                           fmt.SegmentDeleted(segment_seq=2)]
    assert rec.orphans == [1]


# ---- property: marks equal a brute-force recomputation; replay equals live --------

SUBS = ("a", "b", "c")
# Outcomes dominate so that segments actually complete and marks move.
KINDS = ["outcome"] * 10 + ["segment"] * 3 + ["add"] * 2 + [
    "drop", "delete", "vanish", "remove", "compact"]
op = st.tuples(st.sampled_from(KINDS), st.sampled_from(SUBS), st.integers(0, 3),
               st.integers(0, 2), st.sampled_from([fmt.ACK, fmt.ACK, fmt.NACK, fmt.REJECTED]),
               st.sampled_from(["earliest", "latest"]))


def brute_covered(state: AckState, start: int, finals: set[tuple[int, int]]) -> list[int]:
    """Live segments the mark must cover: below the start, then the contiguous done run."""
    live = sorted(state.live_segments().items())
    covered = [seq for seq, _ in live if seq < start]
    for seq, count in live:
        if seq < start:
            continue
        if not all((seq, i) in finals for i in range(count)):
            break
        covered.append(seq)
    return covered


def run_op(h: Harness, o: tuple, finals: dict[str, set[tuple[int, int]]]) -> None:
    kind, sub, pick, idx, outcome, from_ = o
    s = h.state
    live = sorted(s.live_segments())
    seq = live[pick % len(live)] if live else None
    if kind == "segment":
        h.segment(s.segment_floor, idx + pick % 2)
    elif kind == "outcome" and sub in s.registry and seq is not None:
        count = s.live_segments()[seq]
        rec = s.record_outcome(sub, seq, idx % count, outcome) if count else None
        h.commit(rec)
        if rec is not None and outcome in (fmt.ACK, fmt.REJECTED):  # final outcomes
            finals[sub].add((seq, idx % count))
    elif kind == "drop" and seq is not None:
        plan = s.drop_segment(seq)
        h.commit(*plan.records)
        for r in plan.records:
            finals[s.registry.by_id(r.subscriber_id).name].add((seq, r.bundle_index))  # type: ignore[union-attr]
        h.commit(s.segment_deleted(seq))
    elif kind == "vanish" and seq is not None:  # a quarantined segment: no drops written
        h.commit(s.segment_deleted(seq))
    elif kind == "delete" and s.deletable_segments():
        h.commit(s.segment_deleted(s.deletable_segments()[0]))
    elif kind == "add" and sub not in s.registry:
        h.commit(s.add_subscriber(sub, from_=from_))
        finals[sub] = set()
    elif kind == "remove" and sub in s.registry:
        h.commit(s.remove_subscriber(sub))
    elif kind == "compact":
        h.file.compact(s)


# 100 op sequences in the default tier, 300 in the full one (tests/tiers.py).
@settings(max_examples=size(100, 300), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, max_size=60))
def test_property_marks_match_brute_force_and_replay(tmp_path_factory: pytest.TempPathFactory,
                                                     ops: list[tuple]) -> None:
    h = Harness(tmp_path_factory.mktemp("ack"))
    finals: dict[str, set[tuple[int, int]]] = {}
    try:
        for o in ops:
            run_op(h, o, finals)
            for sub in h.state.registry:
                want = brute_covered(h.state, sub.start_segment, finals[sub.name])
                mark = h.state.covered_below(sub.name)
                assert [seq for seq in sorted(h.state.live_segments()) if seq < mark] == want
                lag = h.state.lag(sub.name)
                assert lag.gap_entries == len(h.state.gap_set(sub.name))
                assert lag.bundles_pending == len(list(h.state.pending_for(sub.name)))
            deletable = h.state.deletable_segments()
            for seq in deletable:
                assert all(seq < h.state.covered_below(sub.name) for sub in h.state.registry)
        assert h.replayed().checkpoint_record() == h.state.checkpoint_record()
    finally:
        h.file.close()


def test_deleted_blocking_segment_releases_mark(h: Harness) -> None:
    h.commit(h.state.add_subscriber("a"))
    h.segment(1, 2)
    h.segment(2, 1)
    h.ack("a", 2, 0)
    assert h.state.high_water_mark("a") is None
    h.commit(h.state.segment_deleted(1))  # e.g. quarantined as corrupt
    assert h.state.high_water_mark("a") == 2
    assert h.replayed().high_water_mark("a") == 2
