"""The native fast path: local Parquet paths of a selection, for ``spark.read.parquet``.

    from quiverd.spark.paths import read_parquet
    df = read_parquet(spark, "/etc/quiverd/config.toml", client="web")
    df = read_parquet(spark, socket="/var/lib/quiverd/ingest.sock", client="web")

The daemon is named as for ``format("quiver")`` (quiverd/spark/locator.py): its config,
or its socket (the daemon says where its lake is), or neither (the defaults).

``read_parquet`` is ``spark.read.parquet(*local_paths(...))`` plus what Spark needs for
quiverd's files. Files written since issue 20 hold only types Spark reads as they are
(``_quiver_ingested_at`` timestamp[us, UTC], signed ids): they are read with no option
but ``mergeSchema`` (the schemas of drifting files). A file that still holds a
TIMESTAMP(NANOS) column, which Spark refuses (one from before issue 20, whose
``_quiver_ingested_at`` is ns, or with a producer's ns column kept as sent, SPEC §6), is
read apart (one read per set of ns columns) with ``spark.sql.legacy.parquet.nanosAsLong``
(set on the session only then), its ns columns turned back into timestamps (microseconds,
as Spark keeps them) and its unsigned ids into today's types (uint64 would read as
decimal(20,0)); the DataFrames are joined by column name (``unionByName``).

Only for the ``fs`` object store (the files are on a path Spark can open); for S3 and
other stores use ``spark.read.format("quiver")``, which reads through OpenDAL. What
the fast path gives up: the representative schema across drifting files (Spark's
own ``mergeSchema`` applies instead, and refuses what it cannot merge), the zone-map
pruning of ``format("quiver")`` (only the catalog's time range narrows the list), and
``since``/``until`` row filtering inside a file (filter the DataFrame yourself).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.lake.bundles import EXTRA_FIELDS
from quiverd.lake.store import store_class
from quiverd.spark.locator import Locator
from quiverd.spark.reader import Lake, Selection

NANOS_AS_LONG = "spark.sql.legacy.parquet.nanosAsLong"
VERIFY_CHECKSUMS = "parquet.page.verify-checksum.enabled"  # parquet-mr's read option


def local_paths(config: str = "", *, client: str, socket: str = "", slot: int = 0,
                since: str | None = None, until: str | None = None) -> list[str]:
    """Absolute paths of the registered files of ``client`` (and slot, time range)."""
    options = {"client": client, "slot": str(slot)}
    if config:
        options["config"] = config
    if socket:
        options["socket"] = socket
    if since is not None:
        options["since"] = since
    if until is not None:
        options["until"] = until
    sel = Selection.parse(options)
    lake = Lake.open(sel.locator)
    store = lake.cfg.lake.store
    kind = store_class(store.scheme)
    if not kind.is_local:
        raise ValueError(f"lake.store.scheme is {store.scheme!r}: the files are not on a local "
                         'path; read them with spark.read.format("quiver")')
    rows, _ = lake.query(sel, zone_maps=False)
    root = lake.store_options["root"]
    return [str(kind.file_under(root, row.object_key)) for row in rows]


def read_parquet(spark: Any, config: str = "", *, client: str, socket: str = "",
                 slot: int = 0, since: str | None = None, until: str | None = None) -> Any:
    """A DataFrame of the selection's files read by Spark's own Parquet reader."""
    from pyspark.sql import functions as F  # noqa: N812 - Spark's convention

    paths = local_paths(config, client=client, socket=socket, slot=slot, since=since,
                        until=until)
    if not paths:
        where = Locator(socket=socket, config=config)
        raise ValueError(f"no registered lake file for client {client!r} (slot {slot}) in "
                         f"the catalog of {where}")
    # Spark's reader skips page checksums unless told: damaged pages read as wrong values.
    reader = spark.read.option("mergeSchema", "true").option(VERIFY_CHECKSUMS, "true")
    groups: dict[frozenset[str], list[str]] = {}  # ns columns -> the files holding them
    for p in paths:
        groups.setdefault(ns_columns(pq.read_schema(p)), []).append(p)
    frames = [reader.parquet(*groups.pop(frozenset()))] if frozenset() in groups else []
    if groups:
        spark.conf.set(NANOS_AS_LONG, "true")
    for nanos, some in groups.items():
        df = reader.parquet(*some)
        for name in sorted(nanos):
            # Integer division: a double would round 19-digit nanoseconds.
            df = df.withColumn(name, F.timestamp_micros(F.expr(f"div(`{name}`, 1000)")))
        for f in EXTRA_FIELDS:  # unsigned ids of a file from before issue 20
            if f.name in df.columns:
                df = df.withColumn(f.name, F.col(f.name).cast(_SPARK_TYPES[f.type]))
        frames.append(df)
    out = frames[0]
    for df in frames[1:]:
        out = out.unionByName(df, allowMissingColumns=True)
    return out


def ns_columns(schema: pa.Schema) -> frozenset[str]:
    """Top-level TIMESTAMP(NANOS) columns of a file's schema: Spark refuses them."""
    return frozenset(f.name for f in schema
                     if pa.types.is_timestamp(f.type) and f.type.unit == "ns")


_SPARK_TYPES = {pa.timestamp("us", tz="UTC"): "timestamp", pa.int32(): "int",
                pa.int64(): "bigint"}
