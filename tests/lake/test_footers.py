"""Read back never (issue 30): a lake file's CRC-32C, zone maps and Iceberg DataFile come
from what the writer wrote, equal to what reading the file back gives, and the file is
not opened again for them (counted by the kernel: inotify sees every open and read,
pyarrow's C++ ones included)."""

from __future__ import annotations

import ctypes
import os
import struct
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ulid import ULID

from quiverd.lake.footers import Footers
from quiverd.lake.iceberg import DataFileRef, location
from quiverd.lake.iceberg.files import read_footer, to_data_file
from quiverd.lake.iceberg.projection import Projection
from quiverd.lake.parquet import (
    ActiveFile,
    FileFacts,
    ParquetSettings,
    crc32c_file,
    footer_metadata,
    zone_maps,
)
from tests.lake.iceberg_helpers import TIME, fs_lake, lake_table

IN_ACCESS, IN_OPEN = 0x1, 0x20
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then name)


class Watch:
    """The opens and reads the kernel reports on files in one directory (inotify)."""

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip(f"inotify: {os.strerror(ctypes.get_errno())}")
        if self._libc.inotify_add_watch(self.fd, str(directory).encode(), IN_ACCESS | IN_OPEN) < 0:
            pytest.skip(f"inotify watch: {os.strerror(ctypes.get_errno())}")

    def events(self) -> Counter[tuple[str, str]]:
        """(file name, "open" | "read") -> how many, since the last call."""
        seen: Counter[tuple[str, str]] = Counter()
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return seen
            at = 0
            while at < len(data):
                _, mask, _, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size: at + _EVENT.size + size].rstrip(b"\0").decode()
                at += _EVENT.size + size
                for bit, what in ((IN_OPEN, "open"), (IN_ACCESS, "read")):
                    if mask & bit:
                        seen[(name, what)] += 1

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def watching(directory: Path) -> Iterator[Watch]:
    w = Watch(directory)
    try:
        yield w
    finally:
        w.close()


SETTINGS = ParquetSettings(row_group_rows=4096, bloom_filter_columns=("msg",))


def _tables() -> list[pa.Table]:
    """Several appends, a few MiB: the checksum sees many 1 MiB buffers and a short tail."""
    return [lake_table(20_000, start=k * 20_000).append_column(
        "pad", pa.array([os.urandom(32).hex() for _ in range(20_000)])) for k in range(4)]


def _write(path: Path, tables: list[pa.Table]) -> FileFacts:
    active = ActiveFile.create(path, tables[0].schema, SETTINGS, metadata={"k": "v"},
                               time_column=TIME)
    for t in tables:
        active.append(t)
    return active.close()


def test_active_file_close_reads_nothing_back_when_closed(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    with watching(tmp_path) as w:
        facts = _write(path, _tables())
        seen = w.events()
    # One open (the create) and no read: neither the CRC nor the footer came from disk.
    assert seen == Counter({(path.name, "open"): 1}), seen
    assert facts.compressed_size == path.stat().st_size > 2 << 20


def test_active_file_close_crc_and_footer_equal_read_back_when_many_row_groups(
        tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    facts = _write(path, _tables())
    assert facts.crc32c == crc32c_file(path)
    data = path.read_bytes()
    footer_len = int.from_bytes(data[-8:-4], "little")
    assert facts.footer == b"PAR1" + data[-8 - footer_len:]  # byte for byte
    meta, back = footer_metadata(facts.footer), pq.read_metadata(path)
    assert meta.num_row_groups == back.num_row_groups == 20
    assert {**meta.to_dict(), "serialized_size": 0} == {**back.to_dict(), "serialized_size": 0}
    assert facts.indexes == ("zonemap", "bloom:msg")


def test_zone_maps_from_writer_footer_equal_read_back_and_open_nothing(tmp_path: Path) -> None:
    path = tmp_path / "z.parquet"
    tables = [t.append_column("n", pa.array([None if i % 3 else i * 1.5 for i in range(
        t.num_rows)], pa.float64())) for t in _tables()[:2]]
    facts = _write(path, tables)
    columns = [TIME, "id", "msg", "n", "_quiver_shard", "pad", "absent"]
    with watching(tmp_path) as w:
        from_writer = zone_maps(path, columns, facts.footer)
        seen = w.events()
    assert seen == Counter(), seen
    assert from_writer == zone_maps(path, columns)  # the read-back
    assert [z.column for z in from_writer] == columns[:-1]


def test_zone_maps_from_writer_footer_read_the_column_when_statistics_lack(
        tmp_path: Path) -> None:
    # Values past the writer's statistics size limit get no min/max: that column alone
    # is read from the file, as before.
    path = tmp_path / "long.parquet"
    table = lake_table(50).append_column("long", pa.array(["x" * 5000 + str(i)
                                                            for i in range(50)]))
    facts = _write(path, [table])
    meta = footer_metadata(facts.footer)
    leaf = meta.schema.names.index("long")
    assert not meta.row_group(0).column(leaf).statistics.has_min_max
    assert zone_maps(path, [TIME, "long"], facts.footer) == zone_maps(path, [TIME, "long"])


def _iceberg_fields(data_file: Any) -> dict[str, Any]:
    return {name: getattr(data_file, name) for name in (
        "file_path", "file_format", "partition", "record_count", "file_size_in_bytes",
        "column_sizes", "value_counts", "null_value_counts", "nan_value_counts",
        "lower_bounds", "upper_bounds", "split_offsets")}


def test_iceberg_data_file_from_writer_footer_equals_read_back_without_the_object(
        tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lake = fs_lake(data_dir)
    staged = tmp_path / "staged"
    staged.mkdir()
    file_id = str(ULID())
    key = f"client=web/slot=0/date=2026-11-26/hour=05/node-a_{file_id}.parquet"
    facts = _write(staged / "f.parquet", _tables()[:2])
    lake._put(key, (staged / "f.parquet").read_bytes())
    plain = DataFileRef(file_id=file_id, location=location(lake.warehouse, key), client="web",
                        slot=0, partition_column=TIME)
    handed = DataFileRef(file_id=file_id, location=plain.location, client="web", slot=0,
                         partition_column=TIME, footer=facts.footer,
                         size=facts.compressed_size)
    projection = lake.projection(f"sqlite:///{data_dir}/catalog.sqlite")
    try:
        # The table, made from the read-back; then both DataFiles against its metadata.
        assert projection.commit("quiver.web", [plain]).added == [file_id]
        tbl = projection._table("quiver.web", [], refresh=True)
        assert tbl is not None
        io = projection._io()
        back, writer = read_footer(io, plain), read_footer(io, handed)
        assert writer.size == back.size and writer.schema == back.schema
        assert _iceberg_fields(to_data_file(writer, tbl.metadata, 1)) == _iceberg_fields(
            to_data_file(back, tbl.metadata, 1))
        # No object: the read-back finds nothing, the handed footer needs nothing.
        (data_dir / "objects" / key).unlink()
        assert _commit_missing(projection, "quiver.other", plain) == [file_id]
        result = projection.commit("quiver.other", [handed])
        assert (result.added, result.skipped) == ([file_id], [])
    finally:
        projection.close()


def _commit_missing(projection: Projection, table: str, ref: DataFileRef) -> list[str]:
    result = projection.commit(table, [ref])
    assert result.added == []
    return [fid for fid, _ in result.skipped]


def test_footers_drop_an_entry_once_every_reader_took_it_or_room_runs_out() -> None:
    f = Footers(["indexer", "projector"], limit_bytes=10)
    f.put("a", b"1234")
    f.put("b", b"5678")
    assert f.peek("a") == b"1234"
    f.done("a", "indexer")
    assert f.peek("a") == b"1234"  # the projector still needs it
    f.done("a", "projector")
    assert f.peek("a") == b"" and len(f) == 1 and f.nbytes == 4
    f.put("c", b"abcd")
    f.put("d", b"efgh")  # 12 bytes > 10: the oldest goes
    assert (f.peek("b"), f.peek("c"), f.peek("d")) == (b"", b"abcd", b"efgh")
    f.put("huge", b"x" * 11)  # never held
    assert f.peek("huge") == b"" and f.nbytes == 8
    f.forget("c")
    f.forget("c")  # what is gone already: nothing changes
    assert f.nbytes == 4 and len(f) == 1
