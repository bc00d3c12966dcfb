"""The durable core against a model: Hypothesis picks the steps, a power cut may come at any.

    rules      send 1..5 bundles · let segments finalize · a subscriber takes what is
               delivered and acks, rejects or nacks each · power cut (ModelFS.crash: from that
               instant no write reaches the disk; the directory a cut may leave, by a
               drawn Cut, becomes the next start's data) and restart
    model      what clients were told: the tags whose ACK left (the daemon's "acked"
               marks), the tags the subscriber acked
    invariants at every cut and at the end (tests/sim/crashstates.py's, on the cut's own
               image; at the end a cut that keeps everything written): every
               acked bundle held exactly once unless the subscriber acked it, none held
               twice, nothing acked durably pending again, no sequence or segment number
               reused, no loss reported; after the restart, every acked bundle not yet
               acked by the subscriber is delivered to it again.

A real daemon (in process, tests/sim/workload.py) on a ModelFS: WAL rotation and release,
finalize, ack.log, gc and recovery all run as in production. Sizes: 6 examples in the
default tier, 30 in the full tier, ``QUIVERD_MODEL_EXAMPLES`` for ``scripts/prove``.

Retention, the same machine under a size cap or a maximum age (2 examples each in the
default tier, 10 in the full tier, ``QUIVERD_RETENTION_EXAMPLES``):

    drop_oldest  (cap 192 KiB) the oldest segments go once over the cap; max_age (1 s,
                 rule: let segments age) segments go once old. Either may delete what
                 the subscriber has not acked, but only once its ``dropped`` outcome is
                 durable in ack.log: an acked bundle missing after a cut must be
                 subscriber-acked or durably dropped; a dropped one never comes back
                 (pending again, or in the WAL); one the restarted daemon does not
                 deliver must have been dropped (its ack.log says).
    backpressure (cap 192 KiB, wal.at_capacity = "reject") nothing acked is ever dropped
                 (no bundle done that the subscriber did not ack); sends past the cap are
                 refused, and once the subscriber acks everything the gate reopens
                 (rule: ack all, then a send must be accepted).

The subscriber's answers include REJECT (final like an ack: the model counts it as the
subscriber being done with the bundle).
"""

from __future__ import annotations

import random
import time
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from quiverd.kernel import fs
from quiverd.net.admin import request
from tests.inprocess import InProcessDaemon
from tests.sim.crashstates import _done, _Known, acks_of, check_image, durable_acks
from tests.sim.modelfs import Cut, ModelFS
from tests.sim.workload import SETTINGS, Facts, add_subscriber, consume, produce, short_root
from tests.tiers import size

EXAMPLES = size(6, 30, "QUIVERD_MODEL_EXAMPLES")
RETENTION_EXAMPLES = size(2, 10, "QUIVERD_RETENTION_EXAMPLES")
CAP = 192 * 1024


class DurableCore(RuleBasedStateMachine):
    daemon_settings: dict[str, Any] = {}  # over workload.SETTINGS
    drops = False  # retention may delete what the subscriber has not acked
    refusable = False  # sends may be refused AT_CAPACITY

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
        self.d = InProcessDaemon(root, {**SETTINGS, **self.daemon_settings})
        self.d.data_dir.mkdir(exist_ok=True)
        self.model = ModelFS(self.d.data_dir, record=True)
        fs.install(self.model)
        self.d.start()
        if fresh:
            add_subscriber(self.d)

    def _known(self) -> _Known:
        known = _Known(acked=set(self.earlier.acked), sub_acked=set(self.earlier.sub_acked),
                       segments=set(self.earlier.segments),
                       id_of_seq=dict(self.earlier.id_of_seq))
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
        acked = produce(self.d, self.facts, tags, rows, refusable=self.refusable)
        if acked < n:
            event("a send was refused (at capacity)")

    @rule()
    def finalize(self) -> None:
        time.sleep(0.06)  # past segment.max_open_duration_ms

    @rule(ack_p=st.sampled_from((0.0, 0.5, 1.0)), reject_p=st.sampled_from((0.0, 0.3)),
          seed=st.integers(0, 2**16))
    def deliver(self, ack_p: float, reject_p: float, seed: int) -> None:
        assert self.d is not None and self.model is not None
        consume(self.d, self.model, self.facts, random.Random(seed), ack_p=ack_p,
                reject_p=reject_p, idle_s=0.1)

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
        problems = check_image(image, durable, known, self.facts, root / "check",
                               drops=self.drops)
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
        missing = sorted(seq for seq in known.acked
                         if (tag := tag_of_seq.get(seq)) is not None
                         and tag not in known.sub_acked and tag not in delivered)
        if missing and self.drops:  # retention may have dropped them since: ack.log says
            ids = self._known().id_of_seq
            live = acks_of((self.d.data_dir / "shard-0" / "ack.log").read_bytes(),
                           short_root())
            missing = [seq for seq in missing if seq not in ids or not _done(live, *ids[seq])]
        assert not missing, ("acked bundles never delivered after the restart: "
                             f"{[tag_of_seq[seq] for seq in missing]}")

    def _last_cut(self) -> None:
        """The invariants once more at the end, on a cut that keeps everything written
        (an example without a power cut is checked too)."""
        assert self.d is not None and self.model is not None
        state = self.model.crash()
        known = self._known()
        self.d.stop()
        fs.install(self.previous_fs)
        root = short_root()
        durable = durable_acks(state.image(Cut(0, "none")), root / "acks")
        image = state.image(Cut(len(state.pending_meta), "all"))
        problems = check_image(image, durable, known, self.facts, root / "check",
                               drops=self.drops)
        assert not problems, f"at the end (a cut keeping everything written): {problems}"

    def _count_drops(self) -> None:
        """Statistics (--hypothesis-show-statistics): did retention drop acked bundles?"""
        assert self.d is not None
        path = self.d.data_dir / "shard-0" / "ack.log"
        if not path.exists() or not self.d.running:
            return
        live = acks_of(path.read_bytes(), short_root())
        ids = self._known().id_of_seq
        tag_of_seq = {seq: tag for tag, seq in self.facts.seq_of_tag.items()}
        sub_acked = self._known().sub_acked
        dropped = sum(1 for seq, bid in ids.items() if _done(live, *bid)
                      and tag_of_seq.get(seq) not in sub_acked)
        event(f"bundles dropped by retention: {'none' if not dropped else '1+'}")

    @invariant()
    def daemon_runs(self) -> None:
        assert self.d is not None and self.d.running, "the daemon stopped by itself"

    def teardown(self) -> None:
        try:
            if self.d is not None:
                self._count_drops()
                if self.d.running:
                    self._last_cut()
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
test_durable_core_model = DurableCore.TestCase


class _Retained(DurableCore):
    @initialize(n=st.integers(10, 14))
    def fill(self, n: int) -> None:
        """Every example starts past its cap (n bundles of ~24 KiB: over 192 KiB, then
        finalized)."""
        self.send(n, 1500)
        self.finalize()


class DropOldest(_Retained):
    daemon_settings = {"retention.size_cap_bytes": CAP,
                       "retention.size_cap_policy": "drop_oldest"}
    drops = True


class MaxAge(_Retained):
    daemon_settings = {"retention.max_age_s": 1}
    drops = True

    @initialize()
    def aged(self) -> None:
        self.age()

    @precondition(lambda self: self.crashes < 3)
    @rule()
    def age(self) -> None:
        time.sleep(2.1)  # past max_age_s and a sweep (once a second)


class Backpressure(_Retained):
    daemon_settings = {"retention.size_cap_bytes": CAP, "wal.at_capacity": "reject"}
    refusable = True

    @rule()
    def ack_all_then_send(self) -> None:
        """Once the subscriber has acked everything, the gate must open again."""
        assert self.d is not None and self.model is not None
        deadline = time.monotonic() + 15
        while True:
            time.sleep(0.06)  # the open segment finalizes
            consume(self.d, self.model, self.facts, random.Random(0), ack_p=1.0, idle_s=0.2)
            tag = self.next_tag
            self.next_tag += 1
            if produce(self.d, self.facts, [tag], 10, refusable=True):
                return
            assert time.monotonic() < deadline, (
                "the gate stays closed after the subscriber acked everything: "
                f"{request(self.d.admin_socket, 'status')}")


for machine in (DropOldest, MaxAge, Backpressure):
    machine.TestCase.settings = settings(
        max_examples=RETENTION_EXAMPLES, stateful_step_count=8, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_retention_drop_oldest_model = DropOldest.TestCase
test_retention_max_age_model = MaxAge.TestCase
test_retention_backpressure_model = Backpressure.TestCase
