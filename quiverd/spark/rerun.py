"""A batch write re-run under a committed ``job_id`` (``if_committed`` "skip" or
"verify"): does it carry the committed rows?

    executor  compare(...)        the task reads its input and encodes it exactly as it
                                  would send it (rechunk, AttemptStream: no socket), and
                                  compares rows and checksum with its partition's winner
    driver    rerun_differs(...)  the partitions that differ, and the earlier commit (its
                                  time, node, rows): a warning (``spark_job_rerun_differs``)
                                  or, with "verify", WriteRefused

The checksum depends on the write's batch options too: the same rows written with other
``batch_rows``/``batch_bytes`` are reported as "another checksum", saying so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from quiverd.kernel import logs
from quiverd.kernel.bundle import TxnTag
from quiverd.spark.chunks import AttemptStream, WriteRefused, rechunk
from quiverd.spark.write_options import WriteOptions

if TYPE_CHECKING:
    from quiverd.spark.writer import QuiverCommitMessage


def compare(opts: WriteOptions, message: QuiverCommitMessage,
            batches: Iterable[pa.RecordBatch], limit: int) -> str:
    """"" when this partition's input, encoded as it would have been sent, has the rows
    and checksum its recorded winner has; else what differs."""
    mine = [r for r in message.recorded if r[0] == message.partition]
    stream = AttemptStream(TxnTag(job_id=message.job_id, partition=message.partition,
                                  attempt=0, row_offset=0))
    chunks = rechunk(batches, max_rows=opts.batch_rows, max_bytes=min(opts.batch_bytes, limit))
    for _ in stream.items(chunks, limit):
        pass
    if not mine:
        return (f"partition {message.partition}: {stream.rows} rows now, the commit has no "
                "such partition")
    _, _, rows, checksum = mine[0]
    if rows != stream.rows:
        return f"partition {message.partition}: {stream.rows} rows now, {rows} committed"
    if checksum != stream.checksum:
        return (f"partition {message.partition}: {rows} rows as committed but another "
                "checksum (other rows, or other batch_rows/batch_bytes options)")
    return ""


def rerun_differs(messages: Sequence[Any], job_id: str, *, refuse: bool) -> None:
    """A skipped replay whose rows differ from the commit's: a warning naming the earlier
    commit and the partitions (``refuse``, if_committed="verify": WriteRefused)."""
    found: list[QuiverCommitMessage] = [m for m in messages if getattr(m, "recorded", ())]
    differs = [m.differs for m in found if m.differs]
    committed = {(int(p), int(r)) for m in found[:1] for p, _, r, _ in m.recorded}
    if found and len(messages) != len(committed):  # fewer partitions now, or more
        differs.append(f"{len(messages)} partitions now, {len(committed)} committed")
    if not found or not differs:
        return
    first = found[0]
    when = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(first.committed_at_ns / 1e9))
            if first.committed_at_ns else "at an unknown time")
    text = (f"job {job_id!r} was committed {when} by {first.committed_by or 'a daemon'} "
            f"with {sum(r for _, r in committed)} rows in {len(committed)} partitions; this "
            f"write's rows differ ({'; '.join(differs[:10])}) and are NOT written: a job id "
            "is written once")
    if refuse:
        raise WriteRefused(f"{text} (if_committed=\"verify\")")
    logs.quiet("spark_writer").warning(
        "spark_job_rerun_differs", job_id=job_id, message=text,
        hint='write them under a new job_id; if_committed="verify" makes this an error')
