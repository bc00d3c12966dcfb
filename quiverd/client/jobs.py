"""Transactional writes from a producer (SPEC §7), sans-IO: JOB bodies out, replies in.

``Client`` and ``AsyncClient`` send these bodies as JOB frames and hand the JOB_OK
body back here to be checked and typed (docs/protocol.md, "Transactional writes"):

    end_partition  {"op", "client", "job_id", "partition", "attempt", "rows", "checksum"}
                   → EndAck(node_id, shard, sequence): the end marker is durable
    commit         {"op", "job_id", "winners": [{partition, attempt, rows, checksum}],
                    "remote": [partition, ...] (only when not empty)}
    abort          {"op", "job_id", "reason"}
                   → JobResult(decision, already): ``already`` when the job had been
                     decided the same way before (commit and abort are idempotent)
    status         {"op", "job_id"} → the reply as a dict ("state" at least)
    visible        {"op", "job_id", "timeout_ms"}
                   → JobVisibility(visible, lake, bundles, pending, waited_ms, reason):
                     the committed job's rows on that daemon are in the catalog, or
                     ``reason`` says why not yet (the job stays committed and durable)
    lake           {"op"} → where the daemon's catalog and store are (secrets withheld):
                   the reply as a dict ("data_dir", "catalog", "lake" at least)
    keepalive      {"op", "job_id"} → KeepAliveReply(job_id, state, keepalive_ms): a
                   writer waiting for input keeps its connection and its job's writer
                   lease alive; send the next within ``keepalive_ms``

Arguments are checked here, before sending: the daemon answers a malformed JOB with
MALFORMED and closes the connection, taking the bundles in flight with it.

A commit, an abort, or the status of a job whose decision the daemon does not hold
needs its catalog; while that is unreachable the answer is ERROR UNAVAILABLE, raised
as ``CatalogUnavailable`` (``retryable``; the connection stays usable): nothing was
decided, so asking again later is safe (the Spark writer retries commits and aborts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from quiverd.kernel.errors import ProtocolError
from quiverd.kernel.jobs import JobDecision, Winner, check_job_id
from quiverd.kernel.names import client_name_problem
from quiverd.protocol.frames import ErrorCode

T = TypeVar("T")

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


class EndAck(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt's end-of-partition marker is durable as ``sequence`` of ``shard``
    on the daemon ``node_id``."""

    node_id: str
    shard: int
    sequence: int


class JobResult(msgspec.Struct, frozen=True, kw_only=True):
    """The job's recorded decision; ``already``: it was decided this way before."""

    decision: JobDecision
    already: bool


class JobVisibility(msgspec.Struct, frozen=True, kw_only=True):
    """One daemon's answer to ``visible``: ``visible`` once every row of the committed
    job published there is in a registered lake file, ``iceberg`` once also in a
    committed Iceberg snapshot (None: that daemon's projection is off, or an older
    daemon). ``lake`` False: that daemon runs no lake, so no catalog will hold them.
    Otherwise ``reason`` says what is pending."""

    job_id: str
    node_id: str = ""
    lake: bool = True
    visible: bool = False
    iceberg: bool | None = None
    bundles: int = 0  # the job's published bundles on that daemon
    pending: int = 0  # of them, not in the catalog yet
    waited_ms: float = 0.0
    reason: str = ""


class KeepAliveReply(msgspec.Struct, frozen=True, kw_only=True):
    """The job's state as that daemon knows it (no catalog lookup), and how often to ask."""

    job_id: str
    state: str
    keepalive_ms: int


MAX_VISIBLE_TIMEOUT_MS = 3_600_000


def end_partition_body(job_id: str, partition: int, attempt: int, *, client: str, rows: int,
                       checksum: int) -> dict[str, Any]:
    problem = client_name_problem(client)
    if problem is not None:
        raise ValueError(problem)
    _check_attempt(partition, attempt, rows, checksum)
    return {"op": "end_partition", "client": client, "job_id": check_job_id(job_id),
            "partition": partition, "attempt": attempt, "rows": rows, "checksum": checksum}


def commit_body(job_id: str, winners: Sequence[Winner],
                remote: Sequence[int] = ()) -> dict[str, Any]:
    """``remote``: partitions whose winner's end marker went through another daemon (the
    one receiving the commit checks every other winner's marker, JOB_CONFLICT if absent)."""
    seen: set[int] = set()
    for w in winners:
        _check_attempt(w.partition, w.attempt, w.rows, w.checksum)
        if w.partition in seen:
            raise ValueError(f"partition {w.partition} has two winners: a commit names one "
                             "attempt per partition")
        seen.add(w.partition)
    if not set(remote) <= seen:
        raise ValueError(f"remote partitions {sorted(set(remote) - seen)} have no winner")
    body = {"op": "commit", "job_id": check_job_id(job_id),
            "winners": [msgspec.to_builtins(w) for w in winners]}
    if remote:  # only then: a daemon before this field refuses unknown ones
        body["remote"] = sorted(set(remote))
    return body


def abort_body(job_id: str, reason: str) -> dict[str, Any]:
    return {"op": "abort", "job_id": check_job_id(job_id), "reason": reason}


def status_body(job_id: str) -> dict[str, Any]:
    return {"op": "status", "job_id": check_job_id(job_id)}


def visible_body(job_id: str, timeout_s: float) -> dict[str, Any]:
    timeout_ms = round(timeout_s * 1000)
    if not 0 <= timeout_ms <= MAX_VISIBLE_TIMEOUT_MS:
        raise ValueError(f"timeout_s {timeout_s!r} outside 0..{MAX_VISIBLE_TIMEOUT_MS // 1000}")
    return {"op": "visible", "job_id": check_job_id(job_id), "timeout_ms": timeout_ms}


def job_visibility(reply: dict[str, Any]) -> JobVisibility:
    return _convert(reply, JobVisibility, "visible")


def keepalive_body(job_id: str) -> dict[str, Any]:
    return {"op": "keepalive", "job_id": check_job_id(job_id)}


def keepalive_reply(reply: dict[str, Any]) -> KeepAliveReply:
    return _convert(reply, KeepAliveReply, "keepalive")


def lake_body() -> dict[str, Any]:
    return {"op": "lake"}


def end_ack(reply: dict[str, Any]) -> EndAck:
    return _convert(reply, EndAck, "end_partition")


def job_result(reply: dict[str, Any], op: str) -> JobResult:
    already = reply.get("already")
    if not isinstance(already, bool):
        raise ProtocolError(ErrorCode.MALFORMED, f"JOB_OK for {op}: 'already' must be a bool, "
                            f"got {already!r}")
    # Unknown reply fields (``already`` among them) are ignored: replies may grow.
    return JobResult(decision=_convert(reply, JobDecision, op), already=already)


def job_status(reply: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(reply.get("state"), str):
        raise ProtocolError(ErrorCode.MALFORMED, "JOB_OK for status: no 'state' string")
    return reply


def lake_answer(reply: dict[str, Any]) -> dict[str, Any]:
    for name, kind in (("data_dir", str), ("catalog", dict), ("lake", dict)):
        if not isinstance(reply.get(name), kind):
            raise ProtocolError(ErrorCode.MALFORMED, f"JOB_OK for lake: no {name!r} "
                                f"{kind.__name__}")
    return reply


def _convert(reply: dict[str, Any], kind: type[T], op: str) -> T:
    try:
        return msgspec.convert(reply, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"JOB_OK for {op}: {exc}") from None


def _check_attempt(partition: int, attempt: int, rows: int, checksum: int) -> None:
    for name, value, top in (("partition", partition, U32_MAX), ("attempt", attempt, U32_MAX),
                             ("rows", rows, U64_MAX - 1), ("checksum", checksum, U64_MAX)):
        if not isinstance(value, int) or not 0 <= value <= top:
            raise ValueError(f"{name} {value!r} outside 0..{top}")
