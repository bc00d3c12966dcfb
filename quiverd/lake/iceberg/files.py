"""Lake files as Iceberg DataFiles: what a file's footer says, and whether Iceberg can hold it.

    DataFileRef ──read_footer──▶ Footer (Parquet FileMetaData, size, Arrow schema)
      │ footer + size given (the writer's, lake.footers): no read of the object
      │ else one ranged read through the table's FileIO
                                   │ schema_problem   cached per schema
                                   │ partition_of     per file, from row-group statistics
                                   ▼
                      to_data_file(footer, table metadata) ──▶ pyiceberg DataFile

A file is never rewritten: Iceberg registers the Parquet object as quiverd wrote it, with
column ids by name (the table's ``schema.name-mapping.default``). What Iceberg (format
version 2) cannot hold is refused with a reason, and the caller leaves the file out of
the snapshot: a ``timestamp[ns]`` column (v2 holds microseconds), an unsigned 32- or
64-bit column (Iceberg's int/long are signed: values past the signed range would read
negative), a type Iceberg has no counterpart for, a partition column that is not a
timestamp, null in some rows only, or whose values span two hours (an Iceberg data file
belongs to exactly one partition). A file without the partition column, or with it null
in every row, sits in the null partition.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.lake.parquet import footer_metadata

SCHEMA_CACHE = 256  # distinct (schema, partition column) pairs whose verdict is kept
US_PER_HOUR = 3_600_000_000
_UNITS_PER_S = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


class DataFileRef(msgspec.Struct, frozen=True, kw_only=True):
    """One registered lake file to project."""

    file_id: str  # quiverd's file id (ULID)
    location: str  # file:///abs/path or s3://bucket/key, NOT percent-encoded
    client: str
    slot: int
    partition_column: str  # the column the table is partitioned by hour(...) on
    # The file's footer as its writer gave it (``FileFacts.footer``) and the object's
    # size, when the daemon still holds them: then the object is not read. b"": read it.
    footer: bytes = b""
    size: int = 0


class Footer(NamedTuple):
    ref: DataFileRef
    metadata: pq.FileMetaData
    size: int
    schema: pa.Schema  # the Arrow schema of the Parquet schema (what pyiceberg checks)


def read_footer(io: Any, ref: DataFileRef) -> Footer:
    """The file's Parquet footer: the one the ref carries (its writer's, no I/O), else
    read through the table's FileIO (one ranged read on S3). FileNotFoundError when the
    object is not there; other OSErrors propagate."""
    if ref.footer:
        assert ref.size > 0, "a ref with a footer carries its object's size"
        metadata = footer_metadata(ref.footer)
        return Footer(ref, metadata, ref.size, metadata.schema.to_arrow_schema())
    input_file = io.new_input(ref.location)
    with input_file.open() as stream:
        metadata = pq.read_metadata(stream)
    return Footer(ref, metadata, len(input_file), metadata.schema.to_arrow_schema())


def schema_problem(schema: pa.Schema) -> str | None:
    """Why Iceberg cannot hold files of this schema, or None (cached per schema)."""
    return _schema_problem(schema)


@lru_cache(maxsize=SCHEMA_CACHE)
def _schema_problem(schema: pa.Schema) -> str | None:
    from pyiceberg.io.pyarrow import _pyarrow_to_schema_without_ids

    for name, dtype in _leaves(schema):
        if pa.types.is_timestamp(dtype) and dtype.unit == "ns":
            return (f"column {name!r} is {dtype}: Iceberg format version 2 holds timestamps in "
                    "microseconds")
        if pa.types.is_uint32(dtype) or pa.types.is_uint64(dtype):
            return (f"column {name!r} is {dtype}: Iceberg's int and long are signed, so values "
                    "past the signed range would read negative")
    try:
        _pyarrow_to_schema_without_ids(schema, format_version=2)
    except (TypeError, ValueError) as exc:
        return f"no Iceberg type for a column: {exc}"
    return None


def creation_column(schema: pa.Schema, wanted: str) -> str:
    """The column a new table is partitioned by hour(...) on: ``wanted`` (the configured
    time column) when the first file holds it as a timestamp, else the ingestion time
    (the rule of ``lake.partitions.partition_column``, which keys the objects)."""
    from quiverd.lake.partitions import partition_column

    return partition_column(schema, wanted)


def partition_of(footer: Footer, column: str) -> tuple[int | None, str | None]:
    """(hour, None) when every row of the file sits in ``hour(column)`` = hour (hours since
    the epoch); (None, None) when the file has no such column or it is null in every row
    (Iceberg's null partition: the uploader keeps null times in files of their own);
    (None, reason) when the file cannot sit in one partition."""
    md = footer.metadata
    if md.num_rows == 0 or md.num_row_groups == 0:
        return None, "the file holds no rows"
    index = footer.schema.get_field_index(column)
    if index < 0:
        return None, None  # the column is absent: null in every row
    ptype = footer.schema.field(index).type
    if not pa.types.is_timestamp(ptype):
        return None, (f"the table is partitioned by hour({column}), and the file holds "
                      f"{column!r} as {ptype}")
    leaf = next((i for i in range(md.num_columns) if md.schema.column(i).path == column), None)
    if leaf is None:
        return None, f"partition column {column!r} is not a Parquet leaf column"
    per_hour = 3600 * _UNITS_PER_S[ptype.unit]
    hours: set[int] = set()
    nulls = 0
    for rg in range(md.num_row_groups):
        stats = md.row_group(rg).column(leaf).statistics
        if stats is None or stats.null_count is None:
            return None, f"row group {rg} has no statistics for {column!r}"
        nulls += stats.null_count
        if stats.has_min_max:
            hours.update((int(stats.min_raw) // per_hour, int(stats.max_raw) // per_hour))
    if not hours and nulls == md.num_rows:
        return None, None
    if nulls:
        return None, f"partition column {column!r} is null in {nulls} of {md.num_rows} rows"
    if len(hours) > 1:
        return None, (f"values of {column!r} span {len(hours)} hours: an Iceberg data file "
                      "belongs to one hour(...) partition")
    return hours.pop(), None


def nullable(schema: pa.Schema) -> pa.Schema:
    """The schema with every field optional (also nested ones): a table column must never
    be required, or a later file without it could not be added."""
    return pa.schema([_nullable_field(f) for f in schema], metadata=None)


def fits_table(table_metadata: Any, schema: pa.Schema) -> bool:
    """Whether files of ``schema`` fit the table's current schema as it is: every column
    known by name, each of the table's type or one Iceberg promotes to it (int to long,
    float to double). False means the table's schema must evolve first."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible

    try:
        _check_pyarrow_schema_compatible(table_metadata.schema(), schema,
                                         format_version=table_metadata.format_version)
    except ValueError:
        return False
    return True


def to_data_file(footer: Footer, table_metadata: Any, hour: int | None, *,
                 checked: bool = False) -> Any:
    """The DataFile of ``footer`` for a table with ``table_metadata`` (no I/O): what
    pyiceberg's ``parquet_file_to_data_file`` builds, from the footer already read.
    ValueError when the file's schema does not fit the table's (not checked again when
    ``checked``: ``fits_table`` said so for this metadata)."""
    from pyiceberg.io.pyarrow import (
        _check_pyarrow_schema_compatible,
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    schema = table_metadata.schema()
    if not checked:
        _check_pyarrow_schema_compatible(schema, footer.schema,
                                         format_version=table_metadata.format_version)
    statistics = data_file_statistics_from_parquet_metadata(
        parquet_metadata=footer.metadata,
        stats_columns=compute_statistics_plan(schema, table_metadata.properties),
        parquet_column_mapping=parquet_path_to_id_mapping(schema),
    )
    return DataFile.from_args(
        content=DataFileContent.DATA,
        file_path=footer.ref.location,
        file_format=FileFormat.PARQUET,
        partition=Record(hour) if table_metadata.spec().fields else Record(),
        file_size_in_bytes=footer.size,
        sort_order_id=None,
        spec_id=table_metadata.default_spec_id,
        equality_ids=None,
        key_metadata=None,
        **statistics.to_serialized_dict(),
    )


def _leaves(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    found: list[tuple[str, pa.DataType]] = []

    def walk(name: str, dtype: pa.DataType) -> None:
        found.append((name, dtype))
        if isinstance(dtype, pa.StructType):
            for i in range(dtype.num_fields):
                walk(f"{name}.{dtype.field(i).name}", dtype.field(i).type)
        elif isinstance(dtype, pa.ListType | pa.LargeListType | pa.FixedSizeListType):
            walk(f"{name}.element", dtype.value_type)
        elif isinstance(dtype, pa.MapType):
            walk(f"{name}.key", dtype.key_type)
            walk(f"{name}.value", dtype.item_type)

    for field in schema:
        walk(field.name, field.type)
    return found


def _nullable_field(field: pa.Field) -> pa.Field:
    return field.with_type(_nullable_type(field.type)).with_nullable(True)


def _nullable_type(dtype: pa.DataType) -> pa.DataType:
    if isinstance(dtype, pa.StructType):
        return pa.struct([_nullable_field(dtype.field(i)) for i in range(dtype.num_fields)])
    if isinstance(dtype, pa.LargeListType):
        return pa.large_list(_nullable_field(dtype.value_field))
    if isinstance(dtype, pa.ListType):
        return pa.list_(_nullable_field(dtype.value_field))
    if isinstance(dtype, pa.MapType):
        return pa.map_(dtype.key_type, _nullable_field(dtype.item_field))
    return dtype
