"""``quiverd fsck DATA_DIR --lake`` and ``quiverd files list`` on a real lake: a
`quiverd serve` writes the files (SQLite + fs), then, with the daemon stopped, one
object is removed and another damaged; the CLI runs as a subprocess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quiverd.lake.model import FileState
from tests.daemon.lake_damage import flip_in_data_page, send_files
from tests.daemon.lake_helpers import FAST_LAKE, quiverd_cli, uri_path

pytestmark = pytest.mark.timeout(180)


def files_list(d: Any) -> dict[str, dict[str, Any]]:
    done = quiverd_cli("files", "list", "--config", str(d.config_path), "--json")
    assert done.returncode == 0, done.stderr
    return {r["file_id"]: r for r in json.loads(done.stdout)}


def test_fsck_lake_reports_missing_and_damaged_objects_and_repairs(daemon_factory: Any
                                                                   ) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}, in_process=True).start()
    gone, bad, good = send_files(d, 3)
    assert d.stop() == 0
    Path(uri_path(gone.uri)).unlink()
    flip_in_data_page(uri_path(bad.uri))
    config, data = str(d.config_path), str(d.data_dir)

    listed = files_list(d)
    assert {k: v["object"] for k, v in listed.items()} == {
        gone.file_id: "MISSING", bad.file_id: "ok", good.file_id: "ok"}
    text = quiverd_cli("files", "list", "--config", config).stdout
    assert "MISSING" in text and "1 file without a readable object" in text

    done = quiverd_cli("fsck", data, "--lake", "--config", config)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "healthy" in out.splitlines()[0] or "shards" in out.splitlines()[0]
    assert (f"FINDING  lake_object_missing  {gone.uri}: lake file {gone.file_id} (client "
            f"floats slot 0, {gone.row_count} rows) is registered but the store has no "
            "object: `quiverd files restore FILE_ID --from PATH` puts a backup back") in out
    assert f"FINDING  lake_object_corrupt  {bad.uri}: lake file {bad.file_id}" in out
    assert "CRC-32C" in out and "--lake --repair` quarantines it" in out
    assert good.uri not in out and "2 lake findings" in out

    # Stat only, with the embedded defaults (no --config): the damage has the same size.
    done = quiverd_cli("fsck", data, "--lake", "--no-crc")
    assert done.returncode == 1 and "lake_object_missing" in done.stdout
    assert "lake_object_corrupt" not in done.stdout and "checked for size in" in done.stdout

    done = quiverd_cli("fsck", data, "--lake", "--config", config, "--repair", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    lake = json.loads(done.stdout.splitlines()[-1])["lake"]
    assert [f["file_id"] for f in lake["findings"]] == [gone.file_id]
    assert [f["file_id"] for f in lake["lost"]] == [bad.file_id]
    assert lake["repairs"][0]["to"].endswith(bad.object_key.split("/")[-1])
    assert "/objects/quarantine/client=floats/" in lake["repairs"][0]["to"]
    assert (d.data_dir / "objects" / "quarantine" / bad.object_key).exists()

    listed = files_list(d)
    assert listed[bad.file_id]["state"] == FileState.QUARANTINED.value
    assert listed[bad.file_id]["object"] == "quarantined"
    again = quiverd_cli("fsck", data, "--lake", "--config", config)
    assert again.returncode == 1
    assert f"LOST  lake file {bad.file_id} (client floats slot 0, {bad.row_count} rows" in \
        again.stdout and "its rows are not in the lake" in again.stdout
    assert "1 lake finding; 1 quarantined lake file (LOST above)" in again.stdout


def test_fsck_lake_healthy_lake_and_no_lake(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}, in_process=True).start()
    send_files(d, 1)
    assert d.stop() == 0
    done = quiverd_cli("fsck", str(d.data_dir), "--lake", "--config", str(d.config_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lake: 1 files" in done.stdout and done.stdout.rstrip().endswith("lake healthy")
    other = tmp_path / "other.toml"
    other.write_text(f'data_dir = "{tmp_path}"\n')
    refused = quiverd_cli("fsck", str(d.data_dir), "--lake", "--config", str(other))
    assert refused.returncode == 1 and "data_dir" in refused.stderr
    assert "hint:" in refused.stderr


def test_files_restore_and_forget_clear_fsck_lake(daemon_factory: Any, tmp_path: Path) -> None:
    """The commands the hints name, as an operator runs them: a quarantined file is put
    back from a backup (fsck healthy again, the row live), another is forgotten (fsck
    lists it as KNOWN and exits 0)."""
    d = daemon_factory({**FAST_LAKE, "shards": 1}, in_process=True).start()
    back, lost, good = send_files(d, 3)
    assert d.stop() == 0
    backup = tmp_path / "backup.parquet"
    backup.write_bytes(Path(uri_path(back.uri)).read_bytes())
    for row in (back, lost):
        flip_in_data_page(uri_path(row.uri))
    config, data = str(d.config_path), str(d.data_dir)
    done = quiverd_cli("fsck", data, "--lake", "--config", config, "--repair")
    assert done.returncode == 1 and "2 quarantined lake files (LOST above)" in done.stdout
    assert f"`quiverd files restore {back.file_id} --from PATH` puts a backup back" in done.stdout

    wrong = quiverd_cli("files", "restore", back.file_id, "--from", uri_path(good.uri),
                        "--config", config)
    assert wrong.returncode == 1 and f"is not lake file {back.file_id}" in wrong.stderr
    assert "hint:" in wrong.stderr
    done = quiverd_cli("files", "restore", back.file_id, "--from", str(backup),
                       "--config", config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"restored lake file {back.file_id} ({back.row_count} rows) from {backup}" in \
        done.stdout
    assert files_list(d)[back.file_id]["object"] == "ok"

    done = quiverd_cli("files", "forget", lost.file_id, "--config", config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"LOST  lake file {lost.file_id}")
    again = quiverd_cli("files", "forget", lost.file_id, "--config", config)
    assert "already recorded as lost" in again.stdout
    assert lost.file_id not in files_list(d)  # the default listing: live and quarantined

    done = quiverd_cli("fsck", data, "--lake", "--config", config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"KNOWN  lake file {lost.file_id}" in done.stdout and "LOST" not in done.stdout
    assert done.stdout.rstrip().endswith("lake healthy")
    assert "lake: 2 files" in done.stdout
