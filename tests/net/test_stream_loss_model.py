"""A ranged reader against retention, explored by Hypothesis (issue 26's silent loss).

The real ``latest`` (quiverd.net.consumers._latest: ranges.span, past_deleted, lost) and
``picks`` run over a shard whose segments are finalized, read, committed, acked away and
deleted by retention in any order. The model: every bundle of every segment is, in the
end, either delivered to the reader or reported lost to it, never both and never
neither; only bundles of deleted segments are reported; a batch re-read gets the same
bundles.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quiverd.net import consumers
from quiverd_actors import ranges
from tests.tiers import size

END = ranges.END_OF_SEGMENT
SEGMENTS = 8


class Segments:
    """The SegmentView a dispatcher reads: live segments by number."""

    def __init__(self) -> None:
        self.rows: dict[int, Any] = {}

    def seqs(self) -> list[int]:
        return sorted(self.rows)

    def get(self, seq: int) -> Any:
        return self.rows.get(seq)

    def __contains__(self, seq: object) -> bool:
        return seq in self.rows

    def __getitem__(self, seq: int) -> Any:
        return self.rows[seq]


class ReaderAgainstRetention(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.segments = Segments()
        self.counts: dict[int, int] = {}  # every segment ever finalized
        self.dropped = 0  # the subscriber's dropped counter (retention's)
        self.d = SimpleNamespace(
            shard=0, segments=self.segments, verdict=None,
            state=SimpleNamespace(segment_floor=1),
            stats=SimpleNamespace(dropped_count=lambda sub: self.dropped))
        self.pos: tuple[int, int] = (0, -1)  # the reader's committed offset
        self.acked: tuple[int, int] = (0, -1)  # what its commits acked (trails pos)
        self.delivered: set[tuple[int, int]] = set()
        self.reported: set[tuple[int, int]] = set()

    @precondition(lambda self: len(self.counts) < SEGMENTS)
    @rule(count=st.integers(1, 4))
    def finalize(self, count: int) -> None:
        seq = len(self.counts) + 1
        self.counts[seq] = count
        self.segments.rows[seq] = SimpleNamespace(bundle_count=count, staged=None)
        self.d.state.segment_floor = seq + 1

    @rule(data=st.data())
    def retention_deletes(self, data: st.DataObject) -> None:
        """drop_oldest / max_age / recovery: any live segment, read or not."""
        live = self.segments.seqs()
        if not live:
            return
        seq = data.draw(st.sampled_from(live))
        unread = [i for i in range(self.counts[seq]) if (seq, i) > self.acked]
        self.dropped += len(unread)
        del self.segments.rows[seq]

    @rule()
    def gc_deletes_acked(self) -> None:
        for seq in self.segments.seqs():
            if (seq, self.counts[seq] - 1) <= self.acked:
                del self.segments.rows[seq]

    @rule(max_bundles=st.integers(0, 5), rerun=st.booleans())
    def batch(self, max_bundles: int, rerun: bool) -> None:
        """latest, fetch, commit: one micro-batch (re-fetched once when ``rerun``)."""
        req = consumers._Latest(subscriber="s", start={"0": self.pos}, max_bundles=max_bundles)
        reply = consumers._latest([self.d], req)  # type: ignore[list-item]
        end = tuple(reply["end"]["0"])
        assert end >= self.pos
        for run in reply["lost"]:
            first, last = run["segments"]
            for seq in range(first, last + 1):
                assert seq not in self.segments, f"live segment {seq} reported lost"
                bundles = {(seq, i) for i in range(self.counts.get(seq, 0))
                           if tuple(run["after"]) < (seq, i) <= tuple(run["through"])}
                assert bundles, f"segment {seq} reported lost with no bundle lost: {run}"
                assert not bundles & self.delivered, "a delivered bundle reported lost"
                self.reported |= bundles
        got = self._fetch(self.pos, end)
        if rerun:
            assert self._fetch(self.pos, end) == got  # nothing deleted between: same bundles
        assert len(got) == reply["bundles"] or reply["lost"] or max_bundles
        assert not set(got) & self.delivered, "a bundle delivered twice"
        self.delivered |= set(got)
        self.acked, self.pos = self.pos, end  # Spark acks the previous batch's end

    def _fetch(self, after: tuple[int, int], through: tuple[int, int]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while after < through:
            wanted, after = ranges.picks(self.d, after, through, limit=3)  # type: ignore[arg-type]
            out += wanted
        return out

    @invariant()
    def nothing_both(self) -> None:
        assert not self.delivered & self.reported

    def teardown(self) -> None:
        """Caught up: every bundle was delivered or reported lost."""
        for _ in range(SEGMENTS + 2):
            self.batch(0, False)
        every = {(s, i) for s, n in self.counts.items() for i in range(n)}
        missing = every - self.delivered - self.reported
        assert not missing, f"bundles neither delivered nor reported lost: {sorted(missing)}"
        assert self.reported <= {(s, i) for s, i in every if s not in self.segments}


ReaderAgainstRetention.TestCase.settings = settings(max_examples=size(100, 300),
                                                    stateful_step_count=30, deadline=None)
test_reader_against_retention = ReaderAgainstRetention.TestCase
