"""The lake is a subscriber: its faults put it in a ``degraded`` state, never stop
ingest or the daemon. Real parts: moto's S3 server, the suite's PostgreSQL, real
daemons; ``status``, ``/metrics`` and ``/healthz`` say what is degraded and why."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from quiverd.kernel.errors import QuiverError
from tests.daemon.lake_helpers import (
    FAST_LAKE,
    assert_exactly_once,
    lake_contents,
    send_logs,
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


def wait_degraded(d: Any, part: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            lake = d.status()["lake"]
        except QuiverError as exc:
            d.proc.poll()
            raise AssertionError(f"daemon gone ({d.proc.returncode}):\n{d.log()[-3000:]}") from exc
        if part in lake.get("degraded", {}):
            return lake
        assert time.monotonic() < deadline, lake
        time.sleep(0.1)


def test_lake_missing_bucket_degraded_ingest_goes_on_then_catches_up(
        daemon_factory: Any, s3_server: Any, s3_bucket: dict[str, str]) -> None:
    s3 = s3_server.client()
    missing = s3_bucket["bucket"] + "-later"
    d = daemon_factory({**FAST_LAKE, "metrics.listen": "127.0.0.1:0",
                        **s3_settings({**s3_bucket, "bucket": missing})}).start()
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
    assert d.proc.poll() is None
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
