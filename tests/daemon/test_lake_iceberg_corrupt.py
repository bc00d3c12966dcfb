"""A damaged lake object and the Iceberg tables, in a running daemon: the scrub finds it
within one pass interval, and the file leaves the table at once (quarantine -> reconcile),
so pyiceberg and DuckDB, which do not check page checksums, stop being served its wrong
values within the bound docs/iceberg.md gives; `quiverd files restore` from a backup
then puts the file back into the table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest

from quiverd.lake.model import FileState
from tests.daemon.iceberg_helpers import duckdb_count, load, scan, wait_projected
from tests.daemon.lake_damage import ROWS, flip_in_data_page, send_files
from tests.daemon.lake_helpers import FAST_LAKE, quiverd_cli, uri_path

pytestmark = pytest.mark.timeout(180)
PASS_INTERVAL_S = 3
# The documented bound is max(pass_interval_s, lake bytes / rate) + one reconcile; this
# lake is 0.5 MB at 100 MB/s, and a loaded test box gets the slack.
BOUND_S = PASS_INTERVAL_S + 15
CONFIG = {**FAST_LAKE, "shards": 1, "lake.iceberg.enabled": True,
          "lake.iceberg.reconcile_interval_s": 0.5, "lake.iceberg.linger_ms": 50,
          "lake.scrub.pass_interval_s": PASS_INTERVAL_S, "lake.scrub.rate_mb_per_s": 100}


def table_files(d: Any) -> set[str]:
    """The data file locations of quiver.floats' current snapshot, as a reader sees it."""
    return {t.file.file_path for t in load(d, "quiver.floats").scan().plan_files()}


def seeds_ok(d: Any) -> dict[int, bool]:
    """Per seed in the table: do all its x values equal what was sent?"""
    t = scan(d, "quiver.floats")
    out: dict[int, bool] = {}
    for seed in set(t["seed"].to_pylist()):
        x = t.filter(pc.equal(t["seed"], seed))["x"].to_numpy()
        out[seed] = len(x) == ROWS and np.array_equal(
            np.sort(x), np.sort(np.random.default_rng(seed).random(ROWS)))
    return out


def test_damaged_object_leaves_the_iceberg_table_within_the_bound_then_restore_adds_it(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(CONFIG, in_process=True).start()
    rows = send_files(d, 3)
    wait_projected(d)
    assert seeds_ok(d) == {0: True, 1: True, 2: True}
    bad = rows[1]
    backup = tmp_path / "backup.parquet"
    backup.write_bytes(Path(uri_path(bad.uri)).read_bytes())
    before = table_files(d)
    assert any(bad.file_id in f for f in before)

    flip_in_data_page(uri_path(bad.uri))
    damaged_at = time.monotonic()
    while any(bad.file_id in f for f in table_files(d)):
        assert time.monotonic() - damaged_at < BOUND_S, d.log()[-3000:]
        time.sleep(0.2)
    took = time.monotonic() - damaged_at
    [event] = d.events("lake_object_corrupt")
    assert event["file_id"] == bad.file_id
    shown = quiverd_cli("files", "show", bad.file_id, "--json", "--config", str(d.config_path))
    assert json.loads(shown.stdout)["state"] == FileState.QUARANTINED.value
    # What readers see now: the other files, every value right; no garbage, no error.
    assert seeds_ok(d) == {0: True, 2: True}
    assert duckdb_count(load(d, "quiver.floats").metadata_location) == 2 * ROWS
    assert took <= BOUND_S
    scrub = d.status()["lake"]["scrub"]
    assert scrub["corrupt_found"] == 1 and scrub["last_pass_files"] >= 2
    assert PASS_INTERVAL_S <= scrub["check_every_s"] < BOUND_S  # the bound, as status says
    plain = quiverd_cli("status", "--socket", str(d.admin_socket)).stdout
    assert "scrub  check_every_s " in plain and "corrupt_found 1" in plain, plain

    done = quiverd_cli("files", "restore", bad.file_id, "--from", str(backup),
                       "--config", str(d.config_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the Iceberg projection adds it back at its next reconcile" in done.stdout
    deadline = time.monotonic() + 30
    while not any(bad.file_id in f for f in table_files(d)):
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.2)
    assert seeds_ok(d) == {0: True, 1: True, 2: True}
    assert d.stop() == 0
