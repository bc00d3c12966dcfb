"""The Iceberg projection in a running daemon: every client a table any engine reads,
exactly once under kill -9, reconciled after a crash, replaced by compaction, shared by
two daemons on one PostgreSQL catalog and one bucket."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from quiverd.client import Client
from tests.daemon.iceberg_helpers import duckdb_count, load, scan, wait_projected
from tests.daemon.lake_helpers import (
    FAST_LAKE,
    lake_contents,
    logs_table,
    produce_through_kills,
    quiverd_cli,
    registered_rows,
    send_logs,
    uri_path,
    wait_for_lake,
)
from tests.daemon.test_metrics import scrape, total

pytestmark = pytest.mark.timeout(240)
FAST_ICEBERG = {**FAST_LAKE, "lake.iceberg.enabled": True, "lake.iceberg.reconcile_interval_s": 0.5,
                "lake.iceberg.linger_ms": 50}


def _keys(t: pa.Table) -> list[tuple[int, int, int]]:
    return list(zip(t["client_no"].to_pylist(), t["batch"].to_pylist(), t["i"].to_pylist(),
                    strict=True))


def _drifting(k: int, b: int) -> pa.Table:
    """Rows whose schema drifts the way Iceberg can follow: every third batch adds a
    column, every fifth widens ``i`` from int32 to int64."""
    t = logs_table(k, b, rows=20)
    if b % 5 == 0:
        t = t.set_column(t.schema.get_field_index("i"), "i", t["i"].cast(pa.int32()))
    if b % 3 == 0:
        t = t.append_column("extra", pa.array([float(b)] * t.num_rows))
    return t


def test_iceberg_table_holds_every_row_once_and_duckdb_reads_it(daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_ICEBERG, "metrics.listen": "127.0.0.1:0"}, in_process=True).start()
    [event] = d.events("metrics_listening")
    sent = send_logs(d, clients=2, batches=8)
    # Nanosecond timestamps that are not whole microseconds: kept, so Iceberg cannot
    # hold the file; status, the CLI and the log must say so.
    with Client.connect(d.socket) as c:
        c.send({0: pa.table({"t": pa.array([1, 2, 3], pa.timestamp("ns", tz="UTC"))})},
               client="precise")
    sent[("precise", 0)] += 3
    wait_for_lake(d, sent)
    ice = wait_projected(d)
    assert ice["enabled"] and ice["commits"] >= 1 and ice["lag_s"] == 0
    rows, tables = lake_contents(d)
    for client in ("client-0", "client-1"):
        want = sorted(k for r in rows if r.client_name == client and r.slot == 0
                      for k in _keys(tables[r.file_id]))
        got = scan(d, f"quiver.{client}")
        assert sorted(_keys(got)) == want
        side = scan(d, f"quiver.{client}__slot1")
        assert side.num_rows == sent[(client, 1)]
        table = load(d, f"quiver.{client}")
        assert duckdb_count(table.metadata_location) == len(want)
        spec = table.spec()
        assert [f.transform.__class__.__name__ for f in spec.fields] == ["HourTransform"]
        snap = table.current_snapshot()
        assert snap is not None and snap.summary is not None
        ids = {i for s in table.snapshots() if s.summary is not None
               for i in (s.summary.additional_properties.get("quiverd.file-ids") or "").split(",")
               if i}
        assert ids >= {r.file_id for r in rows if r.client_name == client and r.slot == 0}
    assert ice["skipped"] == {"quiver.precise": {"files": 1, "rows": 3}}, ice
    [skip] = d.events("iceberg_file_skipped")
    assert skip["rows"] == 3 and "timestamp[ns" in skip["reason"] and skip["file_id"]
    plain = quiverd_cli("status", "--socket", str(d.admin_socket)).stdout
    assert "iceberg  lag_files 0  lag_s 0" in plain, plain
    assert "iceberg  quiver.precise  skipped_files 1  skipped_rows 3" in plain, plain
    samples = scrape(event["address"])
    assert total(samples, "quiver_lake_iceberg_lag_files") == 0
    assert total(samples, "quiver_lake_iceberg_lag_seconds") == 0
    assert total(samples, "quiver_lake_iceberg_commit_seconds_count") == ice["commits"]
    assert d.stop() == 0


def test_iceberg_reconciler_adds_a_file_the_crash_left_out_once(daemon_factory: Any) -> None:
    """Killed right after quiverd's catalog registered a file, before any Iceberg commit:
    after the restart the reconciler adds each registered file exactly once."""
    d = daemon_factory({**FAST_ICEBERG, "lake.janitor.grace_s": 0}).start(
        faults="lake=kill:registered")
    sent = send_logs(d, clients=1, batches=4, two_slots_every=0)
    assert d.wait(30) == -9, d.log()[-3000:]
    d.start()
    wait_for_lake(d, sent)
    wait_projected(d)
    rows = registered_rows(d)
    table = load(d, "quiver.client-0")
    files = table.inspect.files()
    paths = files["file_path"].to_pylist()
    assert len(paths) == len(set(paths)) == len(rows)
    assert sorted(_keys(table.scan().to_arrow())) == sorted(
        k for _, t in lake_contents(d)[1].items() for k in _keys(t))
    kinds = [s.summary.additional_properties.get("quiverd.kind") for s in table.snapshots()
             if s.summary is not None]
    assert "reconcile" in kinds, kinds
    assert d.stop() == 0


@pytest.mark.slow
def test_iceberg_exactly_once_under_kill9_with_drift(daemon_factory: Any) -> None:
    """kill -9 four times while files drift and compaction runs every second (the issue
    saw rows twice in the tables after such kills): every acked row once."""
    d = daemon_factory({**FAST_ICEBERG, "lake.file_duration_ms": 150,
                        "lake.compaction.interval_s": 1, "lake.compaction.min_files": 2,
                        "lake.compaction.delete_grace_s": 3600}).start()
    acked = produce_through_kills(d, _drifting, seed=20)
    assert len(acked) > 50
    deadline = time.monotonic() + 120
    while True:
        wait_projected(d, timeout=120)
        seen = [k for c in ("client-0", "client-1") for k in _keys(scan(d, f"quiver.{c}"))]
        assert len(seen) == len(set(seen)), "a row is in the Iceberg table twice"
        if acked <= {(k, b) for k, b, _ in seen}:
            break
        assert time.monotonic() < deadline, len(acked - {(k, b) for k, b, _ in seen})
        time.sleep(0.5)
    rows, tables = lake_contents(d)
    lake = sorted(k for r in rows if r.slot == 0 for k in _keys(tables[r.file_id]))
    assert sorted(seen) == lake
    assert d.events("lake_compacted"), "no compaction ran"
    widened = load(d, "quiver.client-0").schema()
    assert str(widened.find_field("i").field_type) == "long"
    assert widened.find_field("extra") is not None
    total = sum(duckdb_count(load(d, f"quiver.{c}").metadata_location)
                for c in ("client-0", "client-1"))
    assert total == len(lake)
    assert d.stop() == 0


def test_iceberg_compaction_is_one_replace_and_objects_outlive_snapshots(
        daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_ICEBERG, "lake.compaction.min_files": 2,
                        "lake.compaction.delete_grace_s": 0, "lake.janitor.grace_s": 0,
                        "lake.iceberg.keep_snapshots_s": 3600}, in_process=True).start()
    sent: Counter[tuple[str, int]] = Counter()
    for b in range(4):  # four files: one per rotation
        sent.update(send_logs(d, clients=1, batches=1, start=b, two_slots_every=0))
        wait_for_lake(d, sent)
        time.sleep(0.5)
    wait_projected(d)
    before = load(d, "quiver.client-0")
    old_paths = set(before.inspect.files()["file_path"].to_pylist())
    assert len(old_paths) >= 2
    keys_before = sorted(_keys(before.scan().to_arrow()))
    n_snapshots = len(before.snapshots())
    out = quiverd_cli("compact", "--config", str(d.config_path), "--json")
    assert out.returncode == 0, out.stderr
    wait_projected(d)
    after = load(d, "quiver.client-0")
    assert sorted(_keys(after.scan().to_arrow())) == keys_before
    new_paths = set(after.inspect.files()["file_path"].to_pylist())
    assert new_paths.isdisjoint(old_paths) and len(new_paths) < len(old_paths)
    replaces = [s for s in after.snapshots()[n_snapshots:] if s.summary is not None
                and s.summary.additional_properties.get("quiverd.kind") == "replace"]
    assert len(replaces) == 1  # delete old + add new in one snapshot
    # The replaced objects are still referenced by a live snapshot: the janitor keeps them.
    out = quiverd_cli("janitor", "--config", str(d.config_path), "--json")
    assert out.returncode == 0, out.stderr
    assert all(uri_path_exists(p) for p in old_paths)
    assert d.stop() == 0
    # Expire every snapshot but the current one: now the janitor deletes them.
    d.settings["lake.iceberg.keep_snapshots_s"] = 0.001
    d._write_config()
    d.start()
    wait_projected(d)
    out = quiverd_cli("janitor", "--config", str(d.config_path), "--json")
    assert out.returncode == 0, out.stderr
    assert not any(uri_path_exists(p) for p in old_paths), out.stdout
    assert len(load(d, "quiver.client-0").snapshots()) == 1
    assert sorted(_keys(scan(d, "quiver.client-0"))) == keys_before
    assert d.stop() == 0


def uri_path_exists(location: str) -> bool:
    from pathlib import Path
    return Path(uri_path(location) if location.startswith("file:") else location).exists()
