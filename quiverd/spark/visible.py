"""Read your writes: the driver's commit waits until the catalog holds the job's rows,
and, where the Iceberg projection is on, a committed snapshot too.

    driver  commit ──▶ JOB visible(job_id, timeout_ms) ──▶ each daemon holding a winner,
                       in parallel (one thread and connection per daemon)
            ◀── visible on every daemon: commit returns, the next read sees every row
                (spark.read.format("quiver"), and pyiceberg, DuckDB or any Iceberg
                reader loading the table after it)

Bounded by the writer option ``visible_timeout_s`` (default 60 s; 0: not asked). When a
daemon does not answer ``visible`` in time (its lake is degraded, slow, or the daemon
is unreachable), the job is still committed and durable: the commit returns all the
same and logs one warning (``spark_commit_not_visible``) with every daemon's reason.
Raising instead would make Spark call abort (a no-op on a committed job) and report
the write as failed, and a scheduler's retry would then write the rows a second time
under a new job id. Daemons whose lake is off answer at once: nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from quiverd.client import Client
from quiverd.client.jobs import JobVisibility
from quiverd.kernel import logs
from quiverd.kernel.errors import QuiverError

VISIBLE_TIMEOUT_S = 60.0
ANSWER_MARGIN_S = 30.0  # the socket's timeout beyond the daemon's own


def wait_visible(paths: Sequence[str], job_id: str, timeout_s: float) -> list[str]:
    """Ask each daemon in ``paths`` until the committed job is visible there; returns
    why it is not yet on the daemons where it is not (and logs that), [] when it is."""
    if timeout_s <= 0 or not paths:
        return []
    unique = list(dict.fromkeys(paths))
    with ThreadPoolExecutor(max_workers=len(unique)) as pool:
        answers = list(pool.map(lambda p: _ask(p, job_id, timeout_s), unique))
    problems = [why for why in answers if why]
    if problems:
        logs.quiet("spark_writer").warning(
            "spark_commit_not_visible", job_id=job_id, timeout_s=timeout_s,
            reasons=problems, hint="the job is committed and durable: do not run it again; "
            "its rows become readable when the lake catches up (check `quiverd status`)")
    return problems


def _ask(path: str, job_id: str, timeout_s: float) -> str:
    """"" when visible on the daemon at ``path`` (or it has no lake), else why not."""
    try:
        with Client.connect(path, timeout=timeout_s + ANSWER_MARGIN_S) as c:
            seen: JobVisibility = c.wait_visible(job_id, timeout_s)
    except (QuiverError, OSError) as exc:  # ConnectionError, a socket timeout
        return (f"{path}: job {job_id!r} is committed and durable, but whether its rows "
                f"are visible could not be asked: {type(exc).__name__}: {exc}")
    if (seen.visible and seen.iceberg is not False) or not seen.lake:
        return ""
    return f"{path}: {seen.reason}"
