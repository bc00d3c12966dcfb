"""Deterministic simulation of the durable core (issue 28, item 4): one daemon's real
shard (``quiverd.runtime.shard.Shard``: wal_writer with its two threads, segment_builder,
finalizer, dispatcher, ack_logger, gc_sweeper; the scrubber idle) on a ModelFS, under a
seeded SimLoop, with power cuts at seeded steps.

    run_core(seed) ─▶ SimLoop ─ life 0: Shard.recover, run; subscriber "s" added;
                              │   producer ──AppendRequests──▶ shard.inbox ─▶ … ─▶ Ack
                              │   subscriber ◀─LocalDelivery─ dispatcher ─▶ ack / nack
                              │   power cut at a seeded step: ModelFS.crash(), the shard's
                              │   task group cancelled; a drawn Cut of the state checked
                              │   (crashstates.check_image) and materialized as ...
                              ├─ life 1..k (k = 1..3 cuts): a new ModelFS, a new Shard
                              │   recovers it and runs on, the producer goes on
                              └─ last life: production ends, the subscriber acks every
                                 acked bundle (liveness), then a last cut, checked

The WAL's writer and syncer run the product's code in lock-step threads
(``stepthreads``): their steps are ordered by the seed like every other callback, and an
fdatasync takes virtual time (ModelFS's latency), so an ack can be seen to leave before it.

Checked as they happen (``CoreFS``): an "acked" mark (the WAL writer's commit, just
before its Acks leave) only for sequences whose WAL write is durable; a segment file
unlinked only once the durable ack.log says subscriber "s" acked each of its bundles;
a delivery never of a bundle the durable ack.log says is acked. At each cut, the full
crash-state check. The same seed gives the same trace (``CoreResult.digest``).

    PYTHONHASHSEED=0 .venv/bin/python -m tests.sim.detsim.core SEED [SEED ...] [--json]
        [--bundles N] [--smoke] [--trace N] [--cuts-only]

``--cuts-only`` counts the step checks' findings instead of failing on them: what the
cuts' crash-state checks and the last life's liveness check catch on their own. Planted
bugs (tests/sim/mutations.py): ``ack_before_fdatasync`` fails C1 at the first ack of
every seed (the cuts alone rarely land in the one-step window); ``acklog_append_not_synced``
fails C2 at the first segment deleted (cuts only: a loss reported at recovery, or acked
bundles never delivered again: NotSettled).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from quiverd.acks import format as ackfmt
from quiverd.acks.state import AckState
from quiverd.kernel import fs
from quiverd.kernel.bundle import Bundle, make_slot
from quiverd.kernel.errors import CorruptRecord
from quiverd.kernel.faults import Hooks
from quiverd.kernel.layout import segment_seq_of
from quiverd.kernel.metrics import Metrics
from quiverd.kernel.reply import Reply
from quiverd.protocol.frames import Ack
from quiverd.runtime.shard import Shard
from quiverd.segments.reader import SegmentReader
from quiverd.wal import format as walformat
from quiverd_actors.inbox import Batches
from quiverd_actors.messages import AppendRequest, ChangeSubscriber, LocalDelivery, ProducerReply
from quiverd_actors.sessions import Session
from tests.sim.crashstates import _config, _done, _Known, acks_of, check_image, durable_acks
from tests.sim.detsim import stepthreads
from tests.sim.detsim.checks import InvariantViolated
from tests.sim.detsim.loop import SimLoop, Traced, close_loop, simulated
from tests.sim.modelfs import Cut, Image, ModelFS, Op, State
from tests.sim.workload import SUBSCRIBER, Facts, tagged

ACK_LOG = "shard-0/ack.log"
WAL_PREFIX = "shard-0/wal/quiver.wal"
PRODUCER_WINDOW = 16  # requests in flight (a connection's window)
SUBSCRIBER_WINDOW = 16
SYNC_LATENCY_S = 0.002  # virtual: how long an fdatasync is in flight


@dataclass(frozen=True)
class CoreSize:
    bundles: int = 48  # produced in all, across lives
    max_cuts: int = 3  # 1..max_cuts power cuts per seed
    span_s: float = 2.0  # virtual seconds over which the producer sends them
    steps_per_bundle: int = 60  # about what one bundle costs (a cut's range, below)
    settle_s: float = 600.0  # the last life: every acked bundle subscriber-acked by then
    ack_p: float = 0.7  # the subscriber acks (else nacks) a delivery
    max_steps: int = 400_000  # a run past this is stuck (a livelock): it fails


SMOKE = CoreSize(bundles=24)


class NotSettled(InvariantViolated):
    """The last life did not get every acked bundle acked by the subscriber."""


@dataclass
class CoreResult(Traced):
    seed: int
    steps: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0
    power_cuts: int = 0  # mid-run cuts, each followed by a restart (and one at the end)
    cuts: list[str] = field(default_factory=list)  # each image checked: "prefix/pending data"
    sent: int = 0
    acked: int = 0  # producer ACKs received
    deliveries: int = 0
    sub_acks: int = 0
    checks: dict[str, int] = field(default_factory=dict)
    trace: list[tuple[float, str]] = field(default_factory=list)
    error: str = ""

    def counts(self) -> dict[str, Any]:
        return {"seed": self.seed, "ok": not self.error, "error": self.error,
                "steps": self.steps, "virtual_s": self.virtual_s, "wall_s": self.wall_s,
                "power_cuts": self.power_cuts, "cuts": self.cuts, "sent": self.sent,
                "acked": self.acked,
                "deliveries": self.deliveries, "sub_acks": self.sub_acks,
                "checks": self.checks, "digest": self.digest()}


class CoreSimFailed(AssertionError):
    def __init__(self, result: CoreResult) -> None:
        self.result = result
        super().__init__(f"seed {result.seed}: {result.error}\nreplay: PYTHONHASHSEED=0 "
                         f".venv/bin/python -m tests.sim.detsim.core {result.seed}\n"
                         f"last steps:\n{result.tail()}")


class CoreLoop(SimLoop):
    """A SimLoop on which anyio's cancel delivery does not stop the clock: it retries in
    a callback of its own on every iteration while a cancelled task is still shielded
    (one waiting for a WAL thread to end); when nothing else is ready, virtual time goes
    on to the next timer, as it would while a real loop spins (else a thread's sleep
    under a cancelled scope never ends)."""

    def _run_once(self) -> None:
        sched: list[Any] = self._scheduled  # type: ignore[attr-defined]
        ready: Any = self._ready  # type: ignore[attr-defined]
        if ready and sched and all(_is_retry(h) for h in ready):
            live = [h for h in sched if not h._cancelled and h._when != float("inf")]
            if live:
                self.vtime = max(self.vtime, min(h._when for h in live))
        super()._run_once()


def _is_retry(handle: Any) -> bool:
    return getattr(getattr(handle, "_callback", None), "__name__", "") == \
        "_deliver_cancellation"


class CoreFS(ModelFS):
    """A ModelFS that checks, as they happen, the durability an ack or a delete relies on
    (violations are collected; the run fails after the step)."""

    def __init__(self, root: Path, checks: Checks) -> None:
        super().__init__(root, record=True, sync_latency_s=SYNC_LATENCY_S)
        self.checks = checks
        self.written: dict[int, tuple[int, Op]] = {}  # WAL sequence -> (inode, its write)
        self._acks_raw: bytes | None = None
        self._acks: AckState | None = None

    def _do(self, op: Op) -> None:
        super()._do(op)
        if op[0] == "w" and not self.dead:
            rel = next((r for r, i in self.state.names.items() if i == op[1]), "")
            if rel.startswith(WAL_PREFIX):
                self._note_entries(op)

    def _note_entries(self, op: Op) -> None:
        data: bytes = op[3]
        pos = walformat.HEADER_LEN if data.startswith(walformat.MAGIC) else 0
        while pos < len(data):
            try:
                e = walformat.decode_entry(data, pos, max_entry_bytes=1 << 30)
            except CorruptRecord:
                return  # not an entry boundary (a header rewrite, a sidecar): nothing acked
            if e.entry_type == walformat.ENTRY_RECORD_BUNDLE and e.crc_ok:
                self.written[e.sequence] = (op[1], op)
            pos += e.total_len

    def mark(self, event: str, **facts: Any) -> None:
        if event == "acked" and not self.dead:
            self._check_acked([b.sequence for _, b, _ in facts["written"]])
        super().mark(event, **facts)

    def _check_acked(self, sequences: list[int]) -> None:
        """C1: an ACK leaves only for entries whose WAL write an fdatasync covered."""
        self.checks.count("C1 ack after fdatasync")
        durable_inodes = set(self.state.durable_names.values())
        for seq in sequences:
            where = self.written.get(seq)
            if where is None:
                self.checks.fail(f"C1: sequence {seq} acked, its WAL write never seen")
                continue
            ino, op = where
            inode = self.state.inodes[ino]
            if any(p is op for p in inode.pending) or ino not in durable_inodes:
                self.checks.fail(f"C1: sequence {seq} acked before the fdatasync covering "
                                 "its WAL write (or its WAL file's name) returned")

    def unlink(self, path: Any, *, missing_ok: bool = False) -> None:
        rel = self._rel(path)
        seg = segment_seq_of(os.path.basename(rel)) if rel and not self.dead else None
        if seg is not None and os.path.exists(path):
            self._check_deletable(path, seg)
        super().unlink(path, missing_ok=missing_ok)

    def _check_deletable(self, path: Any, seg: int) -> None:
        """C2: a segment is deleted only once the durable ack.log has "s" ack all of it
        (no retention here: nothing is dropped)."""
        self.checks.count("C2 delete after durable acks")
        with SegmentReader.open(path) as reader:
            indexes = [b.index for b in reader.bundles()]
        acks = self.durable_acks()
        undone = [i for i in indexes if not _done(acks, seg, i)]
        if undone:
            self.checks.fail(f"C2: segment {seg} deleted while the durable ack.log lacks "
                             f"the subscriber's acks of bundles {undone}")

    def durable_acks(self) -> AckState | None:
        """What ack.log holds durably now (what Cut(0, "none") would keep of it)."""
        ino = self.state.durable_names.get(ACK_LOG)
        if ino is None:
            return None
        raw = self.state.inodes[ino].synced
        if raw is not self._acks_raw:
            self._acks_raw = raw
            self._acks = acks_of(raw, self.checks.scratch / "acks")
        return self._acks


class Checks:
    """Counts of what was checked, and what broke. ``strict=False`` (``--cuts-only``)
    only counts the step checks' findings: what the crash-state checks at the cuts
    catch on their own."""

    def __init__(self, scratch: Path, *, strict: bool = True) -> None:
        self.scratch, self.strict = scratch, strict
        self.counts: dict[str, int] = {}
        self.violations: list[str] = []

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def fail(self, problem: str) -> None:
        if self.strict:
            self.violations.append(problem)
        else:
            self.count("step check findings ignored (--cuts-only)")


def run_core(seed: int, *, size: CoreSize = CoreSize(), keep_trace: bool = True,
             step_checks: bool = True) -> CoreResult:
    """One simulated run; raises CoreSimFailed (seed, error, the trace's tail) when an
    invariant breaks or the run crashes, else returns what it did."""
    result = CoreResult(seed=seed)
    root = Path(tempfile.mkdtemp(prefix=f"coresim-{seed}-", dir="/tmp"))
    loop = CoreLoop(random.Random(f"schedule-{seed}"))
    sim = _Sim(seed, size, loop, root, result)
    sim.checks.strict = step_checks

    def note(what: str) -> None:
        if keep_trace:
            result.trace.append((loop.vtime, "! " + what))

    def on_step(label: str) -> None:
        if keep_trace:
            result.trace.append((loop.vtime, label))
        sim.after_step()

    sim.note = note
    loop.on_step = on_step
    started = time.perf_counter()
    previous = fs.active()
    try:
        with simulated(seed, loop), stepthreads.patched(note):
            try:
                loop.run_until_complete(sim.main())
            except Exception as exc:  # noqa: BLE001 - any crash of the run is a finding too
                result.error = _describe(exc)
            finally:
                close_loop(loop)
    finally:
        fs.install(previous)
        shutil.rmtree(root, ignore_errors=True)
    result.wall_s = round(time.perf_counter() - started, 2)
    result.steps, result.virtual_s = loop.steps, round(loop.vtime, 3)
    result.checks = dict(sorted(sim.checks.counts.items()))
    if result.error:
        raise CoreSimFailed(result)
    return result


class _Sim:
    def __init__(self, seed: int, size: CoreSize, loop: SimLoop, root: Path,
                 result: CoreResult) -> None:
        self.seed, self.size, self.loop, self.root, self.result = seed, size, loop, root, result
        self.rng = random.Random(f"core-{seed}")
        self.checks = Checks(root / "scratch")
        self.facts = Facts()
        self.earlier = _Known()  # what clients were told in earlier lives
        self.real_fs = fs.active()
        self.note: Any = lambda _what: None
        self.model: CoreFS | None = None
        self.scope: anyio.CancelScope | None = None
        self.cut_at: int | None = None
        self.crashed: State | None = None
        self.outstanding: dict[int, int] = {}  # request id -> tag, this life
        self.room = anyio.Event()

    # ---- after every step --------------------------------------------------------
    def after_step(self) -> None:
        if self.loop.steps > self.size.max_steps:
            raise RuntimeError(f"more than {self.size.max_steps} steps: a livelock?")
        stuck = [t.stuck for t in stepthreads.SimPipeline.threads if t.stuck]
        if stuck:
            raise RuntimeError(f"harness: {stuck[0]}")
        if self.checks.violations:
            raise InvariantViolated("; ".join(self.checks.violations))
        if self.cut_at is not None and self.loop.steps >= self.cut_at and self.crashed is None:
            self.power_cut()

    def power_cut(self) -> None:
        assert self.model is not None and self.scope is not None
        self.note(f"power cut at step {self.loop.steps}")
        self.crashed = self.model.crash()
        self.scope.cancel()

    # ---- lives ---------------------------------------------------------------------
    async def main(self) -> None:
        data = self.root / "life0"
        data.mkdir()
        cuts = self.rng.randint(1, self.size.max_cuts)
        for life in range(cuts + 1):
            image = await self.life(data, life, last=life == cuts, cuts_left=cuts - life)
            if life == cuts:
                return
            data = self.root / f"life{life + 1}"
            image.materialize(data)

    async def life(self, data: Path, life: int, *, last: bool, cuts_left: int) -> Image:
        self.model = model = CoreFS(data, self.checks)
        fs.install(model)
        self.crashed, self.cut_at = None, None
        shard = self.shard = Shard(0, _config(data), shard_count=1, faults=Hooks(),
                                   metrics=Metrics())
        self.note(f"life {life} starts")
        try:
            await shard.recover()
            assert shard.recovered is not None
            wal = shard.recovered.wal  # its locks are shared with the lock-step threads
            wal._lock, wal._mutex = stepthreads.SimLock(), stepthreads.SimLock()  # type: ignore[assignment]
            async with anyio.create_task_group() as tg:
                self.scope = tg.cancel_scope
                await tg.start(shard.run)
                if life == 0:
                    await _add_subscriber(shard)
                tg.start_soon(self.produce, shard)
                tg.start_soon(self.subscribe, shard, model)
                if last:
                    await self.settle()
                    self.power_cut()
                else:
                    # Spread the cuts over what is left to send: on average this life
                    # sees 1/(cuts_left + 1) of it (and a cut may come before any).
                    left = max(4, self.size.bundles - self.result.sent)
                    steps = 2 * self.size.steps_per_bundle * left // (cuts_left + 1)
                    self.cut_at = self.loop.steps + self.rng.randint(20, max(40, steps))
                    await anyio.sleep_forever()
        except Exception as exc:  # noqa: BLE001 - a dying shard fails in many ways
            if self.crashed is None:
                raise
            self.note(f"shard ended by the cut: {type(exc).__name__}")
        finally:
            self.scope = None
            # A shard cut down never reaches its own close of these (known: a dying
            # daemon leaves one open; its __del__ would warn).
            shard.ack_tx.close()
            shard._ack_rx.close()
            fs.install(self.real_fs)  # recovery of the crash images runs on the real disk
        assert self.crashed is not None
        return self.check_cut(self.crashed, model, last=last)

    def check_cut(self, state: State, model: CoreFS, *, last: bool) -> Image:
        known = self.earlier = self.known(model)
        n = len(state.pending_meta)
        durable = durable_acks(state.image(Cut(0, "none")), self.checks.scratch / "durable")
        if last:  # at the end: everything written kept, and nothing pending kept
            cuts = [Cut(n, "all"), Cut(0, "none")]
        else:
            self.result.power_cuts += 1
            cuts = [Cut(self.rng.randint(0, n), self.rng.choice(("none", "all", "random")),
                        self.rng.randrange(1 << 30))]
        for cut in cuts:
            self.result.cuts.append(f"{cut.meta_prefix}/{n} {cut.data}")
            image = state.image(cut)
            problems = check_image(image, durable, known, self.facts,
                                   self.checks.scratch / "check")
            self.checks.count("crash images checked")
            if problems:
                raise InvariantViolated(f"after the power cut ({cut}): {problems}")
        return image

    def known(self, model: CoreFS) -> _Known:
        e = self.earlier
        known = _Known(acked=set(e.acked), sub_acked=set(e.sub_acked),
                       segments=set(e.segments), id_of_seq=dict(e.id_of_seq))
        for op in model.ops:
            if op[0] == "mark":
                known.note(op)
        return known

    async def settle(self) -> None:
        """Wait until every bundle is sent and answered and the subscriber has acked
        every one whose ACK left (in this life or an earlier one)."""
        deadline = self.loop.vtime + self.size.settle_s
        while True:
            known = self.known(self.model) if self.model else self.earlier
            tags = {t for t, s in self.facts.seq_of_tag.items() if s in known.acked}
            waiting = sorted(tags - known.sub_acked)
            if self.result.sent >= self.size.bundles and not self.outstanding and not waiting:
                return
            if self.loop.vtime > deadline:
                raise NotSettled(f"{self.size.settle_s:.0f} s into the last life: acked "
                                 f"bundles never acked by the subscriber: tags {waiting[:20]}"
                                 f" ({len(waiting)}); unanswered sends {len(self.outstanding)}")
            await anyio.sleep(1.0)

    # ---- producer ------------------------------------------------------------------
    async def produce(self, shard: Shard) -> None:
        """Send tagged bundles as a connection does (AppendRequests into the shard's
        inbox, answers on a reply sink); note each ACK's sequence."""
        replies: Batches[ProducerReply] = Batches()
        self.outstanding = {}
        rate = self.size.bundles / self.size.span_s
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.answers, replies)
            while self.result.sent < self.size.bundles:
                await anyio.sleep(self.rng.expovariate(rate))
                while len(self.outstanding) >= PRODUCER_WINDOW:
                    self.room = anyio.Event()
                    await self.room.wait()
                n = min(self.rng.randint(1, 3), self.size.bundles - self.result.sent)
                reqs = []
                for _ in range(n):
                    tag = self.result.sent
                    self.result.sent += 1
                    rows = self.rng.choice((10, 200, 1500))
                    self.outstanding[tag] = tag
                    reqs.append(AppendRequest(request_id=tag, reply=replies, bundle=Bundle(
                        client="p", slots=(make_slot(0, tagged(tag, rows)),))))
                await shard.inbox.put(reqs)
            while self.outstanding:
                self.room = anyio.Event()
                await self.room.wait()
            tg.cancel_scope.cancel()

    async def answers(self, replies: Batches[ProducerReply]) -> None:
        while (batch := await replies.take()) is not None:
            for reply in batch:
                tag = self.outstanding.pop(reply.request_id)
                if isinstance(reply, Ack):
                    self.facts.seq_of_tag[tag] = reply.sequence
                    self.result.acked += 1
                else:
                    self.note(f"send of tag {tag} refused: {reply.code}")
            self.room.set()

    # ---- subscriber ----------------------------------------------------------------
    async def subscribe(self, shard: Shard, model: CoreFS) -> None:
        """Subscriber "s" as an in-process session: ack or nack each delivery by seed,
        its sub_ack mark before the ack."""
        d = shard.dispatcher
        assert d is not None
        tx, rx = anyio.create_memory_object_stream[LocalDelivery](SUBSCRIBER_WINDOW)
        session = Session(name=SUBSCRIBER, window=SUBSCRIBER_WINDOW, deliveries=tx,
                          local=True)
        d.attach(session)
        try:
            async with rx:
                async for b in rx:
                    self.delivered(b, model)
                    key = (b.segment_seq, b.bundle_index)
                    tag = int(b.tables[0].column("tag")[0].as_py())
                    if tag in self.facts.seq_of_tag:
                        self.facts.tag_of_id[key] = tag
                    if self.rng.random() < 0.3:
                        await anyio.sleep(self.rng.uniform(0, 0.05))
                    if self.rng.random() < self.size.ack_p:
                        model.mark("sub_ack", id=key, tag=tag)
                        self.result.sub_acks += 1
                        outcome = ackfmt.ACK
                    else:
                        outcome = ackfmt.NACK
                    await d.feedback(session, *key, outcome)
        finally:
            d.detach(session)
            tx.close()

    def delivered(self, b: LocalDelivery, model: CoreFS) -> None:
        """C3: nothing the durable ack.log says the subscriber acked is delivered."""
        self.result.deliveries += 1
        self.checks.count("C3 delivery not durably acked")
        if _done(model.durable_acks(), b.segment_seq, b.bundle_index):
            self.checks.fail(f"C3: bundle {(b.segment_seq, b.bundle_index)} delivered, "
                             "though the durable ack.log says the subscriber acked it")


def _describe(exc: BaseException) -> str:
    """The leaves of an exception group, each as ``Type: message``."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


async def _add_subscriber(shard: Shard) -> None:
    """What ``subscribers.add`` does for one shard."""
    reply: Reply[None] = Reply()
    await shard.ack_tx.send(ChangeSubscriber(op="add", name=SUBSCRIBER, start="earliest",
                                             reply=reply))
    await reply.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.detsim.core")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--bundles", type=int, default=CoreSize().bundles)
    parser.add_argument("--smoke", action="store_true", help="the test's smaller size")
    parser.add_argument("--trace", type=int, default=0, help="print the last N steps")
    parser.add_argument("--json", action="store_true", help="one line of counts per seed")
    parser.add_argument("--cuts-only", action="store_true",
                        help="step checks count their findings only: the cuts' checks alone")
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("note: PYTHONHASHSEED is not 0: the trace may differ from the test's run",
              file=sys.stderr)
    from quiverd.kernel import logs

    logs.configure(level="error")
    base = SMOKE if args.smoke else CoreSize()
    size = CoreSize(**{**base.__dict__, "bundles": args.bundles}) \
        if args.bundles != CoreSize().bundles else base
    failed = 0
    for seed in args.seeds:
        try:
            result = run_core(seed, size=size, step_checks=not args.cuts_only)
        except CoreSimFailed as exc:
            failed += 1
            result = exc.result
            if not args.json:
                print(exc)
        line = result.counts()
        if args.json:
            line["tail"] = result.tail() if result.error else ""
            print(json.dumps(line), flush=True)
        else:
            print(line)
            if args.trace:
                print(result.tail(args.trace))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
