"""``spark.read.format("quiver")``: the registered lake files of one (client, slot).

    df = (spark.read.format("quiver")
          .option("socket", "/var/lib/quiverd/ingest.sock")  # the daemon: its socket,
          # or .option("config", "/etc/quiverd/config.toml")   or its config (see below)
          .option("client", "web")                       # required; or .load("web")
          .option("slot", 0)                             # default 0
          .option("since", "2025-06-01T00:00:00Z")       # ISO-8601 (UTC if naive) or ns
          .option("until", "2025-06-02T00:00:00Z")       # rows with since <= time < until
          .option("skip_quarantined", "true")            # default false: fail on them
          .option("columns", "status,path")              # only these (default: all)
          .load())

The daemon is named as for the writer (quiverd/spark/locator.py): option ``socket`` (the
reader asks the daemon there where its catalog and store are, secrets withheld) or
``config`` (read as the daemon reads it); neither: $QUIVERD_SOCKET, the default socket,
the default config. ``load("web")`` is ``option("client", "web")`` (Spark passes it as
option ``path``). An option not listed in quiverd/spark/options.py is refused, naming
the closest known one.

Spark runs each step below in its own Python process; nothing crosses between them but
what is pickled (the DataSource's options, the reader, each partition):

    driver   QuiverDataSource.schema()   catalog: registered files of (client, slot) that
                                         overlap [since, until); one Parquet footer per
                                         distinct schema_hash, read with OpenDAL ranged
                                         reads (pyarrow seeks to the tail: no whole object)
                                         → drift.unify → Spark's types
    driver   QuiverReader.pushFilters()  notes the filters files can be pruned with
             QuiverReader.partitions()   catalog again (+ zone maps): one FilePartition
                                         per file left, carrying its key and the store's
                                         OpenDAL options as plain strings
    executor QuiverReader.read(p)        OpenDAL (fs, s3, ...: no Hadoop jars) → pyarrow:
                                         the footer, then only the row groups whose
                                         statistics may match, only the columns asked,
                                         64 Ki rows per batch → safe casts → Arrow as
                                         Spark expects it (to_arrow_schema(schema, "UTC"))

One schema per read. The files of a (client, slot) may differ (drift, SPEC §6): the
schema is drift.unify over their footers (a new column is null in older files; int32
and int64 read as int64; ints and floats as double, each value exactly or not at all;
string and large_string as string). Values are cast safely: one the cast would change
(an int past 2**53 as a double) fails the read naming the file. Where two files hold a
column as types no one type holds (string, then int), the error names both files and
gives the ``.schema("...")`` that reads the column as STRING; with ``.schema(...)``
Spark skips schema() and every file is cast to the given types.

An empty selection (an ``until`` before any file, an unused slot, only quarantined files
with ``skip_quarantined``) is an empty DataFrame, never an error: a scheduled "last hour"
query must run in a quiet hour. Its schema is the footer of the (client, slot)'s latest
registered file (one catalog query, one footer); else the established schema of
``lake.schema_mode = "strict"`` (when the reader sees the daemon's data_dir); else the
footer of its newest quarantined file (under ``quarantine/``); each plus quiverd's
columns, or quiverd's columns only (``_quiver_ingested_at``, ...). Another slot's files
are not used: a slot is another table. A client the catalog has no file of at all (any
slot or state) is refused naming the closest known one (``UnknownClient``): a typo, not
a quiet hour; a name no writer could use (``load("some/path")``) is refused at once.

Columns. Spark 4's Python data sources cannot prune columns yet, so option ``columns``
("a,b") does it: schema() returns only those (an unknown name fails listing the
client's columns), read() reads only those, plus the time column when since/until
needs it (dropped before Spark sees the batch).

Types as Spark sees them: dictionaries as their values, large strings/binaries as plain
ones, uint8/16/32 as the next wider signed int, uint64 as decimal(20, 0), timestamps with
a zone as TimestampType in UTC, without one as TimestampNTZType; Spark keeps microseconds,
so nanoseconds are truncated (toward zero, as Arrow casts). quiverd's own columns read
as today's lake types (``_quiver_ingested_at`` timestamp, ``_quiver_shard`` int,
``_quiver_segment`` and ``_quiver_bundle`` bigint) in files from before issue 20 too
(legacy ns and unsigned ids: ``bundles.as_current`` names them, the safe cast converts).

Pruning. Spark re-applies every filter (none is claimed: a file that may match still
holds rows that do not), so pruning only decides which files are opened. Comparisons
(=, <, <=, >, >=, IN) of a top-level column with a literal prune

    on the time column (lake.time_column, default _quiver_ingested_at): the catalog's
        start_ts/end_ts of every registered file, indexed or not
    on other columns: the file's zone maps (min/max), where the indexer recorded them;
        a file without a zone map for the column is kept

Inside each file opened, the same comparisons (and since/until) are checked against
every row group's footer statistics (min/max per column, which Parquet writes for every
column: the time column and the zone-map columns alike): only row groups that may hold a
passing row are read (``pruning.row_groups``).

A timestamp literal v stands for the data values Spark reads as v: [v, v + 999] ns
(truncation toward zero; [v - 999, v] below the epoch), so a file is opened exactly when
one of its rows may pass. Strings compare by code point (= Parquet's UTF-8 byte order);
decimals, times and nested columns are not pruned.

Integrity. Pages are read with their checksums verified and each partition stats its
object first, so damage is an error, never values: LakeFileCorrupt (a page checksum,
undecodable Parquet, a size other than the catalog's) or LakeFileMissing (the store has
no object), each naming the file id and URI with what to do, hint included in the
message (Spark shows only that). Files the lake scrub quarantined fail the read at
planning, naming them, unless ``skip_quarantined`` is true: never a silently smaller
DataFrame. The whole-object CRC-32C is not checked here (pyarrow reads ranges, not the
whole object); the lake scrub and ``quiverd fsck --lake`` check it.

Test hook: option ``_trace_dir`` names a directory where ``read`` appends the key of
every object it opens to ``opened.log`` (one line each, O_APPEND), and "<key> <index>" of
every row group it reads to ``row_groups.log``, so a test can assert what a query read.

SQL: ``CREATE TEMPORARY VIEW v USING quiver OPTIONS (...)`` passes its options on every
read. ``CREATE TABLE t USING quiver OPTIONS (...)`` passes them only to the schema() of
the CREATE (as ``option.<name>`` too, with Spark's ``owner``/``provider``): schema()
keeps them in the table's schema (options.TABLE_OPTIONS_KEY) and reader() takes them
back from the stored schema Spark hands it, since a table's reads get no options.

Filter pushdown needs ``spark.sql.python.filterPushdown.enabled=true``: Spark refuses a
reader with ``pushFilters`` otherwise (``quiverd.spark.register`` sets it).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import opendal
import pyarrow as pa
import pyarrow.compute as pc

try:
    from pyspark.sql import types as st
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
    from pyspark.sql.pandas.types import to_arrow_schema
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("quiverd.spark needs pyspark 4: pip install 'quiverd[spark]'") from exc

from quiverd.kernel import logs
from quiverd.kernel.config import Config
from quiverd.kernel.errors import LakeError, LakeFileCorrupt
from quiverd.kernel.layout import DataDir
from quiverd.kernel.logs import Logger
from quiverd.kernel.names import client_name_problem
from quiverd.lake.bundles import as_current, with_extras
from quiverd.lake.catalog import open_catalog
from quiverd.lake.drift import unify
from quiverd.lake.model import INGESTED_AT, REGISTERED, FileRow, FileState, ZoneMap
from quiverd.lake.schema_record import established_record
from quiverd.lake.scrub import QUARANTINE_PREFIX
from quiverd.lake.store import opendal_options
from quiverd.lake.verified import open_verified
from quiverd.spark.locator import Locator, resolve
from quiverd.spark.objects import (
    FilePartition,
    missing_error,
    open_object,
    quarantined_error,
    verified_file,
    with_hint,
)
from quiverd.spark.options import (
    READ,
    STREAM_READ,
    TABLE_OPTIONS_KEY,
    lowered,
    read_or_stream,
    refuse_unknown,
    table_options,
)
from quiverd.spark.pruning import Bound, datetime_ns, may_match, row_groups, to_bound
from quiverd.spark.types import (  # to_spark: re-exported, tests import it from here
    as_ns,
    as_target,
    drift_error,
    filter_types,
    spark_schema,
    to_spark,  # noqa: F401
)
from quiverd.spark.write_options import refuse_no_options
from quiverd.spark.writer import QuiverStreamWriter, QuiverWriter, refuse_reserved_columns

NAME = "quiver"
BATCH_ROWS = 64 * 1024  # rows per RecordBatch handed to Spark
MAX_FILES = 100_000  # files one read may plan; more: narrow it with since/until
TRACE_FILE = "opened.log"
TRACE_ROW_GROUPS = "row_groups.log"  # "<key> <row group index>" per row group read
QUARANTINED_SHOWN = 100  # quarantined files one read's error looks up
QUARANTINED_SCHEMAS = 3  # quarantined files whose footers an empty read tries for columns
CLIENTS_SAMPLED = 10_000  # newest catalog rows whose clients an unknown client's error names
KNOWN_SHOWN = 20



class QuiverDataSource(DataSource):
    """The lake's files of one (client, slot) as a DataFrame (see the module doc)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> st.StructType:
        table = table_options(self.options)  # CREATE TABLE ... USING quiver OPTIONS (...)
        options = self.options if table is None else table
        # readStream without .schema(...) asks here too, with the stream's options.
        known = read_or_stream(options)
        if known is STREAM_READ and not ({"client", "path"} & set(lowered(options))):
            raise ValueError('spark.readStream.format("quiver") of every client has no one '
                             'schema: pass .schema(...) or name the client with option '
                             '"client" (its lake schema is used)')
        sel = Selection.parse(options, known=known)
        lake = Lake.open(sel.locator)
        rows, _ = lake.query(sel, zone_maps=False)
        # An empty selection is an empty DataFrame, with the (client, slot)'s schema.
        schema = lake.representative_schema(rows) if rows else lake.empty_schema(sel)
        spark = spark_schema(sel.project(schema))
        return spark if table is None else _keep_options(spark, table)

    def reader(self, schema: st.StructType) -> QuiverReader:
        options = self.options or _kept_options(schema)
        if not options:
            raise ValueError('spark.read.format("quiver") got no options at all: a table '
                             "made with CREATE TABLE ... USING quiver and a column list "
                             "arrives like this (Spark keeps its OPTIONS only in its "
                             "catalog); create it without the column list (the lake gives "
                             "the columns), or use CREATE TEMPORARY VIEW ... USING quiver "
                             "OPTIONS (...)")
        return QuiverReader(Selection.parse(options), schema)

    def writer(self, schema: st.StructType, overwrite: bool) -> QuiverWriter:
        """``df.write.format("quiver")``: see quiverd/spark/writer.py."""
        refuse_no_options(self.options, 'df.write.format("quiver")')
        refuse_reserved_columns(schema)
        return QuiverWriter(self.options, overwrite)

    def streamWriter(self, schema: st.StructType,  # noqa: N802 - Spark's name
                     overwrite: bool) -> QuiverStreamWriter:
        refuse_reserved_columns(schema)
        return QuiverStreamWriter(self.options, overwrite)

    def streamReader(self, schema: st.StructType) -> Any:  # noqa: N802 - Spark's name
        """``spark.readStream.format("quiver")``: a QuiverStreamReader, see
        quiverd/spark/stream.py."""
        from quiverd.spark.stream import QuiverStreamReader, StreamOptions

        return QuiverStreamReader(StreamOptions.parse(self.options), schema)


def _keep_options(schema: st.StructType, options: dict[str, str]) -> st.StructType:
    """The schema with the table's options in its first field's metadata (Spark's
    catalog keeps it; see options.TABLE_OPTIONS_KEY)."""
    first, *rest = schema.fields
    meta = {**(first.metadata or {}), TABLE_OPTIONS_KEY: json.dumps(options, sort_keys=True)}
    return st.StructType([st.StructField(first.name, first.dataType, first.nullable, meta),
                          *rest])


def _kept_options(schema: st.StructType) -> dict[str, str]:
    """The options a CREATE TABLE's schema carries ({} if none)."""
    if not schema.fields:
        return {}
    text = (schema.fields[0].metadata or {}).get(TABLE_OPTIONS_KEY)
    return dict(json.loads(text)) if isinstance(text, str) else {}


class QuiverReader(DataSourceReader):
    def __init__(self, sel: Selection, schema: st.StructType) -> None:
        self.sel = sel
        self.schema = schema
        self.bounds: list[Bound] = []
        # Read here, not in partitions(): Spark pickles the reader for the executors
        # before it calls partitions(), so only what __init__ and pushFilters set is there.
        self.time_column = Lake.open(sel.locator).time_column

    def pushFilters(self, filters: Sequence[Any]) -> list[Any]:  # noqa: N802 - Spark's name
        """Keep what can prune files; return every filter, so Spark applies them all."""
        types = filter_types(self.schema)  # each column's type as Spark reads it
        for f in filters:
            if (bound := to_bound(f, types)) is not None:
                self.bounds.append(bound)
        return list(filters)

    def partitions(self) -> list[FilePartition]:
        lake = Lake.open(self.sel.locator)
        rows, maps = lake.query(self.sel, zone_maps=bool(self.bounds))
        if not rows:
            lake.refuse_unknown_client(self.sel)  # with .schema(...), schema() never asked
        kept = [r for r in rows if may_match(r, maps.get(r.file_id, []), self.bounds,
                                             lake.time_column)]
        return [lake.partition(r) for r in kept]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, FilePartition):
            # No file to read: Spark asks for one partition of nothing (InputPartition(None)).
            assert getattr(partition, "value", None) is None, partition
            return
        if self.sel.trace_dir:
            _trace(Path(self.sel.trace_dir), partition.key)
        target = to_arrow_schema(self.schema, timezone="UTC")
        p = partition
        with verified_file(p) as pf:
            names = set(pf.schema_arrow.names)
            columns = [n for n in target.names if n in names]
            ranged = self.sel.since_ns is not None or self.sel.until_ns is not None
            if ranged and self.time_column not in columns and self.time_column in names:
                columns.append(self.time_column)  # for the range only: to_spark drops it
            groups = row_groups(pf.metadata, pf.schema_arrow, self.bounds, self.time_column,
                                self.sel.since_ns, self.sel.until_ns)
            if self.sel.trace_dir:
                _trace(Path(self.sel.trace_dir), *(f"{p.key} {g}" for g in groups),
                       name=TRACE_ROW_GROUPS)
            if not groups:
                return
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=groups,
                                         columns=columns):
                if ranged:
                    batch = batch.filter(self._in_range(batch))
                if batch.num_rows:
                    yield from as_target(batch, target, p.file_id, p.uri or p.key).to_batches()

    def _in_range(self, batch: pa.RecordBatch) -> pa.Array:
        """Rows with since <= time < until (the time column in ns, as the catalog has it);
        a row without a time is outside every range."""
        if self.time_column not in batch.schema.names:
            return pa.repeat(pa.scalar(False), batch.num_rows)
        ns = as_ns(batch.column(self.time_column))
        since, until = self.sel.since_ns, self.sel.until_ns
        after = pc.greater_equal(ns, since) if since is not None else None
        before = pc.less(ns, until) if until is not None else None
        mask = pc.and_(after, before) if after is not None and before is not None \
            else after if after is not None else before
        return pc.fill_null(mask, False)


# ---- options, catalog and store ---------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """The reader's options, checked."""

    locator: Locator  # which daemon: resolved by Lake.open, on the driver
    client: str
    slot: int = 0
    since_ns: int | None = None
    until_ns: int | None = None
    trace_dir: str = ""
    skip_quarantined: bool = False
    columns: tuple[str, ...] = ()  # option "columns": only these; () = all

    @classmethod
    def parse(cls, options: Mapping[str, str], known: frozenset[str] = READ) -> Selection:
        """``known``: the option names allowed (STREAM_READ when a stream's schema() asks)."""
        refuse_unknown(options, known, 'spark.read.format("quiver")' if known is READ
                       else 'spark.readStream.format("quiver")')
        opts = lowered(options)
        client, path = opts.get("client", ""), opts.get("path", "")
        if client and path and client != path:
            raise ValueError(f'load("{path}") names client {path!r}, option "client" '
                             f"{client!r}: give one of them")
        client = client or path
        if not client:
            raise ValueError('option "client" is required: spark.read.format("quiver")'
                             '.option("client", "<name>"), or .load("<name>")')
        if (problem := client_name_problem(client)) is not None:
            # No writer could have used it (BUNDLE refuses it): a path or a typo, never
            # a client whose rows are just not there.
            where = "option \"client\"" if opts.get("client") else f'load("{client}")'
            raise ValueError(f"{where}: {problem}; load() takes a client name, not a path")
        try:
            slot = int(opts.get("slot", "0"))
        except ValueError:
            raise ValueError(f'option "slot" must be an integer, not {opts["slot"]!r}') from None
        since, until = _ns_option(opts, "since"), _ns_option(opts, "until")
        if since is not None and until is not None and until <= since:
            raise ValueError(f'option "until" ({opts["until"]}) must be after "since" '
                             f'({opts["since"]})')
        skip = opts.get("skip_quarantined", "false").strip().lower()
        if skip not in ("true", "false"):
            raise ValueError(f'option "skip_quarantined" must be true or false, not {skip!r}')
        return cls(locator=Locator.parse(opts), client=client, slot=slot,
                   since_ns=since, until_ns=until, trace_dir=opts.get("_trace_dir", ""),
                   skip_quarantined=skip == "true", columns=_columns_option(opts))

    def project(self, schema: pa.Schema) -> pa.Schema:
        """``schema`` reduced to option "columns" (in its order); an unknown name fails,
        listing the columns there are."""
        if not self.columns:
            return schema
        unknown = [c for c in self.columns if c not in schema.names]
        if unknown:
            raise ValueError(f'option "columns": {", ".join(map(repr, unknown))} '
                             f"{'is' if len(unknown) == 1 else 'are'} not a column of client "
                             f"{self.client!r} slot {self.slot}; its columns: "
                             f"{', '.join(schema.names)}")
        return pa.schema([schema.field(c) for c in self.columns])

    def range_text(self) -> str:
        if self.since_ns is None and self.until_ns is None:
            return ""
        return f" in [{self.since_ns}, {self.until_ns}) ns"


@dataclass
class Lake:
    """A quiverd config's catalog and store, opened for reading (driver side)."""

    cfg: Config
    time_column: str
    store_options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open(cls, where: Locator | str) -> Lake:
        """The lake of the daemon ``where`` names (a Locator, or a config file's path):
        read from the config, or asked of the daemon over its socket."""
        cfg = resolve(where if isinstance(where, Locator) else Locator(config=where)).cfg
        return cls(cfg=cfg, time_column=cfg.lake.time_column or INGESTED_AT,
                   store_options=opendal_options(cfg.lake.store, data_dir=Path(cfg.data_dir)))

    def query(self, sel: Selection, *, zone_maps: bool, latest: bool = False,
              states: Collection[FileState] = REGISTERED
              ) -> tuple[list[FileRow], dict[str, list[ZoneMap]]]:
        """Registered files of the selection, ordered by (start_ts, file_id); zone maps.
        ``latest``: only the newest few files in ``states``, quarantined ones not checked."""
        db = DataDir(Path(self.cfg.data_dir)).catalog_db
        if not self.cfg.catalog.dsn and not db.exists():
            raise FileNotFoundError(f"no lake catalog at {db}, the data_dir that "
                                    f"{sel.locator} names: is it the daemon's?")

        async def ask() -> tuple[list[FileRow], list[FileRow], dict[str, list[ZoneMap]]]:
            async with open_catalog(self.cfg.catalog, db, log=_quiet_log()) as catalog:
                if latest:
                    return await catalog.list_files(
                        client=sel.client, slot=sel.slot, states=list(states),
                        limit=1 if states is REGISTERED else QUARANTINED_SCHEMAS,
                        newest_first=True), [], {}
                rows = await catalog.list_files(
                    client=sel.client, slot=sel.slot, since_ns=sel.since_ns,
                    until_ns=sel.until_ns, states=REGISTERED, limit=MAX_FILES + 1)
                bad = [] if sel.skip_quarantined else await catalog.list_files(
                    client=sel.client, slot=sel.slot, since_ns=sel.since_ns,
                    until_ns=sel.until_ns, states=[FileState.QUARANTINED], limit=QUARANTINED_SHOWN)
                maps = await catalog.zone_maps([r.file_id for r in rows]) if zone_maps else {}
                return rows, bad, maps

        rows, quarantined, maps = anyio.run(ask)
        if quarantined:
            raise quarantined_error(f"client {sel.client!r} slot {sel.slot}{sel.range_text()}",
                                    quarantined)
        if len(rows) > MAX_FILES:
            raise ValueError(f"more than {MAX_FILES} lake files match: narrow the read "
                             'with the "since" and "until" options')
        return rows, maps

    def partition(self, row: FileRow) -> FilePartition:
        store = self.cfg.lake.store
        return FilePartition(key=row.object_key, scheme=store.scheme,
                             store_options=self.store_options, timeout_ms=store.timeout_ms,
                             max_attempts=store.max_attempts, file_id=row.file_id, uri=row.uri,
                             size=row.compressed_size)

    def representative_schema(self, rows: list[FileRow]) -> pa.Schema:
        """drift.unify over the footers of ``rows``, one per distinct schema_hash; where
        two files hold a column as types no one type holds without loss, a ValueError
        names both files and the ``.schema(...)`` that reads them as one."""
        firsts: dict[str, FileRow] = {}
        for row in rows:
            firsts.setdefault(row.schema_hash or row.file_id, row)
        schema: pa.Schema | None = None
        seen: list[tuple[FileRow, pa.Schema]] = []
        for row in firsts.values():
            found = self.footer_schema(row)
            merged = unify(schema, found)
            if merged is None:
                assert schema is not None, "unify(None, s) always succeeds"
                raise ValueError(drift_error(schema, found, (row.file_id, row.uri),
                                             [((r.file_id, r.uri), f) for r, f in seen]))
            seen.append((row, found))
            schema = merged
        assert schema is not None, "rows is not empty"
        return schema

    def footer_schema(self, row: FileRow, key: str | None = None) -> pa.Schema:
        """The Arrow schema of one file's footer (ranged reads at the object's tail),
        quiverd's columns of a file from before issue 20 named with today's types.
        ``key``: the object's key if not the row's (its quarantine copy)."""
        part = self.partition(row)
        if key is not None:
            part = replace(part, key=key)
        source = open_object(part)
        try:
            return as_current(open_verified(source, file_id=row.file_id,
                                            uri=row.uri).schema_arrow)
        except opendal.exceptions.NotFound:
            raise missing_error(part) from None
        except LakeFileCorrupt as exc:
            raise with_hint(exc) from None
        finally:
            source.close()

    def empty_schema(self, sel: Selection) -> pa.Schema:
        """The schema of a selection without files: the footer of the (client, slot)'s
        latest registered file (outside the since/until range); else, in strict schema
        mode, its established schema; else only the columns quiverd adds to every row.
        Another slot's files are not used: a slot is another table."""
        every = replace(sel, since_ns=None, until_ns=None)
        latest, _ = self.query(every, zone_maps=False, latest=True)
        if latest:
            return self.footer_schema(latest[0])
        record = established_record(Path(self.cfg.data_dir), (sel.client, sel.slot))
        if record is not None:
            return with_extras(record)
        self.refuse_unknown_client(sel)
        # Only quarantined files (skip_quarantined): their rows are not read, but their
        # columns are still the client's, so a query naming them gets no rows, not an
        # unknown column. The scrub keeps each object under quarantine/ (lake.scrub):
        # its data pages failed a check, its footer usually reads.
        quarantined, _ = self.query(every, zone_maps=False, latest=True,
                                    states=[FileState.QUARANTINED])
        for row in quarantined:
            for key in (QUARANTINE_PREFIX + row.object_key, row.object_key):
                try:
                    return self.footer_schema(row, key=key)
                except (LakeError, OSError, pa.ArrowInvalid):
                    continue  # that copy is gone or its footer is damaged too
        return with_extras(pa.schema([]))


    def refuse_unknown_client(self, sel: Selection) -> None:
        """A client with no file in the catalog at all (any slot, any state) is refused,
        naming the closest known client: a typo must not read as a quiet hour. (A client
        with files, none in the range or slot asked, is an empty DataFrame.)"""
        db = DataDir(Path(self.cfg.data_dir)).catalog_db

        async def ask() -> tuple[list[FileRow], list[FileRow]]:
            async with open_catalog(self.cfg.catalog, db, log=_quiet_log()) as catalog:
                mine = await catalog.list_files(client=sel.client, limit=1)
                if mine:
                    return mine, []
                return [], await catalog.list_files(limit=CLIENTS_SAMPLED, newest_first=True)

        mine, sample = anyio.run(ask)
        if not mine:
            raise UnknownClient(sel.client, sorted({r.client_name for r in sample}))


class UnknownClient(ValueError):
    """No lake file of the client ever (a typo, or a client not uploaded yet)."""

    def __init__(self, client: str, known: list[str]) -> None:
        close = difflib.get_close_matches(client, known, n=1, cutoff=0.6)
        guess = f'; did you mean "{close[0]}"?' if close else ""
        shown = ", ".join(repr(k) for k in known[:KNOWN_SHOWN]) or "none yet"
        more = f" and {len(known) - KNOWN_SHOWN} more" if len(known) > KNOWN_SHOWN else ""
        super().__init__(
            f"the lake has no file of client {client!r}{guess} (clients in the lake: "
            f"{shown}{more}). A client is in the catalog from the first of its bundles the "
            "uploader takes (a Received file, seconds after ingest): check the name, or "
            "that the daemon's [lake] is enabled and has received the client's rows")


# ---- types: the lake's Arrow as Spark's ---------------------------------------------------

def _ns_option(opts: Mapping[str, str], name: str) -> int | None:
    text = opts.get(name, "").strip()
    if not text:
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return datetime_ns(datetime.fromisoformat(text))
    except ValueError:
        raise ValueError(f'option "{name}": {text!r} is neither ISO-8601 nor ns since the '
                         "epoch") from None


def _columns_option(opts: Mapping[str, str]) -> tuple[str, ...]:
    names = [n.strip() for n in opts.get("columns", "").split(",")]
    if any(not n for n in names) and opts.get("columns", "").strip():
        raise ValueError(f'option "columns" must be column names separated by commas, not '
                         f"{opts['columns']!r}")
    return tuple(dict.fromkeys(n for n in names if n))


def _trace(directory: Path, *lines: str, name: str = TRACE_FILE) -> None:
    """Append ``lines`` to a trace file; one short O_APPEND write is never interleaved."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
    finally:
        os.close(fd)


def _quiet_log() -> Logger:
    return logs.quiet("spark_reader")
