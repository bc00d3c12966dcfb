"""The Iceberg projection (quiverd/lake/iceberg/): every (client, slot) an Apache Iceberg
table whose current snapshot is the live set of lake files, for any engine to read.

``names``: table names, the catalog's URI, the warehouse; ``files``: a lake file's footer
and whether Iceberg can hold it; ``catalog``: pyiceberg's SQL catalog as used here;
``projection``: ``Projection``, one snapshot per ``commit`` or ``sync``; ``snapshot``: one
snapshot's transaction and the table properties the projection keeps. docs/iceberg.md tells users
how to read the tables.
"""

from __future__ import annotations

from quiverd.lake.iceberg.files import DataFileRef
from quiverd.lake.iceberg.names import (
    CATALOG_NAME,
    NAMESPACE,
    catalog_uri,
    location,
    parse_table_name,
    table_name,
    warehouse,
)
from quiverd.lake.iceberg.projection import CommitResult, Projection
from quiverd.lake.iceberg.snapshot import FILE_IDS, REMOVED_FILE_IDS

__all__ = [
    "CATALOG_NAME",
    "FILE_IDS",
    "NAMESPACE",
    "REMOVED_FILE_IDS",
    "CommitResult",
    "DataFileRef",
    "Projection",
    "catalog_uri",
    "location",
    "parse_table_name",
    "table_name",
    "warehouse",
]
