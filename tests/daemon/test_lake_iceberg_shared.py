"""Two daemons, one PostgreSQL catalog, one bucket (moto's S3): both project into the
same Iceberg tables through Iceberg's compare-and-swap; nothing lost or doubled."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.daemon.iceberg_helpers import load, scan, wait_projected
from tests.daemon.lake_helpers import FAST_LAKE, registered_rows, send_logs, wait_for_lake
from tests.daemon.test_lake_pg_s3 import _s3_settings

pytestmark = pytest.mark.timeout(240)


def test_iceberg_two_daemons_one_postgres_catalog_one_bucket(
        daemon_factory: Any, pg_catalog_dsn: str, s3_bucket: dict[str, str],
        s3_server: Any) -> None:
    shared = {**FAST_LAKE, "catalog.dsn": pg_catalog_dsn, **_s3_settings(s3_bucket),
              "lake.iceberg.enabled": True, "lake.iceberg.reconcile_interval_s": 0.5,
              "lake.iceberg.linger_ms": 20}
    a = daemon_factory({**shared, "lake.node_id": "node-a"}, name="a", in_process=True).start()
    b = daemon_factory({**shared, "lake.node_id": "node-b"}, name="b").start()
    sent = Counter[tuple[str, int]]()
    for start in range(0, 12, 3):  # interleaved: both commit to the same tables
        sent.update(send_logs(a, clients=2, batches=3, start=start))
        sent.update(send_logs(b, clients=2, batches=3, start=start))
    wait_for_lake(a, sent, timeout=90)
    for d in (a, b):
        wait_projected(d, timeout=90)
    rows = registered_rows(a)
    kw = {"dsn": pg_catalog_dsn, "s3": s3_bucket}
    for client in ("client-0", "client-1"):
        got = scan(a, f"quiver.{client}", **kw)
        assert got.num_rows == sent[(client, 0)]
        ids = list(zip(got["_quiver_shard"].to_pylist(), got["_quiver_segment"].to_pylist(),
                       got["_quiver_bundle"].to_pylist(), got["i"].to_pylist(),
                       got["client_no"].to_pylist(), strict=True))
        # A bundle id is per daemon; with the row's position it is unique per source.
        table = load(a, f"quiver.{client}", **kw)
        paths = table.inspect.files()["file_path"].to_pylist()
        mine = [r for r in rows if r.client_name == client and r.slot == 0]
        assert len(paths) == len(set(paths)) == len(mine)
        assert {p.rsplit("/", 1)[1] for p in paths} == {r.object_key.rsplit("/", 1)[1]
                                                         for r in mine}
        assert len(ids) == sent[(client, 0)]
        nodes = {s.summary.additional_properties.get("quiverd.node-id")
                 for s in table.snapshots() if s.summary is not None}
        assert {"node-a", "node-b"} <= nodes
        assert scan(a, f"quiver.{client}__slot1", **kw).num_rows == sent[(client, 1)]
    for d in (a, b):
        assert d.stop() == 0


def test_iceberg_catches_up_after_a_postgresql_outage(
        daemon_factory: Any, postgres_server: Any, pg_catalog_dsn: str) -> None:
    """The catalog database stops mid-run: ingest goes on, the lake and the projection
    wait; once it is back, the table holds every row once."""
    d = daemon_factory({**FAST_LAKE, "catalog.dsn": pg_catalog_dsn,
                        "lake.iceberg.enabled": True, "lake.iceberg.reconcile_interval_s": 0.5,
                        "lake.iceberg.linger_ms": 20}, in_process=True).start()
    sent = send_logs(d, clients=1, batches=4, two_slots_every=0)
    wait_for_lake(d, sent)
    wait_projected(d)
    postgres_server.stop("immediate")
    try:
        sent.update(send_logs(d, clients=1, batches=4, start=4, two_slots_every=0))
        import time
        deadline = time.monotonic() + 30
        while "catalog" not in d.status()["lake"].get("degraded", {}) \
                and "iceberg" not in d.status()["lake"].get("degraded", {}):
            assert time.monotonic() < deadline, d.log()[-3000:]
            time.sleep(0.2)
    finally:
        postgres_server.start()
    wait_for_lake(d, sent, timeout=90)
    ice = wait_projected(d, timeout=90)
    assert ice["last_error"] is None
    got = scan(d, "quiver.client-0", dsn=pg_catalog_dsn)
    keys = list(zip(got["batch"].to_pylist(), got["i"].to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) == sent[("client-0", 0)]
    assert "iceberg" not in d.status()["lake"]["degraded"]
    assert d.stop() == 0
