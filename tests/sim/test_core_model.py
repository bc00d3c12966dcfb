"""The durable core against a model: Hypothesis picks the steps, a power cut may come at any.

    rules      send 1..5 bundles · let segments finalize · a subscriber takes what is
               delivered and acks or nacks each · power cut (ModelFS.crash: from that
               instant no write reaches the disk; the directory a cut may leave, by a
               drawn Cut, becomes the next start's data) and restart
    model      what clients were told: the tags whose ACK left (the daemon's "acked"
               marks), the tags the subscriber acked
    invariants at every cut (tests/sim/crashstates.py's, on the cut's own image): every
               acked bundle held exactly once unless the subscriber acked it, none held
               twice, nothing acked durably pending again, no sequence or segment number
               reused, no loss reported; after the restart, every acked bundle not yet
               acked by the subscriber is delivered to it again.

A real daemon (in process, tests/sim/workload.py) on a ModelFS: WAL rotation and release,
finalize, ack.log, gc and recovery all run as in production. Sizes: 6 examples in the
default tier, 30 in the full tier, ``QUIVERD_MODEL_EXAMPLES`` for ``scripts/prove``.
Subscriber REJECT and retention are not rules yet (REJECT does not exist; retention
loses acked data by design and needs its own model).
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quiverd.kernel import fs
from tests.inprocess import InProcessDaemon
from tests.sim.crashstates import _Known, check_image, durable_acks
from tests.sim.modelfs import Cut, ModelFS
from tests.sim.workload import SETTINGS, Facts, add_subscriber, consume, produce, short_root
from tests.tiers import size

EXAMPLES = size(6, 30, "QUIVERD_MODEL_EXAMPLES")


class DurableCore(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.facts = Facts()
        self.next_tag = 0
        self.crashes = 0
        self.earlier = _Known()  # what clients were told by the daemons before this one
        self.previous_fs = fs.active()
        self.d: InProcessDaemon | None = None
        self.model: ModelFS | None = None
        self._start(short_root(), fresh=True)

    # ---- the daemon --------------------------------------------------------------
    def _start(self, root: Any, *, fresh: bool) -> None:
        self.d = InProcessDaemon(root, dict(SETTINGS))
        self.d.data_dir.mkdir(exist_ok=True)
        self.model = ModelFS(self.d.data_dir, record=True)
        fs.install(self.model)
        self.d.start()
        if fresh:
            add_subscriber(self.d)

    def _known(self) -> _Known:
        known = _Known(acked=set(self.earlier.acked), sub_acked=set(self.earlier.sub_acked),
                       segments=set(self.earlier.segments))
        assert self.model is not None
        for op in self.model.ops:
            if op[0] == "mark":
                known.note(op)
        return known

    # ---- rules -----------------------------------------------------------------
    @rule(n=st.integers(1, 5), rows=st.sampled_from((10, 300, 1500)))
    def send(self, n: int, rows: int) -> None:
        assert self.d is not None
        tags = list(range(self.next_tag, self.next_tag + n))
        self.next_tag += n
        produce(self.d, self.facts, tags, rows)

    @rule()
    def finalize(self) -> None:
        time.sleep(0.06)  # past segment.max_open_duration_ms

    @rule(ack_p=st.sampled_from((0.0, 0.5, 1.0)), seed=st.integers(0, 2**16))
    def deliver(self, ack_p: float, seed: int) -> None:
        assert self.d is not None and self.model is not None
        consume(self.d, self.model, self.facts, random.Random(seed), ack_p=ack_p, idle_s=0.1)

    @precondition(lambda self: self.crashes < 3)
    @rule(meta=st.floats(0, 1), data=st.sampled_from(("none", "all", "random")),
          seed=st.integers(0, 2**30))
    def power_cut(self, meta: float, data: str, seed: int) -> None:
        assert self.d is not None and self.model is not None
        self.crashes += 1
        state = self.model.crash()
        known = self.earlier = self._known()
        cut = Cut(round(meta * len(state.pending_meta)), data, seed)
        image = state.image(cut)
        self.d.stop()  # its disk is gone: it stops (fatally or not), leaving nothing open
        fs.install(self.previous_fs)  # recovery of the image below runs on the real disk
        root = short_root()
        durable = durable_acks(state.image(Cut(0, "none")), root / "acks")
        problems = check_image(image, durable, known, self.facts, root / "check")
        assert not problems, f"after a power cut ({cut}): {problems}"
        image.materialize(root / "data")
        self._start(root, fresh=False)
        # A restarted daemon must still deliver every acked bundle the subscriber has
        # not acked: drain it now and check.
        self._drain_and_check(known)

    def _drain_and_check(self, known: _Known) -> None:
        assert self.d is not None and self.model is not None
        drained = Facts(seq_of_tag=self.facts.seq_of_tag)
        time.sleep(0.06)
        consume(self.d, self.model, drained, random.Random(0), ack_p=0.0, idle_s=0.3)
        delivered = set(drained.tag_of_id.values())
        self.facts.tag_of_id.update(drained.tag_of_id)
        tag_of_seq = {seq: tag for tag, seq in self.facts.seq_of_tag.items()}
        missing = sorted(tag for seq in known.acked
                         if (tag := tag_of_seq.get(seq)) is not None
                         and tag not in known.sub_acked and tag not in delivered)
        assert not missing, f"acked bundles never delivered after the restart: {missing}"

    @invariant()
    def daemon_runs(self) -> None:
        assert self.d is not None and self.d.running, "the daemon stopped by itself"

    def teardown(self) -> None:
        try:
            if self.d is not None:
                self.d.end()
            if self.model is not None:
                problems = self.model.check_mirror(
                    ignore=("LOCK", "catalog.sqlite", "objects/", "lake/"))
                assert not problems, f"changes that bypassed the seam: {problems}"
        finally:
            fs.install(self.previous_fs)


DurableCore.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# Known, not mended: a daemon whose disk vanished (every call EIO) stops with one anyio
# MemoryObjectSendStream not closed (its __del__ warns); a subprocess's exit hides it.
# Filtered for this test only, so that the model's findings are not masked by it.
test_durable_core_model = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")(DurableCore.TestCase)
