"""The lake end to end: `quiverd serve` turns ingested bundles into verified Parquet
objects registered in the catalog, exactly once, with the embedded defaults (fs +
SQLite) and with PostgreSQL + S3 (moto), through crashes and a catalog outage."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from quiverd.lake.model import FileState
from tests.daemon.lake_helpers import (
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
    logs_table,
    produce_through_kills,
    quiverd_cli,
    registered_rows,
    send_logs,
    uri_path,
    wait_for_lake,
)

pytestmark = pytest.mark.timeout(180)


def _wait_lag_zero(d: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lag = d.status()["metrics"]["quiver_subscriber_lag"].get("uploader", {})
        if lag.get("lag_bundles") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"uploader still lags: {d.status()['metrics']}")


def test_lake_embedded_defaults_upload_register_index_evict(daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "lake.iceberg.enabled": True}, in_process=True).start()
    sent = send_logs(d, clients=2, batches=12)
    rows = wait_for_lake(d, sent)
    _wait_lag_zero(d)
    rows, tables = lake_contents(d)
    assert_exactly_once(rows, tables, sent)
    objects = d.data_dir / "objects"
    for row in rows:
        path = uri_path(row.uri)
        assert path.startswith(f"{objects}/client={row.client_name}/slot={row.slot}/")
        assert Path(path).stat().st_size == row.compressed_size
        meta = pq.read_metadata(path)
        assert meta.row_group(0).column(0).compression == "ZSTD"
        assert row.crc32c and row.schema_hash and row.start_ts <= row.end_ts
    # The values themselves round-trip: every (client, batch, i) of slot 0, once.
    slot0 = pa.concat_tables([tables[r.file_id].select(["client_no", "batch", "i", "msg"])
                              for r in rows if r.slot == 0])
    want = pa.concat_tables([logs_table(k, b) for k in range(2) for b in range(12)])
    assert sorted(slot0.to_pylist(), key=str) == sorted(want.to_pylist(), key=str)
    # Indexed, then evicted (delete_after_upload): nothing left in staging.
    deadline = time.monotonic() + 20
    while any(r.state != FileState.EVICTED for r in registered_rows(d)):
        assert time.monotonic() < deadline, [r.state for r in registered_rows(d)]
        time.sleep(0.2)
    assert not list((d.data_dir / "staging" / "stable").iterdir())
    assert (d.data_dir / "catalog.sqlite").exists()
    # The CLI sees the same files, and status shows the lake.
    listed = json.loads(quiverd_cli("files", "list", "--config", str(d.config_path),
                                 "--json").stdout)
    assert {f["file_id"] for f in listed} == {r.file_id for r in rows}
    shown = json.loads(quiverd_cli("files", "show", rows[0].file_id, "--config",
                                str(d.config_path), "--json").stdout)
    assert {z["column"] for z in shown["zone_maps"]} >= {"_quiver_ingested_at"}
    lake = d.status()["lake"]
    assert lake["state"] == "running" and lake["files_uploaded"] == len(rows)
    # On by default: the Iceberg projection commits the registered files.
    deadline = time.monotonic() + 30
    while d.status()["lake"]["iceberg"].get("commits", 0) < 1:
        assert time.monotonic() < deadline, (d.status()["lake"]["iceberg"], d.log()[-3000:])
        time.sleep(0.2)
    # Every lifecycle step was logged with its file id.
    for step in ("received", "appended", "rotated", "uploaded", "metaregistered",
                 "indexed", "evicted"):
        assert d.events(f"lake_file_{step}"), step
    assert d.stop() == 0


def test_lake_schema_drift_reads_back_equal(daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "lake.file_duration_ms": 1500}, in_process=True).start()
    words = pa.array(["a", "b", "c", "a"])
    tables = [
        pa.table({"k": pa.array([1, 2, 3, 4], pa.int32()), "w": words}),
        pa.table({"k": pa.array([5, 6, 7, 8], pa.int64()),
                  "w": words.dictionary_encode().cast(pa.dictionary(pa.uint8(), pa.utf8()))}),
        pa.table({"k": pa.array([9, 10, 11, 12], pa.int64()),
                  "w": words.dictionary_encode().cast(pa.dictionary(pa.uint16(), pa.utf8())),
                  "extra": pa.array([0.5, None, 1.5, 2.5])}),
        pa.table({"w": words}),  # k missing
    ]
    with pytest.importorskip("quiverd.client").Client.connect(d.socket) as c:
        for t in tables:
            c.send(t, client="drift")
    rows = wait_for_lake(d, Counter({("drift", 0): 16}))
    _, objects = lake_contents(d)
    back = pa.concat_tables([objects[r.file_id] for r in rows], promote_options="default")
    got = sorted(zip(back["k"].to_pylist(), back["w"].to_pylist(),
                     back["extra"].to_pylist() if "extra" in back.column_names
                     else [None] * back.num_rows, strict=True), key=str)
    want = sorted([(k, w, None) for k, w in zip(range(1, 9), ["a", "b", "c", "a"] * 2,
                                                 strict=True)]
                  + [(9, "a", 0.5), (10, "b", None), (11, "c", 1.5), (12, "a", 2.5)]
                  + [(None, w, None) for w in ["a", "b", "c", "a"]], key=str)
    assert got == want
    assert d.stop() == 0


@pytest.mark.parametrize("step", ["appended", "rotated", "object_written", "uploaded",
                                  "registered", "acked", "indexed"])
def test_lake_kill9_at_each_step_exactly_once(daemon_factory: Any, step: str) -> None:
    settings = {**FAST_LAKE, "lake.janitor.grace_s": 0}
    d = daemon_factory(settings).start(faults=f"lake=kill:{step}")
    sent = send_logs(d, clients=2, batches=6)
    assert d.wait(30) == -9, d.log()[-3000:]  # the fault fired
    d.start()
    more = send_logs(d, clients=2, batches=3, start=6)
    sent.update(more)
    rows = wait_for_lake(d, sent)
    _wait_lag_zero(d)
    rows, tables = lake_contents(d)
    assert_exactly_once(rows, tables, sent)
    if step == "registered":  # registered, never acked: redelivered, recognised, acked
        assert d.status()["lake"]["bundles_already_registered"] > 0
    # Whatever the crash left behind (an object without a registered row) is an orphan
    # the janitor removes; afterwards every object belongs to a live row.
    out = quiverd_cli("janitor", "--config", str(d.config_path), "--json")
    assert out.returncode == 0, out.stderr
    objects = {str(p) for p in (d.data_dir / "objects").rglob("*.parquet")}
    assert objects == {uri_path(r.uri) for r in registered_rows(d)}
    assert d.stop() == 0


@pytest.mark.slow
def test_lake_kill9_under_load_exactly_once(daemon_factory: Any) -> None:
    """kill -9 at random moments while producers send and the uploader works: after the
    last restart every acknowledged batch is in the lake, and no row twice. (A bundle
    made durable whose ack the kill cut off may be there too: that is at least once for
    the producer, never a duplicate.)"""
    d = daemon_factory({**FAST_LAKE, "lake.file_duration_ms": 150}).start()

    def bundle(k: int, b: int) -> dict[int, pa.Table]:
        t = logs_table(k, b, rows=20)
        return {0: t, 1: t.slice(0, 1)}

    acked = produce_through_kills(d, bundle)  # (client_no, batch)
    # Enough to mean something; not a throughput bound (a clean clone's loaded run
    # acked 40 in its two rounds of 0.3-1.5 s, against an earlier bound of 50).
    assert len(acked) > 10
    deadline = time.monotonic() + 90
    while True:
        _wait_lag_zero(d, timeout=90)
        rows, tables = lake_contents(d)
        slot0 = [tables[r.file_id] for r in rows if r.slot == 0]
        seen = [(k, b, i) for t in slot0 for k, b, i in zip(
            t["client_no"].to_pylist(), t["batch"].to_pylist(), t["i"].to_pylist(),
            strict=True)]
        assert len(seen) == len(set(seen)), "a row is in the lake twice"
        if acked <= {(k, b) for k, b, _ in seen}:
            break
        assert time.monotonic() < deadline, f"{len(acked - {(k, b) for k, b, _ in seen})} "
        time.sleep(0.5)
    sent = Counter({(r.client_name, r.slot): 0 for r in rows})
    for r in rows:
        sent[(r.client_name, r.slot)] += r.row_count
    assert_exactly_once(rows, tables, sent)  # every (bundle, slot) in one file only
    batches0 = {(k, b) for k, b, _ in seen}
    batches1 = {(k, b) for t in (tables[r.file_id] for r in rows if r.slot == 1)
                for k, b in zip(t["client_no"].to_pylist(), t["batch"].to_pylist(),
                                strict=True)}
    assert batches0 == batches1  # both slots of every bundle, rejoinable
    assert d.stop() == 0


def test_lake_full_disk_fails_the_file_then_catches_up(daemon_factory: Any,
                                                       short_dir: Path) -> None:
    """The data directory's disk fills up while the uploader has a file to write: the
    file is abandoned and its bundles nacked, nothing acknowledged is lost, and the lake
    catches up, exactly once, when space returns."""
    from quiverd.client import Client
    from tests.daemon.mounts import fill, mounted_tmpfs

    d = daemon_factory({**FAST_LAKE, "shards": 1, "lake.file_duration_ms": 1500,
                        "lake.compression_level": 1}, in_process=True)
    with mounted_tmpfs(d.data_dir, 96 * 1024 * 1024):
        d.start()
        sent: Counter[tuple[str, int]] = Counter()
        with Client.connect(d.socket) as c:
            for b in range(8):  # ~1 MiB of hard-to-compress text per bundle
                t = pa.table({"batch": [b] * 4000,
                              "msg": [os.urandom(120).hex() for _ in range(4000)]})
                c.send(t, client="big")
                sent[("big", 0)] += t.num_rows
        time.sleep(0.3)  # sealed into a segment; the uploader rotates at 1.5 s
        filler = d.data_dir / "filler"
        fill(filler)  # every byte left: the Parquet write (or the catalog) finds none
        deadline = time.monotonic() + 30
        while not (d.events("lake_file_failed") or d.events("lake_catalog_unavailable")):
            assert time.monotonic() < deadline, d.log()[-3000:]
            time.sleep(0.1)
        assert d.running, "the daemon exited"
        assert registered_rows(d) == []
        filler.unlink()
        wait_for_lake(d, sent, timeout=90)
        _wait_lag_zero(d)
        rows, tables = lake_contents(d)
        assert_exactly_once(rows, tables, sent)
        assert d.stop() == 0
