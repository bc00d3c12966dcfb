"""What an operator sees of undecided jobs (``quiverd jobs list``, ``quiverd status``).

    undecided(staging)  every undecided job staged here, oldest first: its bundles,
                        age, live writer connections, how long it has had none and
                        when it expires, the shards whose delivery it holds
    (the job a STREAM ``latest`` range stops at, its reply's ``waiting``, is
    ``quiverd.net.jobs.held_at``: the net layer answers STREAM)
    holding(staging)    per shard, the undecided job whose first staged bundle is the
                        first one held: every subscriber and stream of that shard
                        waits there until the job is decided

Read-only, on the event loop, from staging's index and the shards' segment views (no
I/O): the cost is one pass over the segments that hold staged bundles.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from quiverd.kernel.jobs import Verdict

if TYPE_CHECKING:
    from quiverd.runtime.staging import Staging


def holding(staging: Staging) -> dict[int, dict[str, Any]]:
    """shard -> {"job_id", "position": [segment_seq, bundle_index], "age_s"} of the first
    bundle of that shard held for an undecided job (shards holding none are absent)."""
    out: dict[int, dict[str, Any]] = {}
    now_ns = time.time_ns()
    for shard, view in enumerate(staging.views()):
        for info in view:  # oldest first
            held = next((idx for idx in sorted(info.staged)
                         if staging.verdict(info.staged[idx]) is Verdict.HOLD), None)
            if held is not None:
                job_id = info.staged[held].job_id
                job = staging.jobs.get(job_id)
                first_ns = job.first_ns if job else info.min_ts_ns
                out[shard] = {"job_id": job_id, "position": [info.segment_seq, held],
                              "age_s": round(max(0, now_ns - first_ns) / 1e9, 1)}
                break
    return out


def undecided(staging: Staging) -> list[dict[str, Any]]:
    """Every undecided job with staged bundles on this daemon, oldest first."""
    held = holding(staging)
    now_ns = time.time_ns()
    timeout_s = staging.scfg.writer_timeout_s
    out = []
    for job_id, job in sorted(staging.jobs.items(), key=lambda kv: kv[1].first_ns):
        if job_id in staging.decisions:
            continue
        idle_s = staging.leases.idle_s(job_id)
        out.append({
            "job_id": job_id, "node_id": staging.node_id, "bundles": job.bundles,
            "bytes": int(job.nbytes), "ended_attempts": len(job.ends),
            "first_staged_ns": job.first_ns,
            "age_s": round(max(0, now_ns - job.first_ns) / 1e9, 1),
            "writers": staging.leases.held(job_id),
            "idle_s": None if idle_s is None else round(idle_s, 1),
            # None while a writer is connected: a live job never expires.
            "expires_in_s": None if idle_s is None else round(max(0.0, timeout_s - idle_s), 1),
            "holding_shards": sorted(s for s, h in held.items() if h["job_id"] == job_id)})
    return out
