"""The native fast path: local Parquet paths of a selection, for ``spark.read.parquet``.

    from quiverd.spark.paths import read_parquet
    df = read_parquet(spark, "/etc/quiverd/config.toml", client="web")
    df = read_parquet(spark, socket="/var/lib/quiverd/ingest.sock", client="web")

The daemon is named as for ``format("quiver")`` (quiverd/spark/locator.py): its config,
or its socket (the daemon says where its lake is), or neither (the defaults).

``read_parquet`` is ``spark.read.parquet(*local_paths(...))`` plus what Spark needs for
quiverd's files: Spark refuses Parquet TIMESTAMP(NANOS) (``_quiver_ingested_at`` is
one), so it reads them as longs (``spark.sql.legacy.parquet.nanosAsLong``) and turns
them back into timestamps (microseconds, as Spark keeps them), and it merges the
schemas of drifting files (``mergeSchema``).

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
    nanos = {f.name for p in paths[:1] for f in pq.read_schema(p)
             if pa.types.is_timestamp(f.type) and f.type.unit == "ns"}
    spark.conf.set(NANOS_AS_LONG, "true")
    # Spark's reader skips page checksums unless told: damaged pages read as wrong values.
    df = (spark.read.option("mergeSchema", "true").option(VERIFY_CHECKSUMS, "true")
          .parquet(*paths))
    for name in sorted(nanos):
        # Integer division: a double would round 19-digit nanoseconds.
        df = df.withColumn(name, F.timestamp_micros(F.expr(f"div(`{name}`, 1000)")))
    return df
