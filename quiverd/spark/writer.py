"""``df.write.format("quiver")``: exactly-once writes into quiverd (SPEC §7).

    (df.write.format("quiver")
       .option("path", "/var/lib/quiverd/ingest.sock")  # or "socket", or "config": see below
       .option("client", "web")                         # the rows' client name (default spark)
       .mode("append").save())

Spark runs each step in its own Python process; nothing crosses between them but the
pickled writer (options and job id) and the pickled commit messages:

    driver   QuiverWriter(options)      job_id: option "job_id", else a fresh uuid4 hex
    executor QuiverWriter.write(batches) one task attempt, one connection to
                                        paths[partition % len(paths)]: its batches
                                        re-chunked into bundles (batch_rows / batch_bytes),
                                        each tagged TxnTag(job_id, partition,
                                        attempt=taskAttemptId, row_offset=rows before it)
                                        and pipelined; then JOB end_partition(rows,
                                        checksum = CRC-32C chained over the bundles' IPC
                                        streams as sent) → QuiverCommitMessage
    driver   QuiverWriter.commit(msgs)  JOB commit on paths[0]: the winning attempt of every
                                        partition is published, once; the daemon discards
                                        every other attempt (failed, speculative)
    driver   QuiverWriter.abort(msgs)   JOB abort: the job's staged rows are discarded

Options: ``path`` or ``socket`` (one ingest socket), or ``config`` (the daemon's config
file: its ingest socket), or ``paths`` (comma-separated sockets: partition
p writes to paths[p % n], commit and abort go to paths[0]); none of them: the defaults
of quiverd/spark/locator.py ($QUIVERD_SOCKET, the default socket, the default config's
socket), and a socket that is not there says how it was chosen. ``paths`` stands for several
hosts, each with its own daemon sharing one catalog; tests emulate that with several
daemons on one machine. ``client`` (default "spark"), ``batch_rows`` (default 65536) and
``batch_bytes`` (default 8 MiB, and never more than the daemon's max_bundle_bytes) bound a
bundle; ``job_id`` names the job (any 1..256 bytes of UTF-8); ``decide_timeout_s``
(default 300) bounds how long the driver's commit and abort retry a daemon restarting or
its catalog unreachable (``_decide``). An option not listed in
quiverd/spark/options.py is refused on the driver, naming the closest known one.

A batch write naming a ``job_id`` that is committed already (``foreachBatch`` replaying
a micro-batch after a restart, with ``job_id=f"{query}-{batch_id}"``) follows option
``if_committed``: "skip" (the default, as Delta does) sends no row, and the commit names
the job's recorded winners again, which the daemon answers ``already``: a no-op. Each
task still reads its input and checksums it as it would have sent it: partitions whose
rows differ from the commit's (row count, or checksum: other rows, or other batch
options) are named in a warning on the driver (``spark_job_rerun_differs``: the earlier
commit's time, node and rows, and these). "verify" fails the write instead when they
differ (WriteRefused, nothing published); "error" fails the write once whenever the job
is committed. A job id aborted or expired before fails the write once whatever the
option says: a job id is decided once.

Streaming (``df.writeStream.format("quiver")``, append mode): micro-batch b of a query is
job ``f"{query_id}-{b}"``: option ``query_id``, else one derived from the
``checkpointLocation`` option (stable across restarts), else an error asks for one. A
batch Spark replays after a restart re-commits the same job: one published before is not
sent again, and the commit is a no-op. An aborted micro-batch records no decision: the
restarted query replays it under the same job id, whose commit discards the attempts it
staged. If the query stays down longer than staging.writer_timeout_s, the daemon expires
that job (its writers are gone); the replay then writes under the next incarnation,
``f"{query_id}-{b}.1"`` (then ``.2`` ...: ``incarnation``), so it is published once.

Read your writes: a batch job's commit, and each micro-batch's, returns once the catalog
holds every row of the job, so the next ``spark.read.format("quiver")`` sees them
(``quiverd.spark.visible``; option ``visible_timeout_s``, default 60, 0 = do not wait).
At the timeout it returns all the same, with a warning: the job is committed and durable.

quiverd only appends: ``mode("overwrite")`` and Complete output mode are refused.
``saveAsTable`` (and CREATE TABLE ... AS SELECT, ``writeTo(...).create()``) is refused
before any row is sent: Spark 4 does not keep a Python data source's options with a
table, so its rows could never be read back. Spark hands the writer nothing that tells
such a write from ``save()`` but its tasks' local properties: the write runs as a query
nested in the command (its ``spark.sql.execution.id`` differs from
``spark.sql.execution.root.id``) outside any streaming query (foreachBatch nests too).
INSERT INTO a temporary view ``USING quiver OPTIONS (...)`` works: the view keeps them.

Writes that can never succeed fail once, with one line saying why, instead of Spark's
retries: a DataFrame with a ``_quiver_*`` column (SPEC §1) is refused on the driver
before any task runs; a row larger than the daemon's ``max_bundle_bytes`` (from its
HELLO_OK) ends its task attempt without an end marker (so nothing of it can be
published) and with a commit message carrying the reason, and the driver's commit raises
``WriteRefused`` with it, after which Spark aborts the job (its staged rows discarded).
Spark has no non-retryable task error for Python sources: a task that raised would be
run again ``spark.task.maxFailures`` times.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pyarrow as pa

try:
    from pyspark import TaskContext
    from pyspark.sql.datasource import (
        DataSourceArrowWriter,
        DataSourceStreamArrowWriter,
        WriterCommitMessage,
    )
    from pyspark.sql.types import StructType
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("quiverd.spark needs pyspark 4: pip install 'quiverd[spark]'") from exc

from quiverd.client import Client
from quiverd.kernel import logs
from quiverd.kernel.bundle import TxnTag
from quiverd.kernel.errors import (
    AtCapacity,
    CatalogUnavailable,
    ConfigError,
    DaemonUnreachable,
    JobConflict,
    QuiverError,
    SchemaConflict,
)
from quiverd.kernel.jobs import MAX_JOB_ID_BYTES, Winner, check_job_id
from quiverd.kernel.logs import Logger
from quiverd.kernel.names import reserved_column_problem
from quiverd.spark.chunks import (  # noqa: F401 - re-exported: tests import them from here
    AttemptStream,
    RowTooLarge,
    WriteRefused,
    encode_bounded,
    rechunk,
)
from quiverd.spark.keepalive import KeepAlive
from quiverd.spark.rerun import compare, rerun_differs  # noqa: F401 - tests import it here
from quiverd.spark.visible import wait_visible
from quiverd.spark.write_options import (  # noqa: F401 - re-exported
    BATCH_BYTES,
    BATCH_ROWS,
    DEFAULT_CLIENT,
    WriteOptions,
)

MAX_ATTEMPT = 2**32 - 1  # TxnTag.attempt is a u32 on the wire
MAX_INCARNATIONS = 100  # job ids one micro-batch may use: <query>-<batch>[.1 .. .99]
BATCH_ID_PROPERTY = "streaming.sql.batchId"  # Spark's local property in micro-batch tasks
# Spark's local properties that tell a nested write: a command that runs a query of its
# own (CREATE TABLE AS SELECT: saveAsTable, writeTo(...).create()) gives that query an
# execution id of its own under the command's root id. foreachBatch nests too, inside
# a streaming query, whose tasks carry the query id.
EXECUTION_ID_PROPERTY = "spark.sql.execution.id"
ROOT_EXECUTION_ID_PROPERTY = "spark.sql.execution.root.id"
STREAMING_QUERY_PROPERTY = "sql.streaming.queryId"
TABLE_WRITE_REFUSED = (
    "saveAsTable (and CREATE TABLE ... AS SELECT, writeTo(...).create()) cannot write to "
    "quiver: Spark 4 keeps no options for a Python data source's table, so the rows would "
    "be written and the table could never be read back; nothing was published. Write with "
    'df.write.format("quiver").option("client", ...).save(), and give the rows a SQL name '
    "with CREATE TEMPORARY VIEW v USING quiver OPTIONS (client '...', socket '...')")
# The driver's commit and abort are idempotent, so a daemon restart, a catalog outage
# or a full WAL in between is retried, for option decide_timeout_s (default 300 s), with
# backoff from DECIDE_BACKOFF_S doubling up to DECIDE_BACKOFF_MAX_S.
DECIDE_BACKOFF_S = 0.5
DECIDE_BACKOFF_MAX_S = 5.0
T = TypeVar("T")


@dataclass
class QuiverCommitMessage(WriterCommitMessage):
    """What one task attempt wrote, for the driver's commit (the list index is the
    partition). ``published_before``: a replayed micro-batch found its job committed
    already and sent nothing; ``recorded``: a replayed batch write (if_committed=skip)
    did the same, and these are the winners the job was committed with (partition,
    attempt, rows, checksum), which the driver's commit names again: a no-op.
    ``refused``: why the attempt stopped (no end marker) and the job cannot be written;
    the driver's commit raises it. ``differs``: a replay's rows are not the committed
    ones (this partition's rows and checksum against the commit's); ``committed_at_ns``,
    ``committed_by``: the earlier commit."""

    job_id: str
    partition: int
    task_attempt_id: int
    attempt_number: int
    stage_id: int
    rows: int
    checksum: int
    node_id: str
    shard: int
    sequence: int
    published_before: bool = False
    refused: str = ""
    recorded: tuple[tuple[int, int, int, int], ...] = ()
    differs: str = ""
    committed_at_ns: int = 0
    committed_by: str = ""


class QuiverWriter(DataSourceArrowWriter):
    """A batch write: one job, committed or aborted once by the driver."""

    def __init__(self, options: Mapping[str, str], overwrite: bool) -> None:
        _refuse_overwrite(overwrite)
        self.opts = WriteOptions.parse(options)
        given = {k.lower(): v for k, v in options.items()}.get("job_id")
        # Chosen here, on the driver, before Spark pickles the writer for the tasks
        # and for commit/abort: all of them see the same id.
        self.job_id = check_job_id(str(given) if given else uuid.uuid4().hex)
        # Only a job id given may have been used before (a foreachBatch replay).
        self.if_committed = self.opts.if_committed if given else ""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> QuiverCommitMessage:
        return write_attempt(self.opts, self.job_id, iterator, if_committed=self.if_committed)

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        winners = winners_of(messages, self.job_id)
        rerun_differs(messages, self.job_id, refuse=self.if_committed == "verify")
        _wait_at_gate(self.opts.commit_gate)
        remote = remote_partitions(self.opts, winners)
        _decide(self.opts, self.job_id, lambda c: c.commit_job(self.job_id, winners, remote))
        # Read your writes: returns once the catalog holds the rows, or warns (no raise).
        wait_visible([self.opts.path_for(w.partition) for w in winners], self.job_id,
                     self.opts.visible_timeout_s)

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        reason = "Spark aborted the write: a task or the commit failed"
        try:
            _decide(self.opts, self.job_id, lambda c: c.abort_job(self.job_id, reason))
        except JobConflict:
            # Spark aborts after a commit that raised; if that commit was recorded
            # (its answer lost), the rows are published and stay so.
            _quiet_log().warning("spark_abort_found_job_committed", job_id=self.job_id)


class QuiverStreamWriter(DataSourceStreamArrowWriter):
    """A streaming write: micro-batch b is the job ``f"{query_id}-{b}"``."""

    def __init__(self, options: Mapping[str, str], overwrite: bool) -> None:
        _refuse_overwrite(overwrite)
        self.opts = WriteOptions.parse(options, 'df.writeStream.format("quiver")')
        self.query_id = query_id_of(options)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> QuiverCommitMessage:
        ctx = TaskContext.get()
        batch_id = ctx.getLocalProperty(BATCH_ID_PROPERTY) if ctx is not None else None
        if batch_id is None:
            raise RuntimeError(f"no micro-batch id ({BATCH_ID_PROPERTY}) in this Spark task: "
                               "QuiverStreamWriter.write runs in a streaming query's tasks")
        job_id = stream_job_id(self.query_id, int(batch_id))
        return write_attempt(self.opts, job_id, iterator, skip_if_committed=True)

    def commit(self, messages: Sequence[WriterCommitMessage | None],
               batchId: int) -> None:  # noqa: N803 - Spark's name
        job_id = _written_as(messages, stream_job_id(self.query_id, batchId))
        winners = winners_of(messages, job_id)
        replay = any(isinstance(m, QuiverCommitMessage) and m.published_before
                     for m in messages)

        def commit(c: Client) -> None:
            state = c.job_status(job_id)["state"]
            if state == "committed":
                return  # published before this replay: at most once
            if replay:
                raise JobConflict(f"micro-batch {batchId}: a task found job {job_id!r} "
                                  f"committed, the driver finds it {state}")
            try:
                c.commit_job(job_id, winners, remote_partitions(self.opts, winners))
            except JobConflict as exc:
                if c.job_status(job_id)["state"] != "committed":
                    raise JobConflict(f"micro-batch {batchId} (job {job_id!r}): {exc}",
                                      hint="Spark runs the micro-batch again (after the "
                                      "query's restart), as the next incarnation of its "
                                      "job id") from exc

        _decide(self.opts, job_id, commit)
        wait_visible([self.opts.path_for(w.partition) for w in winners], job_id,
                     self.opts.visible_timeout_s)

    def abort(self, messages: Sequence[WriterCommitMessage | None],
              batchId: int) -> None:  # noqa: N803 - Spark's name
        """Records nothing: see the module doc (a replay must be able to commit)."""


def write_attempt(opts: WriteOptions, job_id: str, batches: Iterable[pa.RecordBatch], *,
                  skip_if_committed: bool = False, if_committed: str = ""
                  ) -> QuiverCommitMessage:
    """Stream one task attempt's rows as tagged bundles, then its end marker.

    ``skip_if_committed`` (micro-batches): a committed job sends nothing. ``if_committed``
    (a batch write naming its job_id): "skip" likewise, recording the job's winners in the
    message, "error" refuses; "" (a fresh job id) asks nothing. A table write
    (saveAsTable) is refused before anything is sent."""
    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("QuiverWriter.write runs inside a Spark task")
    partition, attempt = ctx.partitionId(), ctx.taskAttemptId()
    if attempt > MAX_ATTEMPT:
        raise ValueError(f"Spark task attempt id {attempt} does not fit the u32 attempt of "
                         "quiverd's protocol; restart the Spark application (task attempt "
                         "ids count from 0 in each)")
    message = QuiverCommitMessage(
        job_id=job_id, partition=partition, task_attempt_id=attempt,
        attempt_number=ctx.attemptNumber(), stage_id=ctx.stageId(), rows=0, checksum=0,
        node_id="", shard=-1, sequence=-1)
    if is_table_write(ctx):
        message.refused = f"partition {partition}: {TABLE_WRITE_REFUSED}"
        return message
    with connect(opts, opts.path_for(partition)) as c:
        if if_committed and (found := _decided_before(c, job_id, if_committed, message)):
            if found.recorded:  # skipped: say whether these rows are the committed ones
                found.differs = compare(opts, found, batches, c.server.max_bundle_bytes)
            return found
        if skip_if_committed:
            job_id, state = incarnation(c, job_id)
            message.job_id = job_id
            if state == "committed":  # a replayed micro-batch: published before
                message.published_before = True
                return message
        stream = AttemptStream(TxnTag(job_id=job_id, partition=partition, attempt=attempt,
                                      row_offset=0))
        limit = c.server.max_bundle_bytes
        try:
            # The open connection is the job's writer lease; keepalives hold it (and
            # the connection) while Spark computes the next batch (quiverd.spark.keepalive).
            with KeepAlive(c, job_id) as keep:
                chunks = rechunk(keep.batches(batches), max_rows=opts.batch_rows,
                                 max_bytes=min(opts.batch_bytes, limit))
                for _ in c.iter_send(stream.items(chunks, limit), client=opts.client):
                    pass
        except (WriteRefused, JobConflict, SchemaConflict) as exc:
            # No end marker: the rows sent are staged, never published, and discarded
            # when Spark aborts the job after the driver's commit raised this reason.
            # Raising here instead would only make Spark run the task again. (JobConflict:
            # the job id was decided before, so no bundle of it is accepted any more, or
            # it was aborted or expired while this task ran; SchemaConflict:
            # lake.schema_mode = "strict" refused the rows' schema.)
            message.refused = f"partition {partition}: {exc}"
            return message
        end = c.end_partition(job_id, partition, attempt, client=opts.client,
                              rows=stream.rows, checksum=stream.checksum)
    message.rows, message.checksum = stream.rows, stream.checksum
    message.node_id, message.shard, message.sequence = end.node_id, end.shard, end.sequence
    if opts.fail_after_end == (partition, ctx.attemptNumber()):
        # Tests only: a complete attempt (end marker durable) whose commit message never
        # reaches the driver, as a speculative copy that lost the race (Spark local mode
        # never speculates).
        raise RuntimeError(f"_fail_after_end: partition {partition} attempt "
                           f"{ctx.attemptNumber()} fails after its end marker")
    return message


def winners_of(messages: Sequence[WriterCommitMessage | None], job_id: str) -> list[Winner]:
    """One Winner per partition; a missing or foreign message refuses the commit, and a
    refused one raises its reason (WriteRefused). A replayed batch write whose tasks all
    found the job committed names the winners it was committed with."""
    refused = [m.refused for m in messages if isinstance(m, QuiverCommitMessage) and m.refused]
    if refused:
        more = f" (and {len(refused) - 1} more partitions)" if len(refused) > 1 else ""
        raise WriteRefused(f"job {job_id!r} not written, nothing of it is published: "
                           f"{refused[0]}{more}")
    replays = [m for m in messages if isinstance(m, QuiverCommitMessage) and m.recorded]
    if replays:
        if len(replays) != len(messages):
            raise JobConflict(f"job {job_id!r} was committed while this write ran: "
                              f"{len(replays)} of {len(messages)} partitions found it "
                              "committed, the others wrote rows (discarded)",
                              hint="two writes used one job_id at once: give each its own")
        return [Winner(partition=p, attempt=a, rows=r, checksum=c)
                for p, a, r, c in replays[0].recorded]
    winners = []
    for index, m in enumerate(messages):
        if not isinstance(m, QuiverCommitMessage):
            raise RuntimeError(f"partition {index} sent no commit message ({m!r}): the job "
                               "is not committed, so none of it is published")
        if m.job_id != job_id:
            raise RuntimeError(f"partition {index} wrote job {m.job_id!r}, not {job_id!r}")
        winners.append(Winner(partition=m.partition, attempt=m.task_attempt_id, rows=m.rows,
                              checksum=m.checksum))
    return winners


def remote_partitions(opts: WriteOptions, winners: Sequence[Winner]) -> list[int]:
    """Partitions written through another daemon than paths[0], which the commit goes to:
    that daemon checks their end markers (``option paths``: several hosts)."""
    return [w.partition for w in winners if opts.path_for(w.partition) != opts.paths[0]]


def refuse_reserved_columns(schema: StructType) -> None:
    """On the driver, before any task runs: quiverd refuses ``_quiver_*`` columns."""
    problem = reserved_column_problem(schema.fieldNames())
    if problem is not None:
        raise WriteRefused(problem)


def query_id_of(options: Mapping[str, str]) -> str:
    opts = {k.lower(): str(v) for k, v in options.items()}
    if opts.get("query_id"):
        query_id = opts["query_id"]
    elif opts.get("checkpointlocation"):
        location = opts["checkpointlocation"].rstrip("/")
        query_id = "ckpt-" + hashlib.sha256(location.encode()).hexdigest()[:32]
    else:
        raise ValueError('a streaming write to quiver needs a stable query id: set option '
                         '"query_id" (or "checkpointLocation", which it is derived from); '
                         "micro-batch b is committed as job f'{query_id}-{b}'")
    if len(query_id.encode()) > MAX_JOB_ID_BYTES - 24:  # "-", a batch id, ".<incarnation>"
        raise ValueError(f'option "query_id" is longer than {MAX_JOB_ID_BYTES - 24} bytes')
    return query_id


def stream_job_id(query_id: str, batch_id: int) -> str:
    return check_job_id(f"{query_id}-{batch_id}")


def incarnation(c: Client, base: str) -> tuple[str, str]:
    """The job id a micro-batch writes under now, and its state: ``base``, or the first
    of ``base.1``, ``base.2``, ... after those an expiry (its writers gone for
    staging.writer_timeout_s: the query failed) or an operator's abort ended. A job id is
    decided once, so a replay of a micro-batch whose job was expired writes its rows
    again under the next one; a committed one is found and not written twice."""
    for n in range(MAX_INCARNATIONS):
        job_id = base if n == 0 else check_job_id(f"{base}.{n}")
        state = str(c.job_status(job_id)["state"])
        if state not in ("aborted", "expired"):
            return job_id, state
    raise JobConflict(f"job {base!r} and its next {MAX_INCARNATIONS - 1} incarnations are "
                      "aborted or expired: this micro-batch keeps failing",
                      hint="find why in the daemon's log (staged_job_expired); restart the "
                      "query with a new query_id / checkpoint")


def _written_as(messages: Sequence[WriterCommitMessage | None], base: str) -> str:
    """The job id the micro-batch's tasks wrote under (its incarnation); all the same."""
    ids = {m.job_id for m in messages if isinstance(m, QuiverCommitMessage)}
    if len(ids) > 1:
        raise JobConflict(f"the tasks of one micro-batch wrote under {sorted(ids)}: an "
                          "incarnation was expired while they ran",
                          hint="Spark runs the micro-batch again")
    return ids.pop() if ids else base


def is_table_write(ctx: TaskContext) -> bool:
    """Is this task's write nested in a command that runs a query of its own (a CREATE
    TABLE AS SELECT: saveAsTable, writeTo(...).create()), outside a streaming query?
    Spark hands the Python data source nothing else that tells a table write from
    save(): the same options, schema and overwrite flag (checked with Spark 4.3)."""
    execution = ctx.getLocalProperty(EXECUTION_ID_PROPERTY)
    root = ctx.getLocalProperty(ROOT_EXECUTION_ID_PROPERTY)
    return (execution is not None and root is not None and execution != root
            and ctx.getLocalProperty(STREAMING_QUERY_PROPERTY) is None)


def connect(opts: WriteOptions, path: str, *, timeout: float | None = None) -> Client:
    """``Client.connect``; a socket that is not there says how it was chosen."""
    try:
        return Client.connect(path, timeout=timeout)
    except DaemonUnreachable as exc:
        if not opts.origin:
            raise
        raise DaemonUnreachable(f"{exc}{opts.origin}", hint=exc.hint) from None


def _decided_before(c: Client, job_id: str, if_committed: str,
                    message: QuiverCommitMessage) -> QuiverCommitMessage | None:
    """A batch write naming a job decided before: the message to return at once (a skip
    or a refusal), or None when the job is new (or staged: this may be a retry), or when
    the catalog cannot tell now: the rows are then staged as for any job, and the
    daemon still refuses a second decision (JOB_CONFLICT), so nothing is published twice."""
    try:
        status = c.job_status(job_id)
    except CatalogUnavailable:
        return None
    state, winners = status["state"], status.get("winners") or []
    if state == "committed" and if_committed in ("skip", "verify") and winners:
        message.published_before = True
        message.recorded = tuple((int(w["partition"]), int(w["attempt"]), int(w["rows"]),
                                  int(w["checksum"])) for w in winners)
        message.committed_at_ns = int(status.get("decided_at_ns") or 0)
        message.committed_by = str(status.get("decided_by") or "")
        return message
    if state not in ("committed", "aborted", "expired"):
        return None
    if state == "committed" and if_committed == "error":
        why = ('and option "if_committed" is "error": use a new job_id, or '
               'if_committed="skip" to make writing a committed job again a no-op')
    else:
        why = "and a job id is decided once: use a new job_id"
    message.refused = f"partition {message.partition}: job {job_id!r} is {state} already, {why}"
    return message


def _decide(opts: WriteOptions, job_id: str, decide: Callable[[Client], T]) -> T:
    """Run a commit/abort on paths[0], retried while the daemon is away, its catalog is
    unreachable or its WAL full, for at most ``opts.decide_timeout_s``.

    Each try first sends a JOB keepalive, and the connection stays open between tries
    (the wait between them is shorter than the keepalive interval the daemon asks for):
    the job keeps its writer lease, so a daemon whose catalog comes back does not expire
    it (no writer for staging.writer_timeout_s) before this commit gets through."""
    deadline = time.monotonic() + opts.decide_timeout_s
    delay, pause_s = DECIDE_BACKOFF_S, DECIDE_BACKOFF_MAX_S
    c: Client | None = None
    try:
        while True:
            try:
                if c is None:
                    c = connect(opts, opts.paths[0], timeout=60)
                pause_s = c.keepalive(job_id).keepalive_ms / 1000
                return decide(c)
            except (QuiverError, OSError) as exc:  # OSError: reset, refused, timed out
                retryable = exc.retryable if isinstance(exc, QuiverError) else True
                wait = min(delay, pause_s)
                if not retryable or time.monotonic() + wait > deadline:
                    raise
                if not isinstance(exc, CatalogUnavailable | AtCapacity) and c is not None:
                    c.close()  # the connection's state is unknown: a new one next time
                    c = None
                _quiet_log().warning("spark_decide_retrying", job_id=job_id,
                                     error=str(exc), retry_in_s=round(wait, 2),
                                     gives_up_in_s=round(deadline - time.monotonic(), 1))
                time.sleep(wait)
                delay = min(delay * 2, DECIDE_BACKOFF_MAX_S)
    finally:
        if c is not None:
            c.close()


def _wait_at_gate(gate: str, timeout_s: float = 120.0) -> None:
    if not gate:
        return
    (Path(gate) / "ready").touch()
    deadline = time.monotonic() + timeout_s
    while not (Path(gate) / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _refuse_overwrite(overwrite: bool) -> None:
    if overwrite:
        raise ConfigError("mode", "quiverd only appends: write with mode('append') (or "
                          "outputMode('append') when streaming)")


def _quiet_log() -> Logger:
    return logs.quiet("spark_writer")
