"""Transactional writes (SPEC §7): what producers, the daemon and the catalog share.

A Spark task attempt streams bundles tagged ``TxnTag(job_id, partition, attempt,
row_offset)`` (attempt = Spark's unique ``taskAttemptId``) and ends with an
end-of-partition marker: a bundle of the same tag whose ``row_offset`` is
``END_OFFSET`` and whose slot 0 holds one row of ``END_SCHEMA`` (rows, checksum).
The daemon writes the marker itself (the producer asks with a JOB ``end_partition``
request), after checking the attempt's row offsets were contiguous up to ``rows``.

Tagged bundles are durable but staged: nobody sees them until the job's decision,
recorded once in the catalog (first writer wins), publishes the winning attempt
of each partition (``Winner``) or discards the job (``aborted``, ``expired``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
import pyarrow as pa

END_OFFSET = 2**64 - 1  # TxnTag.row_offset of an end-of-partition marker
END_SCHEMA = pa.schema([pa.field("rows", pa.uint64(), nullable=False),
                        pa.field("checksum", pa.uint64(), nullable=False)],
                       metadata={b"quiver.partition_end": b"1"})
MAX_JOB_ID_BYTES = 256

JobState = Literal["committed", "aborted", "expired"]
JOB_STATES: tuple[str, ...] = ("committed", "aborted", "expired")


class Verdict(enum.Enum):
    """What the dispatcher does with a staged bundle (``runtime.staging``)."""

    HOLD = "hold"  # its job is undecided (or its winner's marker is not finalized yet)
    PUBLISH = "publish"  # the winning attempt of its partition: deliver it
    DISCARD = "discard"  # anything else: a ``dropped`` outcome, never delivered


class Winner(msgspec.Struct, frozen=True, kw_only=True):
    """The attempt of one partition a commit publishes, and what its marker said."""

    partition: int
    attempt: int  # Spark's taskAttemptId
    rows: int
    checksum: int


class JobDecision(msgspec.Struct, frozen=True, kw_only=True):
    """A job's fate, recorded once in the catalog; the first decision stands."""

    job_id: str
    state: JobState
    winners: tuple[Winner, ...] = ()
    decided_at_ns: int = 0
    decided_by: str = ""  # node id of the daemon that recorded it
    reason: str = ""

    def winner(self, partition: int) -> Winner | None:
        if self.state != "committed":
            return None
        for w in self.winners:
            if w.partition == partition:
                return w
        return None


def end_marker_table(rows: int, checksum: int) -> pa.Table:
    return pa.table({"rows": pa.array([rows], pa.uint64()),
                     "checksum": pa.array([checksum], pa.uint64())}, schema=END_SCHEMA)


def read_end_marker(table: pa.Table) -> tuple[int, int]:
    """(rows, checksum) of a marker's slot 0; ValueError when it is not one."""
    if table.num_rows != 1 or table.schema.names != ["rows", "checksum"]:
        raise ValueError("not an end-of-partition marker")
    return int(table["rows"][0].as_py()), int(table["checksum"][0].as_py())


def marker_problem(ends: Mapping[tuple[int, int], tuple[int, int]],
                   winners: Iterable[Winner]) -> str:
    """What is wrong with a commit's ``winners`` given the end markers held here,
    ``ends[(partition, attempt)] = (rows, checksum)``; "" when each has its marker."""
    missing, wrong = [], []
    for w in winners:
        end = ends.get((w.partition, w.attempt))
        if end is None:
            missing.append(f"{w.partition} (attempt {w.attempt})")
        elif end != (w.rows, w.checksum):
            wrong.append(f"{w.partition} (attempt {w.attempt}: marker rows={end[0]} "
                         f"checksum={end[1]}, commit rows={w.rows} checksum={w.checksum})")
    parts = []
    if missing:
        parts.append("no end-of-partition marker on this daemon for partitions "
                     + ", ".join(missing))
    if wrong:
        parts.append("a different end marker for partitions " + ", ".join(wrong))
    return "; ".join(parts)


def check_job_id(job_id: str) -> str:
    if not job_id or len(job_id.encode("utf-8")) > MAX_JOB_ID_BYTES:
        raise ValueError(f"job_id must be 1..{MAX_JOB_ID_BYTES} bytes of UTF-8")
    return job_id
