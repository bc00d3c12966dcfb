"""The quiver data source's option names, one set per direction, and the one check that
refuses a name outside them with a did-you-mean (a ``sinse=`` typo must not read all rows).

Spark hands options over case-insensitively: names are compared lowercased. Every option a
reader, writer or stream reader accepts is listed here; a new option is added here first.
Names starting with ``_`` are test hooks.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

# spark.read.format("quiver")
# Spark itself adds "path" for load("<client>") (checked with Spark 4.3: load(x), CREATE
# TEMPORARY VIEW ... OPTIONS add nothing else).
READ = frozenset({
    "path", "socket", "config", "client", "slot", "since", "until", "skip_quarantined",
    "columns", "_trace_dir",
})
# df.write.format("quiver") and writeStream. Spark itself adds "path" (save(x),
# writeStream.start(x)) and "checkpointlocation" (writeStream, toTable); foreachBatch,
# saveAsTable, writeTo and INSERT INTO add nothing (checked with Spark 4.3).
WRITE = frozenset({
    "path", "paths", "socket", "config", "client", "batch_rows", "batch_bytes", "job_id",
    "if_committed", "visible_timeout_s", "decide_timeout_s", "query_id",
    "checkpointlocation", "_commit_gate", "_fail_after_end",
})
# spark.readStream.format("quiver")
STREAM_READ = frozenset({
    "path", "socket", "config", "client", "slot", "subscriber", "maxbundlespertrigger", "from",
    "failondataloss",
})


def lowered(options: Mapping[str, object]) -> dict[str, str]:
    """The options with lowercased names and string values."""
    return {str(k).lower(): str(v) for k, v in options.items()}


def refuse_unknown(options: Mapping[str, object], known: Iterable[str], where: str) -> None:
    """Raise ValueError naming the first unknown option and its closest known name."""
    names = sorted(set(known))
    for name in sorted(lowered(options)):
        if name in names:
            continue
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        guess = f'; did you mean "{close[0]}"?' if close else ""
        public = ", ".join(n for n in names if not n.startswith("_"))
        raise ValueError(f'unknown option "{name}" for {where}{guess} (known: {public})')
