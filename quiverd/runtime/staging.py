"""Staging: transactional writes held until their job is decided (SPEC §7).

    producer ─BUNDLE(txn)──▶ WAL ─▶ segments          (durable, acked, staged)
    producer ─JOB end_partition─▶ marker bundle        (rows + checksum, durable)
    driver ──JOB commit/abort──▶ Staging.decide ──▶ catalog quiver_jobs (first writer wins)
    catalog ──NOTIFY / poll──▶ Staging.decisions ──(Changes)──▶ dispatcher[n]

The dispatcher asks ``verdict`` for every tagged bundle it would deliver: HOLD
while its job is undecided, PUBLISH for the winning attempt of its partition
(whose end marker this daemon holds with the commit's rows and checksum), DISCARD
for everything else (a ``dropped`` outcome per subscriber, so segments still go
away). End markers are never delivered.

A decision is recorded once in the catalog, so every daemon sharing it (several
hosts, one PostgreSQL) applies the same one; with the embedded catalog the same
protocol runs on one host. Nothing here is durable on its own: the staged bundles
are in segments (``SegmentInfo.staged``, rebuilt by recovery) and decisions are in
the catalog, looked up again after a restart. A job whose writer is gone is decided
``expired`` here (``runtime.leases``): no connection carrying one of its attempts has
been open, on any daemon sharing the catalog, for ``staging.writer_timeout_s`` (or
nothing came from its writer for ``staging.ttl_s``). An operator lists undecided jobs
and aborts one through the admin socket (``quiverd jobs list|abort``).

``visible`` (the JOB op of the same name) waits until a committed job's published
rows are in the catalog: ``runtime.visibility``, which the daemon hands in.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from quiverd.kernel import logs
from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.changes import Changes
from quiverd.kernel.config import Config
from quiverd.kernel.errors import AtCapacity, CatalogUnavailable, JobConflict, LakeError
from quiverd.kernel.jobs import JobDecision, Verdict, Winner, check_job_id, marker_problem
from quiverd.kernel.layout import DataDir
from quiverd.kernel.metrics import Metrics
from quiverd.runtime import jobs_view
from quiverd.runtime.leases import Leases
from quiverd.segments.table import SegmentInfo, SegmentView, StagedRef

if TYPE_CHECKING:
    from quiverd.runtime.visibility import Visibility

MARKER_WAIT_S = 30.0  # a winner's end marker may still be in the open segment
PRUNE_EVERY_S = 3600.0
STATUS_RETRY_HINT = "retry the status request in a moment; staged rows stay held meanwhile"
# A request that needs the catalog waits this long for it to connect (at start, or back
# from an outage) before it is answered CatalogUnavailable: a client asking right after
# the daemon started gets its answer, not a retry.
CATALOG_WAIT_S = 2.0


@dataclass
class _Job:
    """What this daemon's live segments hold of one job."""

    bundles: int = 0
    nbytes: float = 0.0
    last_ns: int = 0  # ingestion time of its newest staged bundle
    first_ns: int = 0  # of its oldest
    ends: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (p, a) -> end


class Staging:
    def __init__(self, cfg: Config, *, metrics: Metrics) -> None:
        self.cfg, self.scfg = cfg, cfg.staging
        self.m = metrics
        self.node_id = cfg.lake.node_id or socket.gethostname()
        self.db_path = DataDir(Path(cfg.data_dir)).catalog_db
        self.log = logs.get("staging")
        self.jobs: dict[str, _Job] = {}
        self.decisions: dict[str, JobDecision] = {}
        self.learned_at: dict[str, float] = {}  # job_id -> monotonic time its decision came
        self.wakers: list[Changes] = []  # every shard's: a decision re-runs the dispatchers
        self.catalog: Any = None  # quiverd.lake.catalog.Catalog once connected
        self.connected = Changes()  # notified when a catalog connects
        self.state = "starting"
        self._kick = anyio.Event()
        self._reported: set[tuple[str, int, int]] = set()
        self._last_prune = 0.0
        self.held_bytes = 0  # segment bytes of undecided jobs (pro rata)
        self.visibility: Visibility | None = None  # set by the daemon once its shards run
        self.leases = Leases()  # which jobs have a live writer (connections call hold/release)
        self.views: Callable[[], list[SegmentView]] = list  # the shards' segments, by index
        self._last_renew = 0.0

    # ---- the segment index (ack_logger / recovery call these on the event loop) ------
    def add_segment(self, info: SegmentInfo) -> None:
        if not info.staged:
            return
        share = info.size_bytes / max(info.bundle_count, 1)
        new = False
        for ref in info.staged.values():
            job = self.jobs.get(ref.job_id)
            if job is None:
                job = self.jobs[ref.job_id] = _Job()
                new = ref.job_id not in self.decisions
            job.bundles += 1
            job.nbytes += share
            job.last_ns = max(job.last_ns, info.max_ts_ns)
            job.first_ns = min(job.first_ns or info.min_ts_ns, info.min_ts_ns)
            self.leases.seen(ref.job_id)
            if ref.is_end:
                job.ends[(ref.partition, ref.attempt)] = (ref.end_rows, ref.end_checksum)
        if new:
            self._kick.set()  # look its decision up now: it may be a late straggler
        self._gauges()

    def remove_segment(self, info: SegmentInfo) -> None:
        if not info.staged:
            return
        share = info.size_bytes / max(info.bundle_count, 1)
        for ref in info.staged.values():
            job = self.jobs.get(ref.job_id)
            if job is None:
                continue
            job.bundles -= 1
            job.nbytes -= share
            if job.bundles <= 0:
                del self.jobs[ref.job_id]
                self.decisions.pop(ref.job_id, None)
                self.learned_at.pop(ref.job_id, None)
                self.leases.forget(ref.job_id)
        self._gauges()

    # ---- writer leases (the ingest connections call these on the event loop) -----------
    def hold(self, job_id: str, holder: int) -> None:
        """Connection ``holder`` carries an attempt of ``job_id``: it stays alive meanwhile."""
        self.leases.hold(job_id, holder)

    def release(self, holder: int) -> None:
        """Connection ``holder`` closed: its jobs left without a writer get their grace."""
        for job_id in self.leases.release(holder):
            if job_id in self.jobs and job_id not in self.decisions:
                self.log.info("job_writer_gone", job_id=job_id,
                              expires_in_s=self.scfg.writer_timeout_s,
                              hint="the job is expired unless a writer reconnects or the "
                              "driver commits it within staging.writer_timeout_s")

    def keepalive(self, job_id: str, holder: int) -> dict[str, Any]:
        """A writer waiting for input: hold ``job_id``; say how often to ask again."""
        self.leases.hold(job_id, holder)
        decision = self.decisions.get(job_id)
        state = decision.state if decision else ("staged" if job_id in self.jobs else "unknown")
        return {"job_id": job_id, "state": state, "keepalive_ms": self.keepalive_ms()}

    def keepalive_ms(self) -> int:
        """How often a writer waiting for input sends a keepalive: a quarter of the
        shorter of the idle timeout (which would close its connection) and the lease."""
        idle_ms = self.cfg.ingest.idle_timeout_ms or 10**12
        return max(10, min(idle_ms, self.scfg.writer_timeout_s * 1000) // 4)

    def fate(self, job_id: str) -> JobDecision | None:
        """What became of ``job_id`` here (the uploader's staged files ask): its decision,
        None while it is undecided, and an ``aborted`` stand-in once none of its bundles
        is left on this daemon (its decision is forgotten with them)."""
        decision = self.decisions.get(job_id)
        if decision is None and job_id not in self.jobs:
            return JobDecision(job_id=job_id, state="aborted",
                               reason="none of its bundles is left on this daemon")
        return decision

    # ---- the dispatcher's question ----------------------------------------------------
    def verdict(self, ref: StagedRef) -> Verdict:
        decision = self.decisions.get(ref.job_id)
        if decision is None:
            return Verdict.HOLD
        if ref.is_end:
            return Verdict.DISCARD
        winner = decision.winner(ref.partition)
        if winner is None or winner.attempt != ref.attempt:
            return Verdict.DISCARD
        job = self.jobs.get(ref.job_id)
        end = job.ends.get((ref.partition, ref.attempt)) if job else None
        if end is None:
            waited = time.monotonic() - self.learned_at.get(ref.job_id, 0.0)
            if waited < MARKER_WAIT_S:
                return Verdict.HOLD  # its marker is still in the open segment
            self._invalid(ref, "its end-of-partition marker is not here (the stream was cut "
                          "or its segment was quarantined)")
            return Verdict.DISCARD
        if end != (winner.rows, winner.checksum):
            self._invalid(ref, f"its end marker says rows={end[0]} checksum={end[1]}, the "
                          f"commit says rows={winner.rows} checksum={winner.checksum}")
            return Verdict.DISCARD
        return Verdict.PUBLISH

    async def _decided(self, job_id: str) -> bool:
        if job_id in self.decisions:
            return True
        catalog = await self._connected_catalog()
        if catalog is None:
            return False  # _decide says the catalog is unreachable
        return job_id in await catalog.job_decisions([job_id])

    async def _check_markers(self, job_id: str, winners: list[Winner]) -> None:
        """Refuse winners whose end marker this daemon does not hold (as it was sent),
        once every bundle of the job acked before now is finalized (its marker may be in
        an open segment: sealed now, at most MARKER_WAIT_S)."""
        if not winners:
            return
        if self.visibility is not None and not await self.visibility.sealed(job_id,
                                                                            MARKER_WAIT_S):
            raise AtCapacity(f"job {job_id!r}: its bundles were not sealed within "
                             f"{MARKER_WAIT_S:.0f} s, so its end markers cannot be checked",
                             hint="nothing was recorded; retry the commit")
        job = self.jobs.get(job_id)
        what = marker_problem(job.ends if job else {}, winners)
        if what:
            raise JobConflict(f"job {job_id!r} not committed: {what} (node {self.node_id})",
                              hint="commit only attempts whose end_partition was acked; an "
                              "attempt written through another daemon is named in the "
                              "commit's remote partitions")

    def _invalid(self, ref: StagedRef, why: str) -> None:
        key = (ref.job_id, ref.partition, ref.attempt)
        if key in self._reported:
            return
        self._reported.add(key)
        self.m.staged_invalid.labels().inc()
        self.log.error("staged_attempt_invalid", job_id=ref.job_id, partition=ref.partition,
                       attempt=ref.attempt, reason=why,
                       hint="its rows are discarded, never published; rerun the job")

    # ---- decisions ----------------------------------------------------------------------
    async def commit(self, job_id: str, winners: Iterable[Winner],
                     remote: Iterable[int] = ()) -> tuple[JobDecision, bool]:
        """Record a commit; returns (the standing decision, already). Idempotent.

        A new commit is refused (JobConflict, nothing recorded) when a winner's end
        marker is not on this daemon or says other rows or checksum, unless its
        partition is in ``remote`` (written through another daemon, which checks it)."""
        ws = tuple(sorted(winners, key=lambda w: w.partition))
        if len({w.partition for w in ws}) != len(ws):
            raise ValueError("a commit names each partition once")
        wanted = JobDecision(job_id=check_job_id(job_id), state="committed", winners=ws,
                             decided_at_ns=time.time_ns(), decided_by=self.node_id)
        if not await self._decided(job_id):  # a repeated commit is answered as it stands
            await self._check_markers(job_id, [w for w in ws if w.partition not in
                                               set(remote)])
        standing, recorded = await self._decide(wanted)
        if standing.state != "committed" or set(standing.winners) != set(ws):
            raise JobConflict(f"job {job_id!r} is already {standing.state} "
                              f"({_describe(standing)}); this commit changes nothing")
        return standing, not recorded

    async def abort(self, job_id: str, reason: str = "") -> tuple[JobDecision, bool]:
        wanted = JobDecision(job_id=check_job_id(job_id), state="aborted",
                             decided_at_ns=time.time_ns(), decided_by=self.node_id,
                             reason=reason[:1000])
        standing, recorded = await self._decide(wanted)
        if standing.state == "committed":
            raise JobConflict(f"job {job_id!r} is already committed "
                              f"({_describe(standing)}); the abort changes nothing")
        return standing, not recorded

    def job_status(self, job_id: str) -> dict[str, Any]:
        decision = self.decisions.get(job_id)
        job = self.jobs.get(job_id)
        out: dict[str, Any] = {"job_id": job_id, "node_id": self.node_id}
        if decision is not None:
            out.update(state=decision.state, winners=[_winner(w) for w in decision.winners],
                       decided_by=decision.decided_by, decided_at_ns=decision.decided_at_ns,
                       reason=decision.reason)
        else:
            out["state"] = "staged" if job is not None else "unknown"
        if job is not None:
            out.update(staged_bundles=job.bundles, ended_attempts=len(job.ends))
        return out

    async def refusal_for(self, job_id: str) -> str:
        """Why a new attempt of ``job_id`` is refused ("" = taken): its job is decided.

        A decided job's winners were complete before the decision, so anything that
        arrives later can only be a straggler or a replay, whose task attempt ids may
        repeat the winners' (Spark counts them from 0 in every application)."""
        decision = self.decisions.get(job_id)
        if decision is None and self.catalog is not None:
            try:
                decision = (await self.catalog.job_decisions([job_id])).get(job_id)
            except (CatalogUnavailable, LakeError, OSError):
                return ""  # staged, and decided later like any other
        if decision is None:
            return ""
        return (f"job {job_id!r} is already {decision.state} ({_describe(decision)}): "
                "rows sent for it now are never published")

    async def lookup(self, job_id: str) -> dict[str, Any]:
        """``job_status``, asking the catalog first when no decision is known here.

        A decision known here is final (the first one recorded stands), so it answers
        at once. Anything else only the catalog can tell: "staged" or "unknown" from
        local state alone may be wrong (another daemon may have decided the job), so
        with the catalog unreachable this raises the retryable CatalogUnavailable."""
        if job_id in self.decisions:
            return self.job_status(job_id)
        catalog = await self._connected_catalog()
        if catalog is None:
            raise CatalogUnavailable(f"job {job_id!r}: the catalog is unreachable "
                                     f"({self.state}), so its decision cannot be read",
                                     hint=STATUS_RETRY_HINT)
        try:
            found = await catalog.job_decisions([job_id])
        except (CatalogUnavailable, LakeError, OSError) as exc:
            raise CatalogUnavailable(f"job {job_id!r}: the catalog is unreachable ({exc}), "
                                     "so its decision cannot be read",
                                     hint=STATUS_RETRY_HINT) from exc
        if job_id not in found and self.visibility is not None:
            # Local state counts finalized segments only: seal the job's acked bundles
            # still in an open segment first (at most MARKER_WAIT_S), or a job whose end
            # markers were acked would read "unknown" until its segments finalize.
            await self.visibility.sealed(job_id, MARKER_WAIT_S)
        out = self.job_status(job_id)
        if job_id in found:
            d = found[job_id]
            out.update(state=d.state, winners=[_winner(w) for w in d.winners],
                       decided_by=d.decided_by, decided_at_ns=d.decided_at_ns,
                       reason=d.reason)
        return out

    async def visible(self, job_id: str, timeout_ms: int) -> dict[str, Any]:
        """Until the committed job's rows published here are in the catalog (at most
        ``timeout_ms``); the reply says whether they are (``runtime.visibility``)."""
        if self.visibility is None:
            raise CatalogUnavailable("quiverd is still starting: job visibility is not "
                                     "served yet", hint="retry in a moment")
        return await self.visibility.wait(check_job_id(job_id), timeout_ms)

    async def _connected_catalog(self) -> Any:
        """The catalog, waiting up to CATALOG_WAIT_S for it to connect; None if it did not."""
        with anyio.move_on_after(CATALOG_WAIT_S):
            while self.catalog is None:
                await self.connected.wait_beyond(self.connected.version)
        return self.catalog

    async def _decide(self, wanted: JobDecision) -> tuple[JobDecision, bool]:
        catalog = await self._connected_catalog()
        if catalog is None:
            raise CatalogUnavailable(f"the catalog is not connected ({self.state})",
                                     hint="the decision was not recorded; retry the commit "
                                     "or abort in a moment")
        standing, recorded = await catalog.decide_job(wanted)
        if recorded:
            self.log.info("job_decided", job_id=standing.job_id, state=standing.state,
                          partitions=len(standing.winners), reason=standing.reason or None)
        self._learn({standing.job_id: standing})
        return standing, recorded

    def _learn(self, found: dict[str, JobDecision]) -> None:
        changed = False
        for job_id, decision in found.items():
            if job_id in self.decisions:
                continue
            self.m.jobs_decided.labels(decision.state).inc()
            if job_id in self.jobs:  # only decisions that matter here are kept
                self.decisions[job_id] = decision
                self.learned_at[job_id] = time.monotonic()
                changed = True
        if changed:
            self._gauges()
            for w in self.wakers:
                w.notify()

    # ---- the background task --------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Connect to the catalog (retrying), then look up, expire and prune; until cancelled."""
        task_status.started()
        from quiverd.lake.catalog import open_catalog  # the lake's code: imported on use

        attempt = 0
        while True:
            try:
                async with open_catalog(self.cfg.catalog, self.db_path, log=self.log) as catalog:
                    self.catalog, self.state, attempt = catalog, "ready", 0
                    self.connected.notify()
                    try:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._listen, catalog)
                            await self._poll(catalog)
                    finally:
                        self.catalog = None
            except Exception as exc:  # noqa: BLE001 - staging must never stop ingest
                # CatalogUnavailable is the expected one; anything else (a driver error
                # the catalog did not translate) is logged with its type and retried too.
                attempt += 1
                delay = backoff_s(attempt)
                self.state = f"waiting for the catalog: {exc}"
                self.log.error("staging_catalog_unavailable", error=str(exc),
                               error_type=type(exc).__name__,
                               retry_in_s=round(delay, 1), undecided_jobs=self._undecided(),
                               hint="staged rows stay held (durable) until decisions can be "
                               "read; commits and aborts fail meanwhile")
                await anyio.sleep(delay)

    async def _listen(self, catalog: Any) -> None:
        """Decisions made anywhere wake the poll at once (PG NOTIFY); polling covers gaps."""
        try:
            async with catalog.job_notifications() as feed:
                async for _job_id in feed:
                    self._kick.set()
        except Exception as exc:  # noqa: BLE001 - polling goes on without the feed
            self.log.warning("staging_notifications_lost", error=str(exc),
                             error_type=type(exc).__name__,
                             hint="decisions are still found by polling")

    async def _poll(self, catalog: Any) -> None:
        interval = self.scfg.poll_interval_ms / 1000
        while True:
            with anyio.move_on_after(interval):
                await self._kick.wait()
            self._kick = anyio.Event()
            undecided = [j for j in self.jobs if j not in self.decisions]
            if undecided:
                self._learn(await catalog.job_decisions(undecided))
            await self._renew(catalog)
            await self._expire(catalog)
            if time.monotonic() - self._last_prune > PRUNE_EVERY_S:
                self._last_prune = time.monotonic()
                cutoff = time.time_ns() - self.scfg.decision_retention_s * 10**9
                pruned = await catalog.prune_job_decisions(cutoff)
                if pruned:
                    self.log.info("job_decisions_pruned", decisions=pruned)

    async def _renew(self, catalog: Any) -> None:
        """Write this daemon's live writers' jobs to the catalog, so that another daemon
        holding staged rows of them does not expire them (``runtime.leases``)."""
        every_s = self.scfg.writer_timeout_s / 4
        if not self.leases.fresh and time.monotonic() - self._last_renew < every_s:
            return
        self._last_renew = time.monotonic()
        self.leases.fresh.clear()
        self.leases.sweep(lambda j: j in self.jobs, self.scfg.writer_timeout_s)
        await catalog.renew_job_leases(self.node_id, self.leases.held_jobs(), time.time_ns())

    async def _expire(self, catalog: Any) -> None:
        """Decide ``expired`` every undecided job whose writer is gone (module doc)."""
        now_ns, timeout_s = time.time_ns(), self.scfg.writer_timeout_s
        due = self.leases.due(
            {j: job.last_ns for j, job in self.jobs.items() if j not in self.decisions},
            now_ns=now_ns, writer_timeout_s=timeout_s, ttl_s=self.scfg.ttl_s)
        if not due:
            return
        # A live writer on another daemon sharing the catalog keeps the job.
        leased = await catalog.job_leases(list(due), exclude_node=self.node_id)
        for job_id, reason in due.items():
            renewed_ns = leased.get(job_id, 0)
            if "writer_timeout_s" in reason and now_ns - renewed_ns < timeout_s * 10**9:
                continue
            standing, recorded = await self._decide(JobDecision(
                job_id=job_id, state="expired", decided_at_ns=time.time_ns(),
                decided_by=self.node_id, reason=reason))
            if recorded:
                job = self.jobs.get(job_id) or _Job()
                self.log.warning("staged_job_expired", job_id=job_id, bundles=job.bundles,
                                 bytes=int(job.nbytes), reason=reason)

    # ---- reporting -----------------------------------------------------------------------
    def _undecided(self) -> int:
        return sum(1 for j in self.jobs if j not in self.decisions)

    def _gauges(self) -> None:
        counts: dict[str, int] = {"staged": 0, "committed": 0, "aborted": 0, "expired": 0}
        held = 0.0
        for job_id, job in self.jobs.items():
            d = self.decisions.get(job_id)
            counts[d.state if d else "staged"] += 1
            if d is None:
                held += job.nbytes
        for state, n in counts.items():
            self.m.staged_jobs.labels(state).set(n)
        self.m.staged_bytes.labels().set(int(held))
        self.held_bytes = int(held)

    def refusal(self) -> str:
        """Why a new staged bundle is refused now ("" = taken): undecided jobs hold over
        half the size cap, so the job could never finish under backpressure (its driver
        commits only after every task wrote) and would hang until the TTL."""
        cap = self.cfg.retention.size_cap_bytes
        # One client's bundles all go to one shard, whose share of the cap is what fills.
        share = cap // self.cfg.shard_count
        if cap and self.held_bytes > share // 2:
            return (f"undecided jobs' staged rows take {self.held_bytes} bytes, over half of "
                    f"a shard's share ({share}) of retention.size_cap_bytes={cap}; commit or "
                    "abort them, or raise the cap above 2 x shards x the largest job")
        return ""

    def status(self) -> dict[str, Any]:
        """``quiverd status``: ``holding`` names, per shard, the undecided job its
        deliveries wait at (``runtime.jobs_view``)."""
        return {"state": self.state, "node_id": self.node_id, "jobs": len(self.jobs),
                "undecided_jobs": self._undecided(),
                "staged_bytes": self.held_bytes,
                "writer_timeout_s": self.scfg.writer_timeout_s,
                "holding": {str(k): v for k, v in jobs_view.holding(self).items()}}

    def undecided(self) -> list[dict[str, Any]]:
        """``quiverd jobs list``: every undecided job staged here (``runtime.jobs_view``)."""
        return jobs_view.undecided(self)


def _winner(w: Winner) -> dict[str, int]:
    return {"partition": w.partition, "attempt": w.attempt, "rows": w.rows,
            "checksum": w.checksum}


def _describe(d: JobDecision) -> str:
    by = f"by {d.decided_by}" if d.decided_by else ""
    return f"{by}, {len(d.winners)} partitions" if d.state == "committed" else (
        f"{by}: {d.reason}" if d.reason else by)


__all__ = ["Staging", "Verdict"]
