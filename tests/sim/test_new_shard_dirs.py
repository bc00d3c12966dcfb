"""Found by the core model: a new shard's directories were created and never made durable
(a new directory is only a name in its parent until the parent is fsynced), so a power
cut soon after the first start could take the shard's WAL, ack.log and subscribers."""

from __future__ import annotations

from pathlib import Path

from quiverd.kernel import fs
from quiverd.kernel.durable import make_dirs
from tests.sim.modelfs import Cut, ModelFS


def test_make_dirs_new_directories_survive_a_power_cut(tmp_path: Path) -> None:
    model = ModelFS(tmp_path)
    previous = fs.install(model)
    try:
        make_dirs(tmp_path / "shard-0" / "wal")
        make_dirs(tmp_path / "shard-0" / "segments")
        make_dirs(tmp_path / "shard-0" / "segments")  # already there: nothing to do
    finally:
        fs.install(previous)
    kept = model.state.image(Cut(0, "none")).dirs
    assert {"shard-0", "shard-0/wal", "shard-0/segments"} <= kept


def test_plain_mkdir_is_not_durable_in_the_model(tmp_path: Path) -> None:
    """The test above can fail: without the parents' fsync the cut loses the names."""
    model = ModelFS(tmp_path)
    model.mkdir(tmp_path / "shard-0" / "wal")
    assert "shard-0/wal" not in model.state.image(Cut(0, "none")).dirs
