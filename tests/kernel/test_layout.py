"""The data directory's names (quiverd.kernel.layout) are SPEC §2's, spelled here independently."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiverd.kernel import layout
from quiverd.kernel.layout import DataDir, ShardLayout


def test_layout_paths_match_spec_section_2() -> None:
    root = DataDir(Path("/d"))
    shard = root.shard(3)
    assert root.lock == Path("/d/LOCK")
    assert root.ingest_socket == Path("/d/ingest.sock")
    assert root.admin_socket == Path("/d/admin.sock")
    assert shard.dir == Path("/d/shard-3")
    assert shard.active_wal == Path("/d/shard-3/wal/quiver.wal")
    assert layout.rotated_wal(shard.wal_dir, 7) == Path("/d/shard-3/wal/quiver.wal.7")
    assert shard.sidecar == Path("/d/shard-3/wal/truncate.offset")
    assert shard.segment(42) == Path("/d/shard-3/segments/0000000000000042.qseg")
    assert shard.floor == Path("/d/shard-3/segments/FLOOR")
    assert shard.deleted == Path("/d/shard-3/segments/DELETED")
    assert shard.ack_log == Path("/d/shard-3/ack.log")
    assert shard.quarantine_dir == Path("/d/shard-3/quarantine")


@pytest.mark.parametrize(("name", "seq"), [("0000000000000042.qseg", 42), ("7.qseg", 7),
                                           ("0000000000000042.qseg.tmp", None),
                                           ("FLOOR", None), ("x.qseg", None)])
def test_layout_segment_seq_of_names(name: str, seq: int | None) -> None:
    assert layout.segment_seq_of(name) == seq


def test_layout_wal_names_round_trip() -> None:
    assert layout.rotated_generation("quiver.wal.12") == 12
    assert layout.rotated_generation("quiver.wal") is None
    assert layout.rotated_generation("quiver.wal.12.4096.corrupt") is None
    name = layout.wal_quarantine_name(3, 4096, "torn")
    assert name == "quiver.wal.3.4096.torn"
    assert layout.parse_wal_quarantine_name(name) == (3, 4096, "torn")


def test_layout_shard_of_finds_the_shard_directory() -> None:
    assert layout.shard_of(Path("/d/shard-2/segments/1.qseg")) == ShardLayout(Path("/d/shard-2"))
    assert layout.shard_of(Path("/d/shard-2")) == ShardLayout(Path("/d/shard-2"))
    with pytest.raises(ValueError, match="not inside a shard-<n> directory"):
        layout.shard_of(Path("/d/elsewhere/ack.log"))


def test_layout_markers_and_temp_files() -> None:
    assert layout.is_marker("FLOOR") and layout.is_marker("DELETED.tmp")
    assert not layout.is_marker("0000000000000001.qseg")
    assert layout.is_segment_tmp("0000000000000001.qseg.tmp")
    assert layout.tmp_path(Path("/d/x")) == Path("/d/x.tmp")
