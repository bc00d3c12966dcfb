"""The lake part of a stream: a new query starts with the rows the lake already holds.

``spark.readStream.format("quiver")`` with ``from = "lake"`` (the default, as a Delta or
Iceberg table's streaming read starts with the table's content) reads every row of the
client already in the lake, then goes on with the daemon's buffer (quiverd/spark/
stream.py). One position per shard runs through both parts; the **seam** between them
is the position the query's subscriber started at, recorded in the offsets:

    shard k:  (0, -1) ....... lake files ....... seam_k ....... segments (STREAM) ......
              bundles at or before seam_k:       bundles after seam_k:
              rows of this daemon's lake files   fetched from the daemon's segments
              (own source_id, the client, slot)  (RangedReader), acked when committed

    offset  {"0": [seg, idx], "1": [seg, idx], "lake_through": {"0": seam_0, "1": seam_1}}
            (``lake_through`` is dropped once every shard's position is past its seam:
            the offsets are then the buffer's alone, as before)

Why the seam is exact (no gap, no duplicate). ``initialOffset`` registers the
subscriber at "earliest" and takes its first position (just before its oldest pending
bundle) as the seam, in one STREAM open. A new subscriber holds every segment still on
disk, so every bundle at or before the seam is in a segment the daemon deleted before
that open, and the daemon deletes a segment only once each subscriber is done with it:
the uploader acks a bundle only when the lake file holding it is registered. So every
bundle at or before the seam was registered before the seam was taken, the set of them
never changes (a compaction replaces files, not bundles: exactly once into the lake,
SPEC §6), and a batch (a, b] of the lake part reads the rows of the registered files
whose bundle ids are in (a, b]: the same rows whenever it is planned again from a
checkpoint. Bundles after the seam are read from the segments only (their rows may be in
the lake too, and are filtered out of the lake part by the same position test). Bundle
ids are positions of one data directory: only files of the daemon's own ``source_id``
(``<data_dir>/lake.id``, which JOB lake answers as ``source_id``: the driver need not see
the data directory; an older daemon's driver reads the file itself) are this part;
files other daemons sharing a PostgreSQL catalog registered are theirs.

Batches. Without a limit the lake part is one micro-batch (the seam on every shard),
the buffer's batches follow. With ``maxBundlesPerTrigger`` the lake part is cut at lake
files' last bundles, about that many bundles (the files' bundle counts) per batch, at
least one file. A lake file holds one client's bundles of one shard in bundle order but
its range may interleave with other files (per-client files, registration out of order),
so a batch opens every file whose range meets it and keeps the rows in the batch's range.

The driver plans from the catalog rows (first/last bundle of each file), never from data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.compute as pc

from quiverd.kernel import logs
from quiverd.kernel.config import Config, load
from quiverd.kernel.errors import ConfigError, ProtocolError, QuiverError
from quiverd.kernel.layout import DataDir
from quiverd.lake.catalog import open_catalog
from quiverd.lake.model import (
    BUNDLE_COLUMN,
    REGISTERED,
    SEGMENT_COLUMN,
    FileRow,
    FileState,
)
from quiverd.lake.store import opendal_options
from quiverd.protocol.frames import ErrorCode
from quiverd.spark.locator import config_of
from quiverd.spark.objects import (
    FilePartition,
    quarantined_error,
    verified_file,
)
from quiverd.spark.types import as_target

LAKE_THROUGH = "lake_through"  # the offsets' key of the seam, per shard
BEFORE_ALL = (0, -1)  # a shard's first position: before its first segment (FIRST is 1)
MAX_FILES = 100_000  # lake files one query's lake part may plan (as spark.read)
BATCH_ROWS = 64 * 1024
ASK_TIMEOUT_S = 30.0

Position = tuple[int, int]


@dataclass(frozen=True)
class HistoryPartition(FilePartition):
    """The rows of one lake file whose bundles are in ``(after, through]`` of ``shard``."""

    shard: int = 0
    after: Position = BEFORE_ALL
    through: Position = BEFORE_ALL


# ---- offsets --------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamOffset:
    """An offset: per shard "after this bundle", and the seam while the lake part lasts."""

    positions: dict[int, Position]
    seam: dict[int, Position] | None = None

    @classmethod
    def parse(cls, offset: Mapping[str, Any]) -> StreamOffset:
        """Also the offsets written before the lake part existed (no ``lake_through``)."""
        seam = offset.get(LAKE_THROUGH)
        return cls(positions={int(k): _pos(v) for k, v in offset.items() if k != LAKE_THROUGH},
                   seam=None if seam is None else {int(k): _pos(v) for k, v in seam.items()})

    def json(self) -> dict[str, Any]:
        """Spark compares offsets as JSON text: shards in numeric order, the seam last,
        and no seam once every shard is past it (equal offsets print alike)."""
        out: dict[str, Any] = {str(k): list(p) for k, p in sorted(self.positions.items())}
        if self.seam is not None and self.in_lake():
            out[LAKE_THROUGH] = {str(k): list(p) for k, p in sorted(self.seam.items())}
        return out

    def in_lake(self) -> bool:
        """Some shard has lake rows left before its seam."""
        seam = self.seam or {}
        return any(p < seam.get(k, p) for k, p in self.positions.items())

    def buffer(self) -> dict[str, list[int]]:
        """The positions as the daemon's STREAM requests take them (past the seam)."""
        seam = self.seam or {}
        return {str(k): list(max(p, seam.get(k, p))) for k, p in sorted(self.positions.items())}


def lake_ranges(start: StreamOffset, end: StreamOffset) -> dict[int, tuple[Position, Position]]:
    """Per shard the lake part of the batch ``(start, end]``: ``(start, min(end, seam)]``."""
    seam = start.seam or end.seam or {}
    out = {}
    for k, after in start.positions.items():
        through = min(end.positions.get(k, after), seam.get(k, after))
        if after < through:
            out[k] = (after, through)
    return out


def buffer_ranges(start: StreamOffset, end: StreamOffset
                  ) -> dict[int, tuple[Position, Position]]:
    """Per shard the buffer part of the batch: ``(max(start, seam), end]``."""
    seam = start.seam or end.seam or {}
    out = {}
    for k, through in end.positions.items():
        after = start.positions.get(k)
        if after is None:
            raise ValueError(f"offset {end.json()} names shard {k}, not in start "
                             f"{start.json()}")
        after = max(after, seam.get(k, after))
        if after < through:
            out[k] = (after, through)
    return out


def _pos(value: Sequence[Any]) -> Position:
    return (int(value[0]), int(value[1]))


# ---- the lake: catalog rows (driver) ----------------------------------------------------

@dataclass
class LakeSide:
    """This daemon's lake as the query's driver reads it: config, store, own source."""

    cfg: Config
    source_id: str  # "": the lake never ran on this data_dir, so none of its files exist
    store_options: dict[str, str]

    @classmethod
    def open(cls, socket: str, config: str) -> LakeSide | None:
        """None when the daemon's lake is off. The config file if the options named one
        (secrets included), else the daemon's answer to JOB lake (secrets withheld)."""
        info: dict[str, Any] = {}
        if config:
            cfg = load(config)
            enabled = cfg.lake.enabled
        else:
            info = _ask(socket)
            enabled = bool(info["lake"].get("enabled", True))
            cfg = config_of(info)
        if not enabled:
            return None
        if "source_id" not in info:  # named config: ask the daemon too, if it answers
            with contextlib.suppress(QuiverError, OSError):
                info = _ask(socket)
        # The daemon says its source id (JOB lake); an older one does not: then the
        # driver reads the data_dir's lake.id itself, so it must see the data_dir.
        source_id = info["source_id"] if "source_id" in info else \
            _source_id(Path(cfg.data_dir))
        return cls(cfg=cfg, source_id=source_id,
                   store_options=opendal_options(cfg.lake.store, data_dir=Path(cfg.data_dir)))

    def files(self, client: str | None, slot: int,
              states: frozenset[FileState] | list[FileState] = REGISTERED) -> list[FileRow]:
        """The own source's files of (client, slot) (every client: None) in ``states``."""
        if not self.source_id:
            return []
        db = DataDir(Path(self.cfg.data_dir)).catalog_db
        if not self.cfg.catalog.dsn and not db.exists():
            return []

        async def ask() -> list[FileRow]:
            async with open_catalog(self.cfg.catalog, db, log=logs.quiet("spark_stream")
                                    ) as catalog:
                return await catalog.list_files(client=client, slot=slot,
                                                source_id=self.source_id,
                                                states=list(states), limit=MAX_FILES + 1)

        rows = anyio.run(ask)
        if len(rows) > MAX_FILES:
            raise ValueError(f"more than {MAX_FILES} lake files of client {client!r} slot "
                             f"{slot}: start the stream with .option(\"from\", \"earliest\") "
                             "and read the lake with spark.read in ranges")
        return rows

    def partitions(self, ranges: Mapping[int, tuple[Position, Position]], client: str | None,
                   slot: int) -> tuple[list[HistoryPartition], list[FileRow]]:
        """One partition per lake file meeting a shard's range, and the Lost files there
        (`quiverd files forget`: their rows are gone). Quarantined files there fail the
        batch, naming them (their rows cannot be read: never a silently smaller batch)."""
        if not ranges:
            return [], []
        bad = [r for r in self.files(client, slot, [FileState.QUARANTINED])
               if _meets(r, ranges)]
        if bad:
            raise quarantined_error(f"the lake part of the stream of client {client!r} slot "
                                    f"{slot}", bad)
        lost = [r for r in self.files(client, slot, [FileState.LOST]) if _meets(r, ranges)]
        store = self.cfg.lake.store
        out = []
        for row in sorted(self.files(client, slot), key=lambda r: (r.shard, _first(r),
                                                                   r.file_id)):
            if _meets(row, ranges):
                after, through = ranges[row.shard]
                out.append(HistoryPartition(
                    key=row.object_key, scheme=store.scheme, store_options=self.store_options,
                    timeout_ms=store.timeout_ms, max_attempts=store.max_attempts,
                    file_id=row.file_id, uri=row.uri, size=row.compressed_size,
                    shard=row.shard, after=after, through=through))
        return out, lost


def lost_text(subscriber: str, rows: Sequence[FileRow]) -> str:
    """One sentence naming the Lost lake files of a batch of the lake part."""
    files = ", ".join(f"{r.file_id} (shard {r.shard}, {r.row_count} rows)" for r in rows[:10])
    more = f" and {len(rows) - 10} more" if len(rows) > 10 else ""
    return (f"data lost while planning the lake part of subscriber {subscriber!r}'s stream: "
            f"lake file{'s' * (len(rows) > 1)} {files}{more} "
            f"{'were' if len(rows) > 1 else 'was'} recorded as lost (`quiverd files forget`)")


def has_history(rows: Sequence[FileRow], seam: Mapping[int, Position]) -> bool:
    """Some file holds a bundle at or before its shard's seam."""
    return any(row.shard in seam and _first(row) <= seam[row.shard] for row in rows)


def lake_end(rows: Sequence[FileRow], start: StreamOffset, max_bundles: int) -> StreamOffset:
    """The end of the next lake batch after ``start``: the seam on every shard, or with
    ``max_bundles`` the last bundle of the file where about that many bundles are
    reached (files in order of their last bundle; at least one file)."""
    seam = start.seam or {}
    ends = dict(start.positions)
    count = 0
    for k in sorted(start.positions):
        after, through = start.positions[k], seam.get(k, start.positions[k])
        if after >= through:
            continue
        if max_bundles and count >= max_bundles:
            break
        ends[k] = through
        if not max_bundles:
            continue
        mine = sorted((r for r in rows if r.shard == k and _last(r) > after
                       and _first(r) <= through), key=lambda r: (_last(r), r.file_id))
        for row in mine:
            count += row.bundle_count
            if count >= max_bundles:
                ends[k] = min(_last(row), through)
                break
    return StreamOffset(positions=ends, seam=start.seam)


def _first(row: FileRow) -> Position:
    return (row.first_segment, row.first_bundle)


def _last(row: FileRow) -> Position:
    return (row.last_segment, row.last_bundle)


def _meets(row: FileRow, ranges: Mapping[int, tuple[Position, Position]]) -> bool:
    if row.shard not in ranges:
        return False
    after, through = ranges[row.shard]
    return _last(row) > after and _first(row) <= through


def _source_id(data_dir: Path) -> str:
    """The daemon's own lake source (``<data_dir>/lake.id``); "" if its lake never ran.
    The driver must see the data_dir: bundle ids are positions of that data directory."""
    data = DataDir(data_dir)
    try:
        if not data_dir.is_dir():
            raise FileNotFoundError(f"no directory {data_dir} here")
        if not data.lake_id.exists():
            return ""
        return data.lake_id.read_text().strip()
    except OSError as exc:  # not on this host, or not readable by the driver's user
        raise ConfigError("", f'.option("from", "lake") needs the daemon\'s data_dir '
                          f"{data_dir} on the query's driver: its lake.id names the lake "
                          f"files whose bundle ids are this daemon's ({exc})",
                          hint='run the driver on the daemon\'s host as a user who may read '
                          'lake.id, or start the stream with .option("from", "earliest") and '
                          "read the lake with spark.read") from None


def _ask(socket: str) -> dict[str, Any]:
    from quiverd.client import Client  # the driver only

    try:
        with Client.connect(socket, timeout=ASK_TIMEOUT_S) as c:
            return c.lake_info()
    except ProtocolError as exc:
        if exc.code != ErrorCode.MALFORMED:
            raise
        raise ConfigError("", f"the daemon at {socket} does not say where its lake is "
                          f"({exc}): it is older than this reader",
                          hint='name its config: .option("config", "<its config.toml>"), or '
                          'start with .option("from", "earliest")') from None


# ---- the executor: one file's rows in a range ------------------------------------------

def read_history(p: HistoryPartition, target: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The rows of ``p``'s file whose bundle is in ``(p.after, p.through]``, as Spark's
    Arrow ``target``; page checksums verified (damage fails, naming the file)."""
    uri = p.uri or p.key
    with verified_file(p) as pf:
        names = set(pf.schema_arrow.names)
        if SEGMENT_COLUMN not in names or BUNDLE_COLUMN not in names:
            raise ValueError(f"lake file {p.file_id} ({uri}) has no {SEGMENT_COLUMN}/"
                             f"{BUNDLE_COLUMN} columns: its rows cannot be placed in the "
                             "stream")
        kept = (SEGMENT_COLUMN, BUNDLE_COLUMN)  # for the range; to_spark drops what
        columns = [n for n in target.names if n in names and n not in kept] + list(kept)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            batch = batch.filter(in_range(batch, p.after, p.through))
            if batch.num_rows:
                yield from as_target(batch, target, p.file_id, uri).to_batches()


def in_range(batch: pa.RecordBatch, after: Position, through: Position) -> pa.Array:
    """Rows whose (segment, bundle) is in ``(after, through]``, compared as pairs."""
    seg = pc.cast(batch.column(SEGMENT_COLUMN), pa.int64())
    idx = pc.cast(batch.column(BUNDLE_COLUMN), pa.int64())
    past = pc.or_(pc.greater(seg, after[0]),
                  pc.and_(pc.equal(seg, after[0]), pc.greater(idx, after[1])))
    upto = pc.or_(pc.less(seg, through[0]),
                  pc.and_(pc.equal(seg, through[0]), pc.less_equal(idx, through[1])))
    return pc.fill_null(pc.and_(past, upto), False)
