"""Prometheus: GET /metrics serves the one registry that `status --json` reads too."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiverd.client import Client
from quiverd.net.admin import request
from tests.daemon.helpers import tagged_table

DESIGN_NAMES = ("quiver_gc_evictions_total", "quiver_ingest_throttle_total",
                "quiver_subscriber_dropped_bundles_total", "quiver_segment_dropped_total",
                "quiver_core_bytes", "quiver_core_cap_fraction")


def scrape(address: str, path: str = "/metrics") -> dict[str, dict[tuple[Any, ...], float]]:
    """Samples by name; every family the endpoint declares is a key, samples or not."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, dict[tuple[Any, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name, {})
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(samples: dict[str, dict[tuple[Any, ...], float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


def test_metrics_endpoint_serves_design_names_and_latencies(daemon_factory: Any) -> None:
    d = daemon_factory({"metrics.listen": "127.0.0.1:0", "retention.size_cap_bytes": 1 << 30,
                        "segment.max_open_duration_ms": 100}, in_process=True).start()
    [event] = d.events("metrics_listening")
    address = event["address"]
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i) for i in range(25)], client="m")
    deadline = time.monotonic() + 10
    while sum(s["segments_finalized"] for s in d.status()["shards"]) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    samples = scrape(address)
    for name in DESIGN_NAMES:
        assert name.removesuffix("_total") in samples, name
    assert samples["quiver_gc_evictions_total"][(("reason", "acked"), ("shard", "0"))] == 0
    assert total(samples, "quiver_bundles_acked_total") == 25
    assert total(samples, "quiver_ack_latency_seconds_count") == 25
    assert total(samples, "quiver_wal_fdatasync_seconds_count") >= 1
    assert set(samples["quiver_core_bytes"]) == {(("core_id", "0"),), (("core_id", "1"),)}
    assert 0 < max(samples["quiver_core_cap_fraction"].values()) < 1
    assert total(samples, "quiver_segments_finalized_total") >= 1
    # status --json reads the same registry.
    status = request(d.admin_socket, "status")
    assert status["metrics"]["quiver_bundles_acked_total"] == 25
    assert sum(s["acks"] for s in status["shards"]) == 25
    with pytest.raises(urllib.error.HTTPError) as not_found:
        scrape(address, "/nope")
    assert not_found.value.code == 404
    not_found.value.close()


def test_metrics_endpoint_is_off_by_default(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1}, in_process=True).start()
    assert d.events("metrics_listening") == []
    assert "quiver_gc_evictions_total" in d.status()["metrics"]
