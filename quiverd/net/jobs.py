"""JOB requests on a producer connection (SPEC §7): end markers, commit, abort, status.

    → JOB {"op": "end_partition", "client", "job_id", "partition", "attempt", "rows",
           "checksum"}            ← JOB_OK {"node_id", "shard", "sequence"} once durable
    → JOB {"op": "commit", "job_id", "winners": [{partition, attempt, rows, checksum}],
           "remote": [partition, ...]}     (remote: optional; see Staging.commit)
    → JOB {"op": "abort", "job_id", "reason"}
                                  ← JOB_OK {JobDecision fields, "already": bool}
    → JOB {"op": "status", "job_id"}  ← JOB_OK {"job_id", "state", ...}
    → JOB {"op": "visible", "job_id", "timeout_ms"}
                                  ← JOB_OK {"visible": bool, "lake", "bundles", "pending",
                                            "waited_ms", "reason"} once the committed job's
                                     rows are in the catalog, or at the timeout
    → JOB {"op": "lake"}              ← JOB_OK where the catalog and store are, secrets
                                        withheld (``quiverd.net.whereabouts``)
    → JOB {"op": "keepalive", "job_id"}
                                  ← JOB_OK {"job_id", "state", "keepalive_ms"}: a writer
                                     waiting for input keeps its connection (and so its
                                     job's lease, ``runtime.leases``) alive; the next one
                                     is due within ``keepalive_ms``

Every connection that sends a tagged bundle, an end_partition or a keepalive of a job
holds that job's writer lease until it closes: a job is expired only when no such
connection has been open for ``staging.writer_timeout_s``.

A request that needs the catalog while it cannot be reached (a commit, an abort, the
status of a job whose decision is not known here) is ERROR UNAVAILABLE, which the
clients raise as the retryable ``CatalogUnavailable``.

An end marker is written only for an attempt whose bundles this connection took
with contiguous row offsets from 0 up to ``rows`` (a bundle counts the rows of all its
slots, as the frame's end check does), every one of them acked: a
refused, out-of-order or missing bundle leaves the attempt without a marker, so it
is never published. Contradicting a recorded decision is JOB_CONFLICT.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec

from quiverd.kernel.bundle import Bundle, TxnTag, make_slot
from quiverd.kernel.changes import Changes
from quiverd.kernel.errors import CatalogUnavailable, JobConflict, ProtocolError, QuiverError
from quiverd.kernel.jobs import (
    END_OFFSET,
    JobDecision,
    Verdict,
    Winner,
    check_job_id,
    end_marker_table,
)
from quiverd.kernel.layout import DataDir
from quiverd.kernel.names import client_name_problem
from quiverd.protocol.frames import ErrorCode
from quiverd.segments.table import SegmentView, StagedRef

if TYPE_CHECKING:
    from quiverd.protocol.frames import BundleFrame

Key = tuple[str, int, int]  # (job_id, partition, attempt)
U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1


class JobService(Protocol):
    """What the daemon's staging offers a connection (``runtime.staging.Staging``)."""

    node_id: str

    async def commit(self, job_id: str, winners: list[Winner],
                     remote: list[int]) -> tuple[JobDecision, bool]: ...
    async def abort(self, job_id: str, reason: str = "") -> tuple[JobDecision, bool]: ...
    async def lookup(self, job_id: str) -> dict[str, Any]: ...
    async def visible(self, job_id: str, timeout_ms: int) -> dict[str, Any]: ...
    def refusal(self) -> str: ...
    async def refusal_for(self, job_id: str) -> str: ...
    def hold(self, job_id: str, holder: int) -> None: ...
    def release(self, holder: int) -> None: ...
    def keepalive(self, job_id: str, holder: int) -> dict[str, Any]: ...


class EndPartition(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    client: str
    job_id: str
    partition: int
    attempt: int
    rows: int
    checksum: int


class Commit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    job_id: str
    winners: list[Winner]
    # Partitions whose winner wrote its end marker through another daemon (several
    # hosts): that daemon checks it; every other winner's marker must be here.
    remote: list[int] = []


class Abort(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    job_id: str
    reason: str = ""


class Status(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    job_id: str


class Visible(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: str
    job_id: str
    timeout_ms: int = 60_000


class KeepAlive(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A writer with nothing to send yet: its connection and its job stay alive."""

    op: str
    job_id: str


class Lake(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the lake is: a reader holding only the ingest socket asks this."""

    op: str


MAX_VISIBLE_TIMEOUT_MS = 3_600_000
Request = EndPartition | Commit | Abort | Status | Visible | Lake | KeepAlive
OPS: dict[str, type[Request]] = {
    "end_partition": EndPartition, "commit": Commit, "abort": Abort, "status": Status,
    "visible": Visible, "lake": Lake, "keepalive": KeepAlive}


def parse(body: dict[str, Any]) -> Request:
    """A JOB body as its request type; ProtocolError(MALFORMED) when it is not one."""
    kind = OPS.get(str(body.get("op")))
    if kind is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"JOB op must be one of {sorted(OPS)}, "
                            f"not {body.get('op')!r}")
    try:
        req = msgspec.convert(body, kind)
        if not isinstance(req, Lake):
            check_job_id(req.job_id)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"JOB {body.get('op')}: {exc}") from exc
    if isinstance(req, EndPartition):
        # The marker is a bundle of that client: the rule BUNDLE's decoder applies.
        if (problem := client_name_problem(req.client)) is not None:
            raise ProtocolError(ErrorCode.MALFORMED, f"JOB end_partition: {problem}")
        _check_ranges(req.partition, req.attempt, req.rows, req.checksum)
    if isinstance(req, Commit):
        for w in req.winners:
            _check_ranges(w.partition, w.attempt, w.rows, w.checksum)
    if isinstance(req, Visible) and not 0 <= req.timeout_ms <= MAX_VISIBLE_TIMEOUT_MS:
        raise ProtocolError(ErrorCode.MALFORMED, f"JOB visible: timeout_ms must be 0.."
                            f"{MAX_VISIBLE_TIMEOUT_MS}, not {req.timeout_ms}")
    return req


def _check_ranges(partition: int, attempt: int, rows: int, checksum: int) -> None:
    if not (0 <= partition <= U32_MAX and 0 <= attempt <= U32_MAX and 0 <= rows < U64_MAX
            and 0 <= checksum <= U64_MAX):
        raise ProtocolError(ErrorCode.MALFORMED, "partition and attempt must fit u32, rows "
                            "and checksum u64")


@dataclass
class Attempts:
    """One connection's view of the attempts it carries: rows taken, and whether whole."""

    rows: dict[Key, int] = field(default_factory=dict)  # next row_offset expected
    broken: dict[Key, str] = field(default_factory=dict)  # why it can never end
    ended: set[Key] = field(default_factory=set)
    decided: dict[Key, str] = field(default_factory=dict)  # job decided before it began
    pending: dict[int, Key] = field(default_factory=dict)  # request_id -> attempt in flight
    answered: Changes = field(default_factory=Changes)

    def is_new(self, frame: BundleFrame) -> bool:
        txn = frame.txn
        return txn is not None and (txn.job_id, txn.partition, txn.attempt) not in self.rows

    def took(self, frame: BundleFrame, rows: int) -> None:
        """A tagged bundle handed to a shard (call in submission order)."""
        txn = frame.txn
        assert txn is not None
        if txn.row_offset == END_OFFSET:
            raise ProtocolError(ErrorCode.MALFORMED, "row_offset 2**64-1 marks an end of "
                                "partition: send a JOB end_partition request instead")
        key = (txn.job_id, txn.partition, txn.attempt)
        expected = self.rows.get(key, 0)
        if key in self.ended:
            self.broken.setdefault(key, "a bundle came after its end of partition")
        elif txn.row_offset != expected:
            self.broken.setdefault(key, f"a bundle at row_offset {txn.row_offset} came where "
                                   f"{expected} was expected")
        self.rows[key] = txn.row_offset + rows
        self.pending[frame.request_id] = key

    def answered_one(self, request_id: int, ok: bool, why: str = "") -> None:
        key = self.pending.pop(request_id, None)
        if key is not None:
            if not ok:
                self.broken.setdefault(key, f"a bundle was refused: {why}")
            self.answered.notify()

    async def settled(self, key: Key) -> None:
        """Until every bundle of ``key`` in flight is answered."""
        while key in self.pending.values():
            await self.answered.wait_beyond(self.answered.version)

    def check_end(self, req: EndPartition) -> Key:
        key = (req.job_id, req.partition, req.attempt)
        if key in self.broken:
            raise JobConflict(f"partition {req.partition} attempt {req.attempt} of job "
                              f"{req.job_id!r} is incomplete: {self.broken[key]}; it gets "
                              "no end marker and is never published",
                              hint="fail the task: Spark runs another attempt")
        got = self.rows.get(key, 0)
        if got != req.rows:
            raise JobConflict(f"partition {req.partition} attempt {req.attempt} of job "
                              f"{req.job_id!r}: this connection took {got} rows, the end "
                              f"marker says {req.rows}",
                              hint="send every bundle of an attempt, then end_partition, on "
                              "one connection")
        return key


def held_at(segments: SegmentView, verdict: Callable[[StagedRef], Verdict] | None,
            end: tuple[int, int]) -> dict[str, Any] | None:
    """{"job_id", "position"} when the bundle right after position ``end`` is staged for
    an undecided job: a STREAM range that ends at ``end`` stops there, waiting for it."""
    if verdict is None:
        return None
    seqs = segments.seqs()
    for seg in seqs[bisect.bisect_left(seqs, end[0]):]:
        info = segments.get(seg)
        idx = end[1] + 1 if seg == end[0] else 0
        if info is None or idx >= info.bundle_count:
            continue
        ref = info.staged.get(idx)
        if ref is not None and verdict(ref) is Verdict.HOLD:
            return {"job_id": ref.job_id, "position": [seg, idx]}
        return None
    return None


def marker_bundle(req: EndPartition) -> Bundle:
    txn = TxnTag(job_id=req.job_id, partition=req.partition, attempt=req.attempt,
                 row_offset=END_OFFSET)
    return Bundle(client=req.client, slots=(make_slot(0, end_marker_table(req.rows,
                                                                          req.checksum)),),
                  txn=txn)


def decision_body(decision: JobDecision, already: bool) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(decision)
    body["already"] = already
    return body


async def answer(service: JobService | None,
                 req: Commit | Abort | Status | Visible | Lake | KeepAlive,
                 *, lake: dict[str, Any] | None = None, holder: int = 0) -> dict[str, Any]:
    """Commit, abort, status, visible, lake or keepalive; QuiverError (JobConflict,
    CatalogUnavailable) propagates. ``lake``: the daemon's ``whereabouts.lake_reply``;
    ``holder``: the asking connection (a keepalive holds its job's lease)."""
    if isinstance(req, Lake):
        if lake is None:
            raise QuiverError("this daemon does not say where its lake is")
        # The lake's source id names this data directory's files (a stream's lake part
        # takes only those): read when asked, as the tier creates lake.id on a first start.
        source_id = await anyio.to_thread.run_sync(_lake_id, Path(lake["data_dir"]))
        return {**lake, "source_id": source_id}
    if service is None:
        raise QuiverError("this daemon takes no job requests (staging is not running)")
    if isinstance(req, Commit):
        return decision_body(*await service.commit(req.job_id, list(req.winners),
                                                   list(req.remote)))
    if isinstance(req, Abort):
        return decision_body(*await service.abort(req.job_id, req.reason))
    if isinstance(req, Visible):
        return await service.visible(req.job_id, req.timeout_ms)
    if isinstance(req, KeepAlive):
        return service.keepalive(req.job_id, holder)
    return await service.lookup(req.job_id)


def _lake_id(data_dir: Path) -> str:
    """``<data_dir>/lake.id``, "" while the lake never ran there."""
    try:
        return DataDir(data_dir).lake_id.read_text().strip()
    except FileNotFoundError:
        return ""


def error_code(exc: Exception) -> ErrorCode:
    if isinstance(exc, JobConflict):
        return ErrorCode.JOB_CONFLICT
    if isinstance(exc, CatalogUnavailable):
        return ErrorCode.UNAVAILABLE  # retryable: the client may ask again
    if isinstance(exc, ProtocolError):
        return ErrorCode(exc.code)
    return ErrorCode.INTERNAL
