"""Operators' endpoints and gauges, by real HTTP requests to an in-process daemon:
``/livez`` (the loop answers, whatever the lake), ``/readyz`` (appends are taken),
``quiver_build_info``, ``quiver_lost_bytes_total{reason}`` counted by a real drop, expiry
and corruption, and the storage utilisation gauge; ``status --json`` shows the same."""

from __future__ import annotations

import json
import platform
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import quiverd
from quiverd.client import Client
from quiverd.net.admin import request
from quiverd.segments.reader import SegmentReader
from tests.daemon.helpers import flip, tagged_table
from tests.daemon.lake_helpers import FAST_LAKE, quiverd_cli, send_logs, wait_degraded
from tests.daemon.test_io_errors import SMALL_WAL
from tests.daemon.test_lake_degraded import s3_settings
from tests.daemon.test_metrics import scrape
from tests.daemon.test_recovery_loss import two_segments_released
from tests.daemon.test_retention import BUNDLE, Producer
from tests.daemon.test_retention import SMALL as RETAINED
from tests.daemon.test_subscribers import add, consume, produce, wait_for

# Their stalled subscriber must stay (retention.retire_* would retire it, by design,
# before the cap these tests reach: tests/daemon/test_retirement.py covers that).
SMALL = {**RETAINED, "retention.retire_after_lag_bytes": 0}

pytestmark = pytest.mark.timeout(120)


def get(address: str, path: str) -> tuple[int, dict[str, Any]]:
    """One GET; the status code and the JSON body (503s included)."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as resp:
            assert resp.headers["Content-Type"] == "application/json"
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def started(daemon_factory: Any, settings: dict[str, Any]) -> tuple[Any, str]:
    d = daemon_factory({**settings, "metrics.listen": "127.0.0.1:0"}, in_process=True).start()
    [event] = d.events("metrics_listening")
    return d, event["address"]


def lost_bytes(address: str) -> dict[str, float]:
    """quiver_lost_bytes_total by reason, summed over shards."""
    out: dict[str, float] = {}
    for labels, value in scrape(address)["quiver_lost_bytes_total"].items():
        reason = dict(labels)["reason"]
        out[reason] = out.get(reason, 0) + value
    return out


def test_probes_livez_readyz_and_build_info_on_a_running_daemon(daemon_factory: Any) -> None:
    d, address = started(daemon_factory, {"shards": 2})
    code, live = get(address, "/livez")
    assert code == 200 and live["status"] == "alive", live
    assert live["version"] == quiverd.__version__ and live["uptime_s"] > 0
    assert get(address, "/readyz") == (200, {"status": "ready", "reasons": []})
    assert get(address, "/healthz")[0] == 200
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i) for i in range(5)], client="p")
    samples = scrape(address)
    [(labels, one)] = samples["quiver_build_info"].items()
    assert one == 1 and dict(labels)["version"] == quiverd.__version__
    assert dict(labels)["python"] == platform.python_version() and dict(labels)["pyarrow"]
    assert samples["quiver_ready"] == {(): 1}
    # Every reason is exported from the start, at 0.
    assert lost_bytes(address) == {"drop_oldest": 0, "expired": 0, "corrupt": 0}
    # No size cap: held bytes over the filesystem's.
    [ratio] = samples["quiver_storage_utilisation_ratio"].values()
    [free] = samples["quiver_storage_free_bytes"].values()
    assert 0 < ratio < 1 and free > 0
    status = request(d.admin_socket, "status")
    assert status["ready"] == {"status": "ready", "reasons": []}
    storage = status["storage"]
    assert storage["cap_bytes"] == 0 and storage["filesystem_bytes"] > storage["used_bytes"] > 0
    assert storage["utilisation_ratio"] == pytest.approx(
        storage["used_bytes"] / storage["filesystem_bytes"])
    assert status["build"]["version"] == quiverd.__version__
    assert status["metrics"]["quiver_lost_bytes_total"] == {}
    assert d.stop() == 0


def test_probes_livez_200_while_the_lake_is_degraded(daemon_factory: Any) -> None:
    # The store does not answer: /healthz says degraded (503), but the daemon is alive
    # and takes writes, so a liveness probe must not restart it (nor readiness route
    # producers away).
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d, address = started(daemon_factory, {**FAST_LAKE, **s3_settings({
        "bucket": "nowhere", "endpoint": f"http://127.0.0.1:{port}", "region": "us-east-1",
        "access_key_id": "quiverd-test", "secret_access_key": "quiverd-test-secret",
        "disable_config_load": "true", "disable_ec2_metadata": "true"})})
    send_logs(d, clients=1, batches=2)
    wait_degraded(d, "store")
    code, health = get(address, "/healthz")
    assert code == 503 and "lake.store" in health["degraded"], health
    code, live = get(address, "/livez")
    assert code == 200 and live["status"] == "alive", live
    assert get(address, "/readyz") == (200, {"status": "ready", "reasons": []})
    send_logs(d, clients=1, batches=2, start=2)  # and it does take them
    assert d.stop() == 0


def test_probes_readyz_503_at_the_size_cap_then_200_after_acks(daemon_factory: Any) -> None:
    d, address = started(daemon_factory, SMALL)
    add(d, "stalled")
    producer = Producer(d)
    producer.start()
    wait_for(lambda: time.monotonic() - producer.last_ack > 1.5, timeout=30)  # it waits
    blocked_at = producer.acks
    code, ready = get(address, "/readyz")
    assert code == 503 and ready["status"] == "not_ready", ready
    [reason] = ready["reasons"]
    assert reason.startswith("shard 0: at its retention size cap"), reason
    assert get(address, "/livez")[0] == 200  # alive all the same
    samples = scrape(address)
    assert samples["quiver_ready"] == {(): 0}
    assert samples["quiver_storage_utilisation_ratio"][()] >= 1
    status = request(d.admin_socket, "status")
    assert status["ready"]["reasons"] == [reason]
    assert status["storage"]["cap_bytes"] == SMALL["retention.size_cap_bytes"]
    assert status["storage"]["utilisation_ratio"] >= 1
    cli = quiverd_cli("status", "--socket", str(d.admin_socket))
    assert cli.returncode == 0, cli.stderr
    assert "ready NO" in cli.stdout and f"NOT READY {reason}" in cli.stdout, cli.stdout
    consume(d, "stalled", want=blocked_at, idle_s=1.0)  # the subscriber catches up
    wait_for(lambda: producer.acks > blocked_at + 3, timeout=20)
    producer.stop.set()
    producer.join(20)
    # The producer went on until the cap again: drain everything, then it is ready.
    consume(d, "stalled", want=producer.acks, idle_s=1.0)
    wait_for(lambda: get(address, "/readyz")[0] == 200, timeout=20)
    assert lost_bytes(address) == {"drop_oldest": 0, "expired": 0, "corrupt": 0}
    assert d.stop() == 0


def deleted_bytes(d: Any, reason: str) -> int:
    return sum(e["bytes"] for e in d.events("segments_deleted") if e["reason"] == reason)


def settled(address: str, d: Any, reason: str, gc_reason: str) -> dict[str, float]:
    """Lost bytes once the gc's last batch is logged and nothing moved for 0.3 s (a batch
    is counted before its unlink and logged after it)."""
    last: Any = None
    deadline = time.monotonic() + 20
    while True:
        now = (lost_bytes(address), deleted_bytes(d, gc_reason))
        if now == last and now[0][reason] == now[1]:
            return now[0]
        assert time.monotonic() < deadline, now
        last = now
        time.sleep(0.3)


def test_lost_bytes_drop_oldest_counts_the_segments_dropped(daemon_factory: Any) -> None:
    d, address = started(daemon_factory, {**SMALL, "retention.size_cap_policy": "drop_oldest"})
    add(d, "stalled")
    with Client.connect(d.socket) as c:
        for _ in range(60):  # ~12 MB through a 6 MiB cap
            c.send(BUNDLE, client="p")
    wait_for(lambda: d.status()["metrics"]["quiver_gc_evictions_total"].get("size_cap", 0)
             >= 2)
    lost = settled(address, d, "drop_oldest", "size_cap")
    # "stalled" acked nothing: every segment the cap deleted was lost to it, whole.
    assert lost["drop_oldest"] == deleted_bytes(d, "size_cap") > 2 * 1_000_000
    assert lost["expired"] == lost["corrupt"] == 0
    assert get(address, "/readyz")[0] == 200  # drop_oldest never holds producers back
    assert d.status()["metrics"]["quiver_lost_bytes_total"] == {"drop_oldest": lost[
        "drop_oldest"]}
    assert d.stop() == 0


def test_lost_bytes_expired_counts_what_max_age_deleted_unread(daemon_factory: Any) -> None:
    d, address = started(daemon_factory, {"shards": 1, "segment.max_open_duration_ms": 50,
                                           "retention.max_age_s": 1})
    add(d, "slow")
    produce(d, [1, 2, 3])
    wait_for(lambda: d.status()["metrics"]["quiver_gc_evictions_total"].get("max_age", 0) >= 1,
             timeout=15)
    lost = settled(address, d, "expired", "max_age")
    assert lost["expired"] == deleted_bytes(d, "max_age") > 0
    assert lost["drop_oldest"] == lost["corrupt"] == 0
    assert d.stop() == 0


def test_lost_bytes_expired_not_counted_for_segments_every_subscriber_had(
        daemon_factory: Any) -> None:
    d, address = started(daemon_factory, {"shards": 1, "segment.max_open_duration_ms": 50,
                                           "retention.max_age_s": 1})
    add(d, "fast")
    produce(d, [1, 2, 3])
    consume(d, "fast", want=3)
    wait_for(lambda: d.status()["metrics"]["quiver_gc_evictions_total"].get("acked", 0) >= 1,
             timeout=15)
    time.sleep(1.5)  # past max_age: nothing is left to expire
    assert lost_bytes(address)["expired"] == 0
    assert d.stop() == 0


def test_lost_bytes_corrupt_counts_a_segment_the_scrubber_quarantined(
        daemon_factory: Any) -> None:
    settings = {"shards": 1, "segment.max_open_duration_ms": 50, "scrub.rate_mb_per_s": 50,
                "metrics.listen": "127.0.0.1:0"}
    d = daemon_factory(settings, in_process=True).start()
    request(d.admin_socket, "subscribers.add", {"name": "s", "start": "earliest"})
    newest, _ = two_segments_released(d)  # stops the daemon
    size = newest.stat().st_size
    flip(newest, 200)  # inside the first stream's IPC file: startup does not read it
    d.start()
    [event] = d.events("metrics_listening")[-1:]
    address = event["address"]
    wait_for(lambda: d.status()["shards"][0]["scrub"]["quarantined"])
    wait_for(lambda: lost_bytes(address)["corrupt"] > 0)
    assert lost_bytes(address) == {"drop_oldest": 0, "expired": 0, "corrupt": size}
    assert d.status()["metrics"]["quiver_lost_bytes_total"] == {"corrupt": size}
    assert d.stop() == 0


def test_lost_bytes_corrupt_counts_a_segment_quarantined_at_startup(daemon_factory: Any) -> None:
    # A flip in the manifest: the metadata CRC catches it at startup; the WAL released
    # the segment's bundles, so they are lost, and the file's bytes with them.
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "metrics.listen": "127.0.0.1:0"}, in_process=True).start()
    request(d.admin_socket, "subscribers.add", {"name": "s", "start": "earliest"})
    newest, _ = two_segments_released(d)
    size = newest.stat().st_size
    with SegmentReader.open(newest) as reader:
        footer = reader.footer
    flip(newest, footer.manifest_offset + footer.manifest_length // 2)
    d.start()
    assert d.status()["shards"][0]["quarantined_segments"]
    [event] = d.events("metrics_listening")[-1:]
    assert lost_bytes(event["address"]) == {"drop_oldest": 0, "expired": 0, "corrupt": size}
    d.stop()
    d.start()  # reported once: the next start finds nothing more to count
    [event] = d.events("metrics_listening")[-1:]
    assert lost_bytes(event["address"])["corrupt"] == 0
    assert d.stop() == 0


class Sender(threading.Thread):
    """Sends small bundles until told to stop (or refused)."""

    def __init__(self, d: Any) -> None:
        super().__init__(daemon=True)
        self.d, self.acks, self.stop, self.error = d, 0, threading.Event(), None
        self.last_ack = time.monotonic()

    def run(self) -> None:
        try:
            with Client.connect(self.d.socket) as c:
                while not self.stop.is_set():
                    c.send(tagged_table(self.acks, rows=200), client="p")
                    self.acks += 1
                    self.last_ack = time.monotonic()
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc  # type: ignore[assignment]


def wait_not_ready(address: str, starts: str, timeout: float = 20) -> list[str]:
    """Poll /readyz until one of its reasons starts with ``starts``; returns them all."""
    deadline = time.monotonic() + timeout
    while True:
        code, ready = get(address, "/readyz")
        if code == 503 and any(r.startswith(starts) for r in ready["reasons"]):
            assert ready["status"] == "not_ready"
            return list(ready["reasons"])
        assert time.monotonic() < deadline, ready
        time.sleep(0.02)


def test_probes_readyz_503_while_the_wal_is_full_then_200(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    # No segment can be written while the gate file exists, so nothing releases the WAL
    # (two 32 KiB files) and appends wait for room: the daemon is alive, not ready.
    gate = tmp_path / "finalize.gate"
    gate.touch()
    d = daemon_factory({**SMALL_WAL, "metrics.listen": "127.0.0.1:0"}, in_process=True
                       ).start(faults=f"finalize.tmp_written=gate:{gate}")
    [event] = d.events("metrics_listening")
    address = event["address"]
    sender = Sender(d)
    sender.start()
    try:
        reasons = wait_not_ready(address, "shard 0: its WAL is full")
        assert get(address, "/livez")[0] == 200
        held = sender.acks
        time.sleep(0.5)
        assert sender.acks <= held + 1  # the producer does wait (one may have been in flight)
        assert wait_not_ready(address, "shard 0: its WAL is full", timeout=1)
        assert reasons == [r for r in reasons if r.startswith("shard 0: its WAL is full")]
    finally:
        gate.unlink()
    wait_for(lambda: get(address, "/readyz")[0] == 200, timeout=20)
    acked = sender.acks
    wait_for(lambda: sender.acks > acked + 5, timeout=20)  # appends taken again
    sender.stop.set()
    sender.join(20)
    assert sender.error is None, sender.error
    assert d.stop() == 0


def test_probes_readyz_503_while_the_wal_finds_no_space_then_200(daemon_factory: Any) -> None:
    # The 3rd to 8th WAL writes find no space (ENOSPC): retried with backoff (about 3 s
    # in all), appends held meanwhile, then written.
    d = daemon_factory({**SMALL_WAL, "metrics.listen": "127.0.0.1:0"}, in_process=True
                       ).start(faults="wal.write=enospc@3-8")
    [event] = d.events("metrics_listening")
    address = event["address"]
    sender = Sender(d)
    sender.start()
    wait_not_ready(address, "shard 0: the WAL finds no disk space", timeout=10)
    assert get(address, "/livez")[0] == 200
    wait_for(lambda: get(address, "/readyz")[0] == 200, timeout=20)
    acked = sender.acks
    wait_for(lambda: sender.acks > acked + 5, timeout=20)
    sender.stop.set()
    sender.join(20)
    assert sender.error is None, sender.error
    assert d.stop() == 0


def test_probes_readyz_503_while_stopping_livez_200(daemon_factory: Any, tmp_path: Path) -> None:
    # The open segment cannot be written while the gate file exists, so the stop's drain
    # (final segment) waits: the daemon is stopping, alive, and not ready.
    gate = tmp_path / "finalize.gate"
    d = daemon_factory({**SMALL_WAL, "metrics.listen": "127.0.0.1:0",
                        "segment.max_open_duration_ms": 600_000}, in_process=True
                       ).start(faults=f"finalize.tmp_written=gate:{gate}")
    [event] = d.events("metrics_listening")
    address = event["address"]
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(i) for i in range(3)], client="p")
    gate.touch()
    codes: list[int] = []
    stopper = threading.Thread(target=lambda: codes.append(d.stop()), daemon=True)
    stopper.start()
    try:
        reasons = wait_not_ready(address, "stopping", timeout=10)
        assert reasons == ["stopping: appends are refused with SHUTTING_DOWN"]
        code, live = get(address, "/livez")
        assert code == 200 and live["status"] == "alive", live
    finally:
        gate.unlink()
    stopper.join(30)
    assert codes == [0]
