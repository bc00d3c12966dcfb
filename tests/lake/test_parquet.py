"""lake.parquet: Active files on real disk, names, zone maps, bloom filter presence."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import google_crc32c
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from ulid import ULID

from quiverd.lake.drift import schema_hash
from quiverd.lake.model import ZoneMap
from quiverd.lake.parquet import (
    ActiveFile,
    FileFacts,
    ParquetSettings,
    crc32c_file,
    file_name,
    has_bloom_filter,
    parse_file_name,
    zone_maps,
)

SCHEMA = pa.schema([("ts", pa.timestamp("us", "UTC")), ("user", pa.string()),
                    ("n", pa.int64()), ("x", pa.float64())])
META = {"quiver.node_id": "n1", "quiver.client": "web", "quiver.file_id": "F"}


def _table(start: int, rows: int) -> pa.Table:
    return pa.table({
        "ts": pa.array(range(start, start + rows), pa.timestamp("us", "UTC")),
        "user": pa.array([f"user-{i % 97}" for i in range(start, start + rows)]),
        "n": pa.array([None if i % 10 == 0 else i * 3 for i in range(rows)], pa.int64()),
        "x": pa.array([i / 4 for i in range(rows)], pa.float64()),
    }, schema=SCHEMA)


def _write(path: Path, tables: list[pa.Table], settings: ParquetSettings | None = None,
           schema: pa.Schema = SCHEMA, time_column: str = "ts") -> FileFacts:
    active = ActiveFile.create(path, schema, settings or ParquetSettings(), metadata=META,
                               time_column=time_column)
    for t in tables:
        active.append(t)
    return active.close()


def test_active_file_writes_zstd_statistics_and_page_index(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    _write(path, [_table(0, 100)])
    meta = pq.read_metadata(path)
    for j in range(meta.num_columns):
        chunk = meta.row_group(0).column(j)
        assert chunk.compression == "ZSTD"
        assert chunk.is_stats_set and chunk.statistics.has_min_max
        assert chunk.has_offset_index and chunk.has_column_index
    assert {k.decode(): v.decode() for k, v in meta.metadata.items()
            if k.startswith(b"quiver.")} == META
    assert pq.read_table(path).equals(_table(0, 100))


def test_active_file_writes_bloom_filter_when_column_configured(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    settings = ParquetSettings(bloom_filter_columns=("user", "absent"), row_group_rows=40)
    facts = _write(path, [_table(0, 100)], settings)
    assert facts.indexes == ("zonemap", "bloom:user")
    assert has_bloom_filter(path, "user")
    assert not has_bloom_filter(path, "n")
    assert not has_bloom_filter(path, "absent")
    meta = pq.read_metadata(path)
    assert all(meta.row_group(i).column(1).bloom_filter_length
               for i in range(meta.num_row_groups))


def test_active_file_caps_row_groups_when_table_exceeds_row_group_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    _write(path, [_table(0, 250), _table(250, 30)], ParquetSettings(row_group_rows=100))
    meta = pq.read_metadata(path)
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [100, 100, 50, 30]


def test_active_file_close_facts_match_file_when_closed(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    tables = [_table(1_000, 60), _table(0, 10), _table(5_000, 0)]
    active = ActiveFile.create(path, SCHEMA, ParquetSettings(), metadata=META,
                               time_column="ts")
    assert active.bytes_written == 4  # "PAR1"
    sizes = []
    for t in tables:
        active.append(t)
        sizes.append(active.bytes_written)
    assert sizes[0] < sizes[1] == sizes[2]
    assert (active.rows, active.start_ts, active.end_ts) == (70, 0, 1_059_000)
    facts = active.close()
    meta = pq.read_metadata(path)
    data = path.read_bytes()
    footer_len = int.from_bytes(data[-8:-4], "little")
    assert facts == FileFacts(
        rows=meta.num_rows, uncompressed_size=sum(t.nbytes for t in tables),
        compressed_size=len(data), crc32c=int.from_bytes(google_crc32c.Checksum(data).digest()),
        start_ts=0, end_ts=1_059_000, schema_hash=schema_hash(SCHEMA),
        indexes=("zonemap",), footer=b"PAR1" + data[-8 - footer_len:])
    assert active.bytes_written == len(data)
    assert facts.rows == 70


def test_active_file_tracks_integer_time_column_when_not_timestamp(tmp_path: Path) -> None:
    schema = pa.schema([("t", pa.int64()), ("v", pa.string())])
    tables = [pa.table({"t": [None, 50, 7], "v": ["a", "b", "c"]}, schema=schema),
              pa.table({"t": pa.array([None], pa.int64()), "v": ["d"]}, schema=schema)]
    facts = _write(tmp_path / "a.parquet", tables, schema=schema, time_column="t")
    assert (facts.start_ts, facts.end_ts) == (7, 50)
    facts = _write(tmp_path / "b.parquet", tables[1:], schema=schema, time_column="t")
    assert (facts.start_ts, facts.end_ts) == (0, 0)  # no time value at all


def test_active_file_create_rejects_time_column_when_missing_or_text(tmp_path: Path) -> None:
    for column in ("nope", "user"):
        with pytest.raises(ValueError, match="time column"):
            ActiveFile.create(tmp_path / "a.parquet", SCHEMA, ParquetSettings(), metadata={},
                              time_column=column)
    assert not (tmp_path / "a.parquet").exists()


def test_active_file_create_refuses_when_path_exists(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    path.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        ActiveFile.create(path, SCHEMA, ParquetSettings(), metadata={}, time_column="ts")
    assert path.read_bytes() == b"precious"


def test_active_file_abort_removes_file_when_open_or_closed(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    active = ActiveFile.create(path, SCHEMA, ParquetSettings(), metadata={}, time_column="ts")
    active.append(_table(0, 10))
    active.abort()
    assert not path.exists()
    active.abort()  # idempotent
    active = ActiveFile.create(path, SCHEMA, ParquetSettings(), metadata={}, time_column="ts")
    active.close()
    active.abort()
    assert not path.exists()


def test_crc32c_file_equals_one_shot_crc_when_read_in_small_chunks(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    data = bytes(range(256)) * 41 + b"tail"
    path.write_bytes(data)
    expected = int.from_bytes(google_crc32c.Checksum(data).digest())
    assert crc32c_file(path, chunk_bytes=1000) == expected == crc32c_file(path)


@pytest.mark.parametrize("node", ["web", "my_node", "a_b_c.d-e", "_", "x" * 64])
def test_file_name_round_trips_when_node_id_has_underscores(node: str) -> None:
    file_id = str(ULID())
    ts_ns = 1_718_000_000_123_456_789
    for status in ("active", "stable"):
        name = file_name(node, ts_ns, file_id, status)
        assert parse_file_name(name) == ("20240610T061320123456789Z", file_id, status, node, None)


def test_file_name_sorts_by_time_when_client_is_same() -> None:
    stamps = [0, 999_999_999, 10**9, 1_718_000_000_000_000_000, 4_000_000_000_000_000_000]
    names = [file_name("c_1", ts, str(ULID()), "stable") for ts in stamps]
    assert names == sorted(names)


@pytest.mark.parametrize("name", [
    "web_20240610T061320123456789Z_01J0000000000000000000000X_active.parquet.tmp",
    "web_20240610T061320123456789Z_01J0000000000000000000000X_done.parquet",
    "web_20240610T0613201234Z_01J0000000000000000000000X_stable.parquet",
    "_20240610T061320123456789Z_01J0000000000000000000000X_stable.parquet",
    "web_20240610T061320123456789Z_01J000000000000000000000UX_stable.parquet",
    "we/b_20240610T061320123456789Z_01J0000000000000000000000X_stable.parquet",
    "catalog.sqlite",
])
def test_parse_file_name_returns_none_when_not_a_lake_file(name: str) -> None:
    assert parse_file_name(name) is None


def test_file_name_raises_when_client_invalid() -> None:
    with pytest.raises(ValueError):
        file_name("a/b", 0, str(ULID()), "active")


# ---- zone maps ----------------------------------------------------------------------

ZONE_SCHEMA = pa.schema([
    ("i", pa.int32()), ("u", pa.uint64()), ("f", pa.float32()), ("s", pa.string()),
    ("ts_ns", pa.timestamp("ns")), ("ts_us", pa.timestamp("us", "UTC")),
    ("ts_s", pa.timestamp("s")), ("d", pa.date32()), ("dec", pa.decimal128(9, 3)),
    ("none", pa.int64()), ("null", pa.null()), ("b", pa.binary()),
])


def _zone_table(start: int, rows: int) -> pa.Table:
    r = range(start, start + rows)
    return pa.table({
        "i": [None if k % 7 == 0 else (k * 37) % 1000 - 500 for k in r],
        "u": [2**64 - 1 - k for k in r],
        "f": [k / 8 - 3 for k in r],
        "s": [None if k % 5 == 0 else f"s{(k * 13) % 101:03d}é" for k in r],
        "ts_ns": [1_700_000_000_000_000_001 + k * 1_001 for k in r],
        "ts_us": [1_700_000_000_000_000 + k * 3 for k in r],
        "ts_s": [1_700_000_000 - k for k in r],
        "d": [19_000 + (k % 50) for k in r],
        "dec": [None] * rows,
        "none": [None] * rows,
        "null": [None] * rows,
        "b": [b"x" * (k % 3) for k in r],
    }, schema=ZONE_SCHEMA)


def _expected_zone(table: pa.Table, column: str) -> ZoneMap:
    data = table.column(column)
    if pa.types.is_timestamp(data.type):
        ns_per = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[data.type.unit]
        data = pc.multiply(data.cast(pa.int64()), ns_per)
    bounds = pc.min_max(data)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if pa.types.is_date32(data.type) and lo is not None:
        lo, hi = bounds["min"].value, bounds["max"].value
    return ZoneMap(column=column, min_value=lo, max_value=hi, null_count=data.null_count)


def test_zone_maps_match_pyarrow_compute_when_file_has_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "z.parquet"
    tables = [_zone_table(0, 300), _zone_table(300, 20), _zone_table(320, 90)]
    _write(path, tables, ParquetSettings(row_group_rows=128), schema=ZONE_SCHEMA,
           time_column="ts_us")
    whole = pa.concat_tables(tables)
    wanted = ["ts_us", "i", "u", "f", "s", "ts_ns", "ts_s", "d", "none", "null", "b",
              "missing", "i"]
    maps = zone_maps(path, wanted)
    expected = [_expected_zone(whole, c)
                for c in ("ts_us", "i", "u", "f", "s", "ts_ns", "ts_s", "d", "none")]
    expected.append(ZoneMap(column="null", min_value=None, max_value=None, null_count=410))
    assert maps == expected  # binary, missing and repeated columns are left out
    assert maps[5].min_value == 1_700_000_000_000_000_001  # ns kept exactly


def test_zone_maps_computed_from_data_when_file_has_no_statistics(tmp_path: Path) -> None:
    path = tmp_path / "plain.parquet"
    table = pa.concat_tables([_zone_table(0, 50), _zone_table(50, 50)])
    pq.write_table(table, path, write_statistics=False, row_group_size=30)
    assert not pq.read_metadata(path).row_group(0).column(0).is_stats_set
    columns = ["i", "u", "f", "s", "ts_ns", "ts_us", "ts_s", "d", "none"]
    assert zone_maps(path, columns) == [_expected_zone(table, c) for c in columns]


def test_zone_maps_render_decimals_as_text_when_present(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    values = [Decimal("-1.25"), Decimal("10.5"), None]
    table = pa.table({"dec": pa.array(values, pa.decimal128(9, 3))})
    pq.write_table(table, path)
    assert zone_maps(path, ["dec"]) == [
        ZoneMap(column="dec", min_value="-1.250", max_value="10.500", null_count=1)]


def test_zone_maps_same_from_footer_and_data_when_types_vary(tmp_path: Path) -> None:
    table = pa.table({
        "h": pa.array([1.5, -2.25, None], pa.float16()),
        "t32": pa.array([5, 1, None], pa.time32("s")),
        "du": pa.array([5, -1, None], pa.duration("ms")),
        "d64": pa.array([86_400_000 * 3, 86_400_000, None], pa.date64()),
        "bo": [True, None, False],
        "dic": pa.array(["z", "y", None]).dictionary_encode(),
        "u8": pa.array([3, 200, None], pa.uint8()),
        "ts_ms": pa.array([-5, 7, None], pa.timestamp("ms")),
        "nested": [{"a": 1}, None, None],
    })
    pq.write_table(table, tmp_path / "stats.parquet")
    pq.write_table(table, tmp_path / "plain.parquet", write_statistics=False)
    pq.write_table(table, tmp_path / "int96.parquet", use_deprecated_int96_timestamps=True)
    expected = [
        ZoneMap(column="h", min_value=-2.25, max_value=1.5, null_count=1),
        ZoneMap(column="t32", min_value=10**9, max_value=5 * 10**9, null_count=1),
        ZoneMap(column="du", min_value=-10**6, max_value=5 * 10**6, null_count=1),
        ZoneMap(column="d64", min_value=1, max_value=3, null_count=1),
        ZoneMap(column="bo", min_value=False, max_value=True, null_count=1),
        ZoneMap(column="dic", min_value="y", max_value="z", null_count=1),
        ZoneMap(column="u8", min_value=3, max_value=200, null_count=1),
        ZoneMap(column="ts_ms", min_value=-5 * 10**6, max_value=7 * 10**6, null_count=1),
    ]
    for name in ("stats", "plain", "int96"):
        assert zone_maps(tmp_path / f"{name}.parquet", table.schema.names) == expected
