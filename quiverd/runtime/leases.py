"""Writer leases: which undecided jobs still have a live writer (SPEC §7).

    connection ─tagged BUNDLE / JOB end_partition / JOB keepalive─▶ hold(job, conn)
    connection closed (task done, killed, idle timeout) ──────────▶ release(conn)
    Staging._expire, every poll ─▶ idle_s(job): None while held, else seconds since
                                   its last holder left (or since it was first seen
                                   here, or since the daemon started)

A job is alive while any connection that carries one of its attempts is open. A Spark
task attempt keeps its connection open for its whole ``write()`` (sending a keepalive
while it waits for input, so the ingest idle timeout never closes it), so a live job,
however long, is never expired. When its last connection closes, the job gets
``staging.writer_timeout_s`` of grace: the driver's commit follows the last task within
milliseconds normally; a task retried or a stage resubmitted reconnects within that.
A daemon that restarts knows no connection: every job it recovers from its segments
starts its grace at the start, so a live writer reconnects (its task is retried) before
the job expires, and a dead one is decided ``writer_timeout_s`` later, not a day.

Several daemons share one catalog: the jobs held here are also written there
(``quiver_job_leases``, renewed every ``writer_timeout_s / 4``), and a job is expired
only when no daemon's lease of it is younger than ``writer_timeout_s``.

Bounded: one entry per job with staged bundles or a live holder here, one holder per
open connection (each bounded by ``ingest.max_connections``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Leases:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.holders: dict[str, set[int]] = {}  # job_id -> ids of connections holding it
        self.jobs_of: dict[int, set[str]] = {}  # connection id -> the jobs it holds
        self.free_since: dict[str, float] = {}  # job_id -> when its last holder left
        self.active_ns: dict[str, int] = {}  # job_id -> wall time of its last writer activity
        self.fresh: set[str] = set()  # held since the last catalog renewal: renew soon

    def hold(self, job_id: str, holder: int) -> None:
        """Connection ``holder`` carries (or is about to carry) an attempt of ``job_id``."""
        held = self.holders.setdefault(job_id, set())
        if not held:
            self.fresh.add(job_id)
        held.add(holder)
        self.jobs_of.setdefault(holder, set()).add(job_id)
        self.free_since.pop(job_id, None)
        self.active_ns[job_id] = time.time_ns()

    def touch(self, job_id: str) -> None:
        """A holder of ``job_id`` is active (a keepalive or a bundle)."""
        if job_id in self.holders:
            self.active_ns[job_id] = time.time_ns()

    def release(self, holder: int) -> list[str]:
        """Connection ``holder`` closed; returns the jobs it left without a holder."""
        freed = []
        now = self.clock()
        for job_id in self.jobs_of.pop(holder, ()):
            held = self.holders.get(job_id)
            if held is None:
                continue
            held.discard(holder)
            if not held:
                del self.holders[job_id]
                self.free_since[job_id] = now
                freed.append(job_id)
        return freed

    def seen(self, job_id: str) -> None:
        """Staged bundles of ``job_id`` are here: its grace runs from now unless held."""
        if job_id not in self.holders:
            self.free_since.setdefault(job_id, self.clock())

    def forget(self, job_id: str) -> None:
        """``job_id`` left this daemon (decided, or its segments are gone)."""
        if job_id not in self.holders:
            self.free_since.pop(job_id, None)
            self.active_ns.pop(job_id, None)
        self.fresh.discard(job_id)

    def held(self, job_id: str) -> int:
        return len(self.holders.get(job_id, ()))

    def idle_s(self, job_id: str) -> float | None:
        """None while a connection holds ``job_id``; else seconds since one last did (a job
        never held here counts from when it was first seen, at most since the start)."""
        if job_id in self.holders:
            return None
        since = self.free_since.get(job_id, self.started)
        return self.clock() - since

    def due(self, last_staged_ns: dict[str, int], *, now_ns: int, writer_timeout_s: int,
            ttl_s: int) -> dict[str, str]:
        """Of the undecided jobs given (job -> its newest staged bundle's time), those to
        expire now, with the reason: no holder for ``writer_timeout_s`` (unless another
        daemon's lease says otherwise: the caller asks the catalog), or nothing from
        the writer for ``ttl_s``."""
        due: dict[str, str] = {}
        for job_id, last_ns in last_staged_ns.items():
            active_ns = max(last_ns, self.active_ns.get(job_id, 0))
            idle_s = self.idle_s(job_id)
            if now_ns - active_ns > ttl_s * 10**9:
                due[job_id] = f"nothing came from its writer within staging.ttl_s={ttl_s} s"
            elif idle_s is not None and idle_s >= writer_timeout_s:
                due[job_id] = (f"no writer connection for staging.writer_timeout_s="
                               f"{writer_timeout_s} s and no commit (driver or tasks gone?)")
        return due

    def held_jobs(self) -> list[str]:
        return list(self.holders)

    def sweep(self, keep: Callable[[str], bool], older_than_s: float) -> None:
        """Drop grace entries of jobs ``keep`` rejects once older than ``older_than_s``
        (a keepalive for a job that never staged a bundle here)."""
        now = self.clock()
        for job_id, since in list(self.free_since.items()):
            if not keep(job_id) and now - since > older_than_s:
                del self.free_since[job_id]
                self.active_ns.pop(job_id, None)
