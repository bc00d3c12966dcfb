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


STREAM_ONLY = STREAM_READ - READ


def read_or_stream(options: Mapping[str, object]) -> frozenset[str]:
    """Which option set ``options`` are for, where Spark does not say (``schema()`` is
    asked by spark.read and by readStream without ``.schema(...)`` alike): the stream's
    when they name a stream-only option, or a typo of one ("subscribr"), so that the
    error lists the stream's options with its did-you-mean."""
    names = lowered(options)
    if any(n in STREAM_ONLY for n in names):
        return STREAM_READ
    for name in names:
        if name not in READ and difflib.get_close_matches(name, sorted(STREAM_ONLY), n=1,
                                                          cutoff=0.6) \
                and not difflib.get_close_matches(name, sorted(READ), n=1, cutoff=0.6):
            return STREAM_READ
    return READ


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


# CREATE TABLE ... USING quiver OPTIONS (k 'v'): Spark 4.3 calls schema() once, at CREATE
# TABLE, with each option twice ("k" and "option.k") plus "owner", "provider" (and, with
# LOCATION, "location" and "path"), and later reads of the table with no options at all
# (checked with Spark 4.3: reader() gets an empty options dict and the stored schema).
# The table's schema is kept by Spark's catalog with its field metadata, so the options
# travel there: schema() puts them under TABLE_OPTIONS_KEY on the first field, reader()
# takes them back (quiverd/spark/reader.py).
TABLE_OPTIONS_KEY = "quiver.table_options"
_TABLE_ONLY = frozenset({"owner", "provider", "location"})


def table_options(options: Mapping[str, object]) -> dict[str, str] | None:
    """The user's OPTIONS of a CREATE TABLE (``option.`` prefix stripped, Spark's own
    keys dropped), or None when ``options`` are not a CREATE TABLE's."""
    opts = lowered(options)
    if not any(k.startswith("option.") for k in opts):
        return None
    out = {k.removeprefix("option."): v for k, v in opts.items() if k not in _TABLE_ONLY}
    if "location" in opts and out.get("path") == opts["location"]:
        del out["path"]  # LOCATION's copy, not a client named by load()
    return out
