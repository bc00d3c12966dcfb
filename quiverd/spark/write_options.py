"""The writer's options (``df.write.format("quiver")`` and ``writeStream``), checked on
the driver before any task runs: see quiverd/spark/writer.py for what each does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from quiverd.kernel.names import client_name_problem
from quiverd.protocol.frames import MAX_ROW_COUNT
from quiverd.spark.locator import writer_sockets
from quiverd.spark.options import WRITE, lowered, refuse_unknown
from quiverd.spark.visible import VISIBLE_TIMEOUT_S

DEFAULT_CLIENT = "spark"
IF_COMMITTED = ("skip", "verify", "error")
BATCH_ROWS = 64 * 1024
BATCH_BYTES = 8 * 1024 * 1024
# The driver's commit (and abort) retries a daemon away or a catalog down this long
# (option decide_timeout_s): a short outage at commit time delays the write, never
# discards it. At most MAX_DECIDE_TIMEOUT_S.
DECIDE_TIMEOUT_S = 300
MAX_DECIDE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class WriteOptions:
    """The writer's options, checked on the driver."""

    paths: tuple[str, ...]
    client: str = DEFAULT_CLIENT
    batch_rows: int = BATCH_ROWS
    batch_bytes: int = BATCH_BYTES
    # Read your writes: commit() waits up to this long for the catalog to hold the job's
    # rows (quiverd.spark.visible); 0 = do not wait.
    visible_timeout_s: float = VISIBLE_TIMEOUT_S
    # How long commit() and abort() retry a retryable failure (CatalogUnavailable, a
    # daemon restarting) before they fail; seconds.
    decide_timeout_s: int = DECIDE_TIMEOUT_S
    # A batch write with an explicit job_id whose job is committed already (a
    # foreachBatch replay): "skip" sends nothing and commits nothing new, warning when its
    # rows differ from the commit's; "verify" likewise but fails when they differ;
    # "error" fails.
    if_committed: str = "skip"
    # How paths were chosen, for the errors of a socket that is not there.
    origin: str = field(default="", compare=False)
    # Tests only: commit() writes <dir>/ready and waits for <dir>/go, so that a test can
    # kill the daemon between the tasks' writes and the driver's commit.
    commit_gate: str = ""
    # Tests only: (partition, attemptNumber) that fails right after its end marker.
    fail_after_end: tuple[int, int] | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str], where: str = 'df.write.format("quiver")'
              ) -> WriteOptions:
        refuse_unknown(options, WRITE, where)
        opts = lowered(options)
        paths, origin = writer_sockets(opts)
        client = opts.get("client", DEFAULT_CLIENT)
        problem = client_name_problem(client)
        if problem is not None:
            raise ValueError(f'option "client": {problem}')
        if_committed = opts.get("if_committed", "skip").strip().lower()
        if if_committed not in IF_COMMITTED:
            raise ValueError(f'option "if_committed" must be one of {", ".join(IF_COMMITTED)}, '
                             f"not {opts['if_committed']!r}")
        return cls(paths=paths, client=client,
                   batch_rows=_int_option(opts, "batch_rows", BATCH_ROWS, 1, MAX_ROW_COUNT),
                   batch_bytes=_int_option(opts, "batch_bytes", BATCH_BYTES, 1024, 2**40),
                   visible_timeout_s=_visible_timeout(opts),
                   decide_timeout_s=_int_option(opts, "decide_timeout_s", DECIDE_TIMEOUT_S,
                                                0, MAX_DECIDE_TIMEOUT_S),
                   if_committed=if_committed, origin=origin,
                   commit_gate=opts.get("_commit_gate", ""),
                   fail_after_end=_pair(opts.get("_fail_after_end", "")))

    def path_for(self, partition: int) -> str:
        return self.paths[partition % len(self.paths)]


def _pair(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    a, _, b = text.partition(":")
    return int(a), int(b)


def _int_option(opts: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    text = opts.get(name, "")
    try:
        value = int(text) if text else default
    except ValueError:
        raise ValueError(f'option "{name}" must be an integer, not {text!r}') from None
    if not low <= value <= high:
        raise ValueError(f'option "{name}" must be between {low} and {high}, not {value}')
    return value


def _visible_timeout(opts: Mapping[str, str]) -> float:
    text = opts.get("visible_timeout_s", "")
    try:
        value = float(text) if text else VISIBLE_TIMEOUT_S
    except ValueError:
        raise ValueError(f'option "visible_timeout_s" must be a number of seconds, not '
                         f'{text!r}') from None
    if not 0 <= value <= 3600:
        raise ValueError('option "visible_timeout_s" must be between 0 (do not wait) and '
                         f"3600, not {value}")
    return value


def refuse_no_options(options: Mapping[str, str], where: str) -> None:
    """A write with no options at all is what INSERT INTO a table made by CREATE TABLE
    ... USING quiver hands over (Spark 4 keeps no options for a Python data source's
    table): refused, naming the fix, instead of writing client "spark" to the defaults."""
    if not options:
        raise ValueError(f"{where} with no options at all is refused: name the client "
                         '(.option("client", "<name>")) and the daemon (option "socket" '
                         'or "config", else $QUIVERD_SOCKET). An INSERT INTO a table '
                         "made with CREATE TABLE ... USING quiver arrives like this: "
                         "Spark 4 keeps no options for a Python data source's table; "
                         "use CREATE TEMPORARY VIEW ... USING quiver OPTIONS (...)")
