"""Writer leases (runtime/leases.py) against a model: connections that hold jobs open and
close in any order, jobs seen in segments and forgotten, the clock moving on.

The property: a job is held exactly while some open connection holds it, and otherwise
its idle time is the time since its last holder left, else since it was first seen,
else since the daemon started; never more (a dead job would expire early) and never
less (a dead job would be kept).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as stg
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from quiverd.runtime.leases import Leases
from tests.tiers import size

JOBS = stg.sampled_from(["a", "b", "c"])
CONNS = stg.integers(min_value=1, max_value=4)


class LeaseModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.leases = Leases(clock=lambda: self.now)
        self.open: dict[int, set[str]] = {}  # connection -> jobs it holds
        self.free_at: dict[str, float] = {}  # job -> when it last became free / was seen

    @rule(conn=CONNS, job=JOBS)
    def hold(self, conn: int, job: str) -> None:
        self.leases.hold(job, conn)
        self.open.setdefault(conn, set()).add(job)
        self.free_at.pop(job, None)

    @rule(conn=CONNS)
    def close(self, conn: int) -> None:
        freed = set(self.leases.release(conn))
        jobs = self.open.pop(conn, set())
        still = set().union(*self.open.values()) if self.open else set()
        assert freed == jobs - still
        for job in freed:
            self.free_at[job] = self.now

    @rule(job=JOBS)
    def seen(self, job: str) -> None:
        self.leases.seen(job)
        if not self._held(job):
            self.free_at.setdefault(job, self.now)

    @rule(job=JOBS)
    def forget(self, job: str) -> None:
        self.leases.forget(job)
        if not self._held(job):
            self.free_at.pop(job, None)

    @rule(dt=stg.floats(min_value=0, max_value=500))
    def tick(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def idle_matches_the_model(self) -> None:
        for job in ("a", "b", "c"):
            idle = self.leases.idle_s(job)
            if self._held(job):
                assert idle is None and self.leases.held(job) == sum(
                    job in js for js in self.open.values())
            else:
                assert idle == self.now - self.free_at.get(job, 100.0)

    def _held(self, job: str) -> bool:
        return any(job in jobs for jobs in self.open.values())


LeaseModel.TestCase.settings = settings(max_examples=size(50, 150), stateful_step_count=40,
                                        deadline=None)
test_leases_follow_the_model = LeaseModel.TestCase
