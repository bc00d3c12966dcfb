"""The catalog's job decisions (SPEC §7): SQL and row conversion shared by both backends.

    quiver_jobs   one row per decided Spark write job; written once, never updated
      job_id PK │ state │ winners │ decided_at_ns │ decided_by │ reason
      state      "committed" | "aborted" | "expired"
      winners    JSON array of {"partition", "attempt", "rows", "checksum"} objects, one per
                 partition a commit publishes; [] unless committed (TEXT in SQLite, jsonb
                 in PostgreSQL)
      index (decided_at_ns), for pruning

    quiver_job_leases   one row per (undecided job, daemon) with a live writer there
      job_id │ node_id │ renewed_at_ns      PK (job_id, node_id); upserted every
                                             writer_timeout_s / 4 while a writer is
                                             connected (``runtime.leases``), rows a
                                             day old deleted by the same statement batch

First writer wins: ``decide_job`` reads and inserts in one transaction that no other
decision of the same job can interleave with (SQLite's write lock, PostgreSQL's advisory
lock on ``lock_key(job_id)``), so of two daemons deciding a job at once (a commit and an
expiry) exactly one inserts, and the other reads that row back.

The table is not a numbered migration step: both backends create it with IF NOT EXISTS
after the steps. It only adds a table, and keeping schema_version where it was lets a
daemon of the previous release, sharing the PostgreSQL database during a rolling upgrade,
keep running (it refuses a database whose version is newer than its own).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec

from quiverd.kernel.errors import LakeError
from quiverd.kernel.jobs import JobDecision, check_job_id
from quiverd.lake.catalog.sql import in_list

JOB_COLUMNS: tuple[str, ...] = ("job_id", "state", "winners", "decided_at_ns", "decided_by",
                                "reason")
assert JOB_COLUMNS == JobDecision.__struct_fields__, "quiver_jobs columns must follow JobDecision"

# "{json}" and "{id}" as in sql.MIGRATIONS (render with sql.migration_sql).
JOBS_DDL: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS quiver_jobs (job_id {id} NOT NULL PRIMARY KEY, "
    "state TEXT NOT NULL, winners {json} NOT NULL, decided_at_ns BIGINT NOT NULL, "
    "decided_by TEXT NOT NULL, reason TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS quiver_jobs_decided_at ON quiver_jobs (decided_at_ns)",
    "CREATE TABLE IF NOT EXISTS quiver_job_leases (job_id {id} NOT NULL, node_id TEXT NOT "
    "NULL, renewed_at_ns BIGINT NOT NULL, PRIMARY KEY (job_id, node_id))",
)
LEASE_KEEP_NS = 86_400 * 10**9  # a lease row not renewed for a day is deleted

_COLS = ", ".join(JOB_COLUMNS)
SELECT_JOB = f"SELECT {_COLS} FROM quiver_jobs WHERE job_id = ?"
INSERT_JOB = f"INSERT INTO quiver_jobs ({_COLS}) VALUES {in_list(len(JOB_COLUMNS))}"
PRUNE_JOBS = "DELETE FROM quiver_jobs WHERE decided_at_ns < ?"
UPSERT_LEASE = ("INSERT INTO quiver_job_leases (job_id, node_id, renewed_at_ns) VALUES (?, ?, ?) "
                "ON CONFLICT (job_id, node_id) DO UPDATE SET renewed_at_ns = "
                "excluded.renewed_at_ns")
PRUNE_LEASES = "DELETE FROM quiver_job_leases WHERE renewed_at_ns < ?"


def select_leases_sql(n: int) -> str:
    """(job_id, newest renewal by a node other than the first parameter) of n job ids."""
    return ("SELECT job_id, max(renewed_at_ns) AS renewed_at_ns FROM quiver_job_leases "
            f"WHERE node_id <> ? AND job_id IN {in_list(n)} GROUP BY job_id")


def select_jobs_sql(n: int) -> str:
    return f"SELECT {_COLS} FROM quiver_jobs WHERE job_id IN {in_list(n)}"


def checked_decision(decision: JobDecision, *, now_ns: int) -> JobDecision:
    """``decision`` type-checked (SQLite would store anything), decided_at_ns = now if 0.

    ValueError for a bad job id, winners on a decision that is not a commit, or a
    partition named twice.
    """
    try:
        checked = msgspec.convert(msgspec.to_builtins(decision), JobDecision)
    except msgspec.ValidationError as exc:
        raise ValueError(f"job decision {decision.job_id!r}: {exc}") from None
    check_job_id(checked.job_id)
    if checked.winners and checked.state != "committed":
        raise ValueError(f"job {checked.job_id}: only a commit names winners, not {checked.state}")
    partitions = [w.partition for w in checked.winners]
    if len(set(partitions)) != len(partitions):
        raise ValueError(f"job {checked.job_id}: a partition has two winners: {sorted(partitions)}")
    if checked.decided_at_ns == 0:
        checked = msgspec.structs.replace(checked, decided_at_ns=now_ns)
    return checked


def decision_values(decision: JobDecision) -> tuple[Any, ...]:
    """A checked decision as ``quiver_jobs`` column values."""
    winners = msgspec.json.encode(decision.winners).decode()
    return (decision.job_id, decision.state, winners, decision.decided_at_ns,
            decision.decided_by, decision.reason)


def decision_from_record(rec: Mapping[str, Any]) -> JobDecision:
    """A ``quiver_jobs`` row, validated: a row this build cannot read is an error, not a
    decision to guess at."""
    try:
        values = {c: rec[c] for c in JOB_COLUMNS}
        values["winners"] = msgspec.json.decode(values["winners"])
        return msgspec.convert(values, JobDecision)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LakeError(f"quiver_jobs row {rec['job_id']!r} is malformed: {exc}",
                        hint="the catalog was written by another release, or by hand") from None


def lock_key(job_id: str) -> int:
    """PostgreSQL's advisory lock key of one job's decision (stable across processes)."""
    digest = hashlib.blake2b(f"quiver/jobs/{job_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big", signed=True)
