"""The lake is a subscriber: its faults put it in a ``degraded`` state, never stop
ingest or the daemon. Real parts: moto's S3 server, the suite's PostgreSQL, real
daemons; ``status``, ``/metrics`` and ``/healthz`` say what is degraded and why."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.daemon.lake_helpers import (
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
    quiverd_cli,
    send_logs,
    wait_degraded,
    wait_for_lake,
)
from tests.daemon.test_metrics import scrape

pytestmark = pytest.mark.timeout(180)


def s3_settings(options: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"lake.store.scheme": "s3", "lake.store.root": "lake",
                           "lake.store.retry_base_ms": 20, "lake.store.retry_max_ms": 200,
                           "lake.store.max_attempts": 2, "lake.store.timeout_ms": 3000}
    out.update({f"lake.store.options.{k}": v for k, v in options.items()})
    return out


def healthz(address: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_lake_missing_bucket_degraded_ingest_goes_on_then_catches_up(
        daemon_factory: Any, s3_server: Any, s3_bucket: dict[str, str]) -> None:
    s3 = s3_server.client()
    missing = s3_bucket["bucket"] + "-later"
    d = daemon_factory({**FAST_LAKE, "metrics.listen": "127.0.0.1:0",
                        **s3_settings({**s3_bucket, "bucket": missing})}, in_process=True).start()
    [event] = d.events("metrics_listening")
    sent = send_logs(d, clients=2, batches=3)
    lake = wait_degraded(d, "store")
    store = lake["degraded"]["store"]
    assert store["kind"] == "missing", store
    assert "NoSuchBucket" in store["error"] or "bucket" in store["error"].lower(), store
    assert store["since_ns"] > 0 and store["hint"]
    assert lake["state"] == "degraded"
    # Ingest keeps acknowledging while the lake waits.
    started = time.monotonic()
    sent.update(send_logs(d, clients=2, batches=3, start=3))
    assert time.monotonic() - started < 10
    assert d.running
    samples = scrape(event["address"])
    assert samples["quiver_lake_degraded"][(("kind", "missing"), ("part", "store"))] == 1
    code, body = healthz(event["address"])
    assert code == 503 and body["status"] == "degraded", body
    assert "lake.store" in body["degraded"], body
    s3.create_bucket(Bucket=missing)
    try:
        wait_for_lake(d, sent, timeout=90)
        rows, tables = lake_contents(d, s3)
        assert_exactly_once(rows, tables, sent)
        deadline = time.monotonic() + 20
        while d.status()["lake"]["degraded"]:
            assert time.monotonic() < deadline, d.status()["lake"]
            time.sleep(0.1)
        assert healthz(event["address"])[0] == 200
        samples = scrape(event["address"])
        assert sum(samples.get("quiver_lake_degraded", {}).values()) == 0
        assert d.stop() == 0
    finally:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=missing):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=missing, Key=obj["Key"])
        s3.delete_bucket(Bucket=missing)


def test_lake_unreachable_store_status_shows_last_error_and_since(
        daemon_factory: Any, s3_bucket: dict[str, str]) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = daemon_factory({**FAST_LAKE, **s3_settings(
        {**s3_bucket, "endpoint": f"http://127.0.0.1:{port}"})}, in_process=True).start()
    before = time.time_ns()
    send_logs(d, clients=1, batches=2)
    lake = wait_degraded(d, "store")
    store = lake["degraded"]["store"]
    assert store["kind"] == "unavailable", store
    assert store["error"] and store["since_ns"] >= before - 10**9, store
    assert lake["pending_files"] >= 1 and lake["pending_bytes"] > 0, lake
    cli = quiverd_cli("status", "--socket", str(d.admin_socket))
    assert cli.returncode == 0, cli.stderr
    assert "degraded" in cli.stdout and "store" in cli.stdout, cli.stdout
    assert d.events("lake_degraded")
    assert d.stop() == 0


def test_lake_postgres_down_degraded_catalog_then_recovers(
        daemon_factory: Any, postgres_server: Any, pg_catalog_dsn: str) -> None:
    d = daemon_factory({**FAST_LAKE, "catalog.dsn": pg_catalog_dsn,
                        "metrics.listen": "127.0.0.1:0"}, in_process=True).start()
    [event] = d.events("metrics_listening")
    sent = send_logs(d, clients=1, batches=2)
    wait_for_lake(d, sent)
    postgres_server.stop("immediate")
    try:
        sent.update(send_logs(d, clients=1, batches=3, start=2))
        lake = wait_degraded(d, "catalog")
        assert lake["degraded"]["catalog"]["kind"] == "unavailable"
        code, body = healthz(event["address"])
        assert code == 503 and "lake.catalog" in body["degraded"], body
    finally:
        postgres_server.start()
    wait_for_lake(d, sent, timeout=90)
    deadline = time.monotonic() + 30
    while d.status()["lake"]["degraded"]:
        assert time.monotonic() < deadline, d.status()["lake"]
        time.sleep(0.2)
    assert healthz(event["address"])[0] == 200
    assert d.events("lake_restored")
    assert d.stop() == 0
