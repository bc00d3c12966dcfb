"""``spark.read.format("quiver")``: the registered lake files of one (client, slot).

    df = (spark.read.format("quiver")
          .option("config", "/etc/quiverd/config.toml")  # whose catalog and store (default)
          .option("client", "web")                       # required
          .option("slot", 0)                             # default 0
          .option("since", "2025-06-01T00:00:00Z")       # ISO-8601 (UTC if naive) or ns
          .option("until", "2025-06-02T00:00:00Z")       # rows with since <= time < until
          .option("skip_quarantined", "true")            # default false: fail on them
          .load())

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
    executor QuiverReader.read(p)        OpenDAL (fs, s3, ...: no Hadoop jars) → pyarrow,
                                         64 Ki rows per batch → drift.conform → Arrow as
                                         Spark expects it (to_arrow_schema(schema, "UTC"))

Types as Spark sees them: dictionaries as their values, large strings/binaries as plain
ones, uint8/16/32 as the next wider signed int, uint64 as decimal(20, 0), timestamps with
a zone as TimestampType in UTC, without one as TimestampNTZType; Spark keeps microseconds,
so nanoseconds are truncated (toward zero, as Arrow casts).

Pruning. Spark re-applies every filter (none is claimed: a file that may match still
holds rows that do not), so pruning only decides which files are opened. Comparisons
(=, <, <=, >, >=, IN) of a top-level column with a literal prune

    on the time column (lake.time_column, default _quiver_ingested_at): the catalog's
        start_ts/end_ts of every registered file, indexed or not
    on other columns: the file's zone maps (min/max), where the indexer recorded them;
        a file without a zone map for the column is kept

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
every object it opens to ``opened.log`` (one line each, O_APPEND), so a test can assert
which files a query opened.

Filter pushdown needs ``spark.sql.python.filterPushdown.enabled=true``: Spark refuses a
reader with ``pushFilters`` otherwise (``quiverd.spark.register`` sets it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
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
from quiverd.kernel.config import Config, load
from quiverd.kernel.errors import LakeFileCorrupt
from quiverd.kernel.layout import DataDir
from quiverd.kernel.logs import Logger
from quiverd.lake.catalog import open_catalog
from quiverd.lake.drift import unify
from quiverd.lake.model import INGESTED_AT, REGISTERED, FileRow, FileState, ZoneMap
from quiverd.lake.store_options import service_options
from quiverd.lake.verified import corrupt_error, is_damage, open_verified
from quiverd.spark.objects import (
    FilePartition,
    missing_error,
    open_object,
    open_reads,
    quarantined_error,
    with_hint,
)
from quiverd.spark.pruning import Bound, datetime_ns, may_match, to_bound
from quiverd.spark.types import as_ns, spark_schema, to_spark
from quiverd.spark.writer import QuiverStreamWriter, QuiverWriter, refuse_reserved_columns

NAME = "quiver"
DEFAULT_CONFIG = "/etc/quiverd/config.toml"
BATCH_ROWS = 64 * 1024  # rows per RecordBatch handed to Spark
MAX_FILES = 100_000  # files one read may plan; more: narrow it with since/until
TRACE_FILE = "opened.log"
QUARANTINED_SHOWN = 100  # quarantined files one read's error looks up



class QuiverDataSource(DataSource):
    """The lake's files of one (client, slot) as a DataFrame (see the module doc)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> st.StructType:
        sel = Selection.parse(self.options)
        lake = Lake.open(sel.config_path)
        rows, _ = lake.query(sel, zone_maps=False)
        if not rows:
            raise ValueError(f"no registered lake file for client {sel.client!r} slot "
                             f"{sel.slot}{sel.range_text()} in the catalog of "
                             f"{sel.config_path}: nothing to take a schema from (pass one "
                             "with .schema(...) to read an empty DataFrame)")
        return spark_schema(lake.representative_schema(rows))

    def reader(self, schema: st.StructType) -> QuiverReader:
        return QuiverReader(Selection.parse(self.options), schema)

    def writer(self, schema: st.StructType, overwrite: bool) -> QuiverWriter:
        """``df.write.format("quiver")``: see quiverd/spark/writer.py."""
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


class QuiverReader(DataSourceReader):
    def __init__(self, sel: Selection, schema: st.StructType) -> None:
        self.sel = sel
        self.schema = schema
        self.bounds: list[Bound] = []
        # Read here, not in partitions(): Spark pickles the reader for the executors
        # before it calls partitions(), so only what __init__ and pushFilters set is there.
        self.time_column = load(sel.config_path).lake.time_column or INGESTED_AT

    def pushFilters(self, filters: Sequence[Any]) -> list[Any]:  # noqa: N802 - Spark's name
        """Keep what can prune files; return every filter, so Spark applies them all."""
        for f in filters:
            if (bound := to_bound(f, self.schema)) is not None:
                self.bounds.append(bound)
        return list(filters)

    def partitions(self) -> list[FilePartition]:
        lake = Lake.open(self.sel.config_path)
        rows, maps = lake.query(self.sel, zone_maps=bool(self.bounds))
        kept = [r for r in rows if may_match(r, maps.get(r.file_id, []), self.bounds,
                                             lake.time_column)]
        return [lake.partition(r) for r in kept]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, FilePartition), partition
        if self.sel.trace_dir:
            _trace(Path(self.sel.trace_dir), partition.key)
        target = to_arrow_schema(self.schema, timezone="UTC")
        p = partition
        reads = open_reads(p)
        source = pa.PythonFile(reads, mode="r")
        try:
            # Page checksums verified: a damaged page fails the read, never wrong values.
            pf = open_verified(source, file_id=p.file_id, uri=p.uri or p.key)
            names = set(pf.schema_arrow.names)
            columns = [n for n in target.names if n in names]
            ranged = self.sel.since_ns is not None or self.sel.until_ns is not None
            if ranged and self.time_column not in columns and self.time_column in names:
                columns.append(self.time_column)
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                if ranged:
                    batch = batch.filter(self._in_range(batch))
                if batch.num_rows:
                    yield from to_spark(batch, target).to_batches()
        except opendal.exceptions.NotFound:
            raise missing_error(p) from None
        except LakeFileCorrupt as exc:  # the footer: open_verified's own error
            raise with_hint(exc) from None
        except (OSError, pa.ArrowInvalid) as exc:
            if reads.gone:
                raise missing_error(p) from None
            if not is_damage(exc):
                raise
            raise with_hint(corrupt_error(exc, file_id=p.file_id, uri=p.uri or p.key)
                            ) from None
        finally:
            source.close()

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

    config_path: str
    client: str
    slot: int = 0
    since_ns: int | None = None
    until_ns: int | None = None
    trace_dir: str = ""
    skip_quarantined: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Selection:
        opts = {k.lower(): str(v) for k, v in options.items()}
        client = opts.get("client", "")
        if not client:
            raise ValueError('option "client" is required: '
                             'spark.read.format("quiver").option("client", "<name>")')
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
        return cls(config_path=opts.get("config", DEFAULT_CONFIG), client=client, slot=slot,
                   since_ns=since, until_ns=until, trace_dir=opts.get("_trace_dir", ""),
                   skip_quarantined=skip == "true")

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
    def open(cls, config_path: str) -> Lake:
        cfg = load(config_path)
        store = cfg.lake.store
        root = store.root
        if store.scheme == "fs":
            root = str(Path(root or DataDir(Path(cfg.data_dir)).objects).absolute())
        return cls(cfg=cfg, time_column=cfg.lake.time_column or INGESTED_AT,
                   store_options=service_options(store, root))

    def query(self, sel: Selection, *, zone_maps: bool
              ) -> tuple[list[FileRow], dict[str, list[ZoneMap]]]:
        """Registered files of the selection, ordered by (start_ts, file_id); zone maps."""
        db = DataDir(Path(self.cfg.data_dir)).catalog_db
        if not self.cfg.catalog.dsn and not db.exists():
            raise FileNotFoundError(f"no lake catalog at {db}: is data_dir in "
                                    f"{sel.config_path} the daemon's?")

        async def ask() -> tuple[list[FileRow], list[FileRow], dict[str, list[ZoneMap]]]:
            async with open_catalog(self.cfg.catalog, db, log=_quiet_log()) as catalog:
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
        """drift.unify over the footers of ``rows``, one per distinct schema_hash."""
        firsts: dict[str, FileRow] = {}
        for row in rows:
            firsts.setdefault(row.schema_hash or row.file_id, row)
        schema: pa.Schema | None = None
        for row in firsts.values():
            part = self.partition(row)
            source = open_object(part)
            try:
                # The footer: ranged reads at the tail.
                found = open_verified(source, file_id=row.file_id, uri=row.uri).schema_arrow
            except opendal.exceptions.NotFound:
                raise missing_error(part) from None
            except LakeFileCorrupt as exc:
                raise with_hint(exc) from None
            finally:
                source.close()
            merged = unify(schema, found)
            if merged is None:
                raise ValueError(f"{row.uri}: {_conflict(schema, found)}; pass a schema "
                                 "with .schema(...) to read the files as one type")
            schema = merged
        assert schema is not None, "rows is not empty"
        return schema


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


def _conflict(schema: pa.Schema | None, found: pa.Schema) -> str:
    for f in found:
        if schema is not None and f.name in schema.names and unify(
                pa.schema([schema.field(f.name)]), pa.schema([f])) is None:
            return f"column {f.name!r} is {f.type} here, {schema.field(f.name).type} before"
    return "schemas cannot be unified"


def _trace(directory: Path, key: str) -> None:
    """Append ``key`` to the trace file; one short O_APPEND write is never interleaved."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / TRACE_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)


def _quiet_log() -> Logger:
    return logs.quiet("spark_reader")
