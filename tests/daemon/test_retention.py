"""Retention: size cap with backpressure or drop_oldest, max age, ack.log damage."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.client import Client
from quiverd.kernel.errors import AtCapacity, ShuttingDown
from tests.daemon.helpers import tagged_table
from tests.daemon.test_subscribers import add, announced, consume, produce, wait_for

MiB = 1 << 20
CAP = 6 * MiB
TARGET = 1 * MiB
SMALL = {
    "shards": 1,
    "segment.max_open_duration_ms": 100,
    "segment.target_size_bytes": TARGET,
    "ingest.max_bundle_bytes": 1 * MiB,
    "wal.max_entry_bytes": 2 * MiB,
    "wal.max_chunks": 4,
    "wal.max_size_bytes": 4 * MiB,
    "retention.size_cap_bytes": CAP,
}
BUNDLE = tagged_table(0, rows=4000, text_bytes=40)  # ~200 KB of IPC


def disk_usage(path: Path) -> int:
    """Bytes really allocated under ``path`` (punched WAL holes do not count)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class Sampler(threading.Thread):
    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.peak, self.stop = path, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, disk_usage(self.path))
            time.sleep(0.1)


class Producer(threading.Thread):
    def __init__(self, d: Any) -> None:
        super().__init__(daemon=True)
        self.d, self.acks, self.stop, self.error = d, 0, threading.Event(), None
        self.last_ack = time.monotonic()

    def run(self) -> None:
        try:
            with Client.connect(self.d.socket) as c:
                while not self.stop.is_set():
                    c.send(BUNDLE, client="p")
                    self.acks += 1
                    self.last_ack = time.monotonic()
        except Exception as exc:
            self.error = exc


def test_backpressure_stalls_producers_within_the_cap_and_resumes_after_acks(daemon_factory):
    d = daemon_factory(SMALL, in_process=True).start()
    add(d, "stalled")
    sampler, producer = Sampler(d.data_dir), Producer(d)
    sampler.start()
    producer.start()
    wait_for(lambda: time.monotonic() - producer.last_ack > 1.5, timeout=30)  # it waits
    blocked_at = producer.acks
    assert d.status()["metrics"]["quiver_ingest_throttle_total"] >= 1
    # Cap + one segment + the WAL bound; the ack.log and markers are a few KiB.
    bound = CAP + TARGET + SMALL["wal.max_size_bytes"] + 64 * 1024
    assert sampler.peak <= bound, f"peak {sampler.peak} > bound {bound}"
    assert d.status()["metrics"]["quiver_gc_evictions_total"] == {}  # nothing acked deleted
    consume(d, "stalled", want=blocked_at, idle_s=1.0)  # the subscriber catches up
    wait_for(lambda: producer.acks > blocked_at + 3, timeout=20)  # ingest resumed by itself
    producer.stop.set()
    sampler.stop.set()
    assert d.stop() == 0  # a producer still waiting for room is refused, not held
    producer.join(20)
    assert producer.error is None or isinstance(producer.error, ShuttingDown | ConnectionError)


def test_backpressure_reject_answers_at_capacity(daemon_factory):
    d = daemon_factory({**SMALL, "wal.at_capacity": "reject"}, in_process=True).start()
    add(d, "stalled")
    with Client.connect(d.socket) as c, pytest.raises(AtCapacity):
        for _ in range(200):
            c.send(BUNDLE, client="p")
    assert d.status()["shards"][0]["rejected_at_capacity"] >= 1
    assert d.stop() == 0


def test_drop_oldest_records_dropped_and_keeps_the_cap(daemon_factory):
    d = daemon_factory({**SMALL, "retention.size_cap_policy": "drop_oldest"},
                       in_process=True).start()
    add(d, "stalled")
    sampler = Sampler(d.data_dir)
    sampler.start()
    produced = 0
    with Client.connect(d.socket) as c:
        for _ in range(120):  # ~24 MB through a 6 MiB cap: never blocks
            c.send(BUNDLE, client="p")
            produced += 1
    time.sleep(0.5)
    sampler.stop.set()
    metrics = d.status()["metrics"]
    dropped = metrics["quiver_subscriber_dropped_bundles_total"]["stalled"]
    evicted = metrics["quiver_gc_evictions_total"]["size_cap"]
    assert evicted >= 3 and metrics["quiver_segment_dropped_total"] == evicted
    lag = metrics["quiver_subscriber_lag"]["stalled"]
    assert lag["dropped_bundles"] == dropped
    # Every produced bundle is either dropped (recorded) or still pending: no silent loss.
    wait_for(lambda: announced(d) == d.status()["shards"][0]["segments"])
    pending = d.status()["metrics"]["quiver_subscriber_lag"]["stalled"]["lag_bundles"]
    open_bundles = d.status()["shards"][0]["open_bundles"]
    assert dropped + pending + open_bundles == produced
    bound = CAP + TARGET + SMALL["wal.max_size_bytes"] + 64 * 1024
    assert sampler.peak <= bound
    got = consume(d, "stalled", want=produced, idle_s=1.0)  # no permanent gap: drains
    assert len(got) == pending + open_bundles
    wait_for(lambda: d.status()["metrics"]["quiver_subscriber_lag"]["stalled"]["lag_segments"]
             == 0)
    assert d.stop() == 0


def test_max_age_deletes_expired_segments_and_counts_them(daemon_factory):
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50,
                        "retention.max_age_s": 1}, in_process=True).start()
    add(d, "slow")
    produce(d, [1, 2, 3])
    wait_for(lambda: announced(d) >= 1)
    wait_for(lambda: announced(d) == 0, timeout=10)
    wait_for(lambda: d.status()["metrics"]["quiver_gc_evictions_total"].get("max_age", 0) >= 1)
    metrics = d.status()["metrics"]
    assert metrics["quiver_subscriber_dropped_bundles_total"]["slow"] == 3
    assert d.stop() == 0


@pytest.mark.parametrize("damage", ["torn_tail", "flipped_byte"])
def test_damaged_ack_log_recovers_and_marks_are_never_ahead(daemon_factory, damage):
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True).start()
    add(d, "a")
    add(d, "keep")  # never acks: segments stay so redelivery can be observed
    for i in range(3):
        produce(d, [i])
        wait_for(lambda n=i: announced(d) == n + 1)
    consume(d, "a", want=3)
    assert d.stop() == 0
    log = d.data_dir / "shard-0/ack.log"
    data = bytearray(log.read_bytes())
    if damage == "torn_tail":
        log.write_bytes(bytes(data[:-7]))  # cut the last record (an outcome or checkpoint)
    else:
        data[len(data) // 2] ^= 0x20
        log.write_bytes(bytes(data))
    d.start()
    # Whatever the damage cost, "a" gets back at least what is no longer durably acked,
    # and never less: the mark is never ahead of the durable acks.
    redelivered = consume(d, "a", want=3, idle_s=1.0)
    lag = d.status()["metrics"]["quiver_subscriber_lag"]["a"]
    assert lag["lag_bundles"] == 0
    assert len(redelivered) <= 3
    assert d.stop() == 0
