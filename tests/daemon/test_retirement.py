"""Retirement (runtime.retirement): an abandoned subscriber does not stop ingest.

A real in-process daemon with a 6 MiB size cap under ``backpressure``: a producer keeps
sending, a live subscriber consumes everything, a second one is registered and never
read. The abandoned one is retired (event, metric, reason kept across a restart) before
the cap holds ingest back; one whose consumer is connected is never retired.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from typing import Any

import anyio
import pytest

from quiverd.client import Client, subscribe
from quiverd.client.consumer import RangedReader
from quiverd.kernel.errors import ProtocolError
from quiverd.net.admin import request
from tests.daemon.test_retention import BUNDLE, CAP, SMALL, Sampler
from tests.daemon.test_subscribers import add

RETIRE = {**SMALL, "retention.retire_grace_s": 0.2}
SEND_EVERY_S = 0.04  # ~5 MB/s of ~200 KB bundles: a steady producer, not a burst


class Producer(threading.Thread):
    """Sends ``count`` bundles, one every ``SEND_EVERY_S``; notes when each was acked."""

    def __init__(self, d: Any, count: int) -> None:
        super().__init__(daemon=True)
        self.d, self.count = d, count
        self.error: Exception | None = None
        self.acked_at: list[float] = []

    def run(self) -> None:
        try:
            with Client.connect(self.d.socket) as c:
                for _ in range(self.count):
                    c.send(BUNDLE, client="p")
                    self.acked_at.append(time.time())
                    time.sleep(SEND_EVERY_S)
        except Exception as exc:
            self.error = exc


class Consumer(threading.Thread):
    """Subscriber ``name`` attached the whole time, acking everything (``ack``) or nothing."""

    def __init__(self, d: Any, name: str, *, ack: bool = True) -> None:
        super().__init__(daemon=True)
        self.d, self.name, self.ack = d, name, ack
        self.got, self.stop, self.attached = 0, threading.Event(), threading.Event()

    def run(self) -> None:
        async def main() -> None:
            # Cancelled as a whole at the stop: a cancelled ``anext`` would end the
            # subscription (and detach it) on its own.
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read)
                await anyio.to_thread.run_sync(self.stop.wait)
                tg.cancel_scope.cancel()

        anyio.run(main)

    async def _read(self) -> None:
        async with subscribe(self.d.socket, self.name, window=256) as deliveries:
            self.attached.set()
            async for b in deliveries:
                self.got += 1
                if self.ack:
                    await b.ack()


def refusal(d: Any, name: str) -> str:
    """What a consumer coming back as ``name`` is told (SUBSCRIBE, and a ranged reader's
    open with ``register``, as Spark's stream source sends it)."""
    async def attach() -> None:
        async with subscribe(d.socket, name) as deliveries:
            await anext(deliveries)

    with pytest.raises(ProtocolError) as pushed:
        anyio.run(attach)
    with RangedReader.connect(d.socket) as r, pytest.raises(ProtocolError) as ranged:
        r.open(name, register=True, holder="a query")
    assert str(ranged.value) == str(pushed.value)
    return str(pushed.value)


def test_abandoned_subscriber_is_retired_before_the_cap_holds_ingest(daemon_factory):
    d = daemon_factory(RETIRE, in_process=True).start()
    add(d, "live")
    add(d, "abandoned")
    live = Consumer(d, "live")
    live.start()
    assert live.attached.wait(10)
    sampler, producer = Sampler(d.data_dir), Producer(d, 120)  # ~24 MB through 6 MiB
    sampler.start()
    started = time.time()
    producer.start()
    producer.join(120)
    sampler.stop.set()
    assert producer.error is None and len(producer.acked_at) == 120
    metrics = d.status()["metrics"]
    assert metrics["quiver_ingest_throttle_total"] == 0  # ingest never waited for the cap
    assert metrics["quiver_subscribers_retired_total"] == {"lag_bytes": 1}
    [event] = d.events("subscriber_retired")
    assert event["level"] == "error" and event["subscriber"] == "abandoned"
    assert event["reason"] == "lag_bytes" and CAP // 2 <= event["lag_bytes"] < CAP
    assert "quiverd subscribers add abandoned" in event["hint"]
    names = [s["name"] for s in request(d.admin_socket, "subscribers.list")]
    assert names == ["live"]
    [retired] = d.status()["retired_subscribers"]
    assert retired["name"] == "abandoned" and retired["reason"] == "lag_bytes"
    text = refusal(d, "abandoned")
    assert "was retired" in text and "quiverd subscribers add abandoned" in text
    live.stop.set()
    live.join(10)
    # The figures the report quotes.
    at = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    before = sum(t <= at for t in producer.acked_at)
    print(f"\nretired {at - started:.2f} s after the producer started, after {before} "
          f"bundles acked, at lag {event['lag_bytes']} bytes (threshold {CAP // 2}, cap "
          f"{CAP}); peak disk {sampler.peak} bytes; 120 bundles in "
          f"{producer.acked_at[-1] - started:.1f} s, 0 throttled")

    assert d.stop() == 0
    d.start()  # the retirement survives a restart: removed in ack.log, reason kept
    assert [s["name"] for s in request(d.admin_socket, "subscribers.list")] == ["live"]
    assert d.status()["retired_subscribers"][0]["name"] == "abandoned"
    assert refusal(d, "abandoned") == text
    add(d, "abandoned")  # re-adding clears the mark, in memory and on disk
    assert d.status()["retired_subscribers"] == []
    assert json.loads((d.data_dir / "retired.json").read_text())["retired"] == []
    with RangedReader.connect(d.socket) as r:
        assert r.open("abandoned", holder="a query")["shards"] == 1
    assert d.stop() == 0


def test_connected_consumer_that_lags_is_not_retired(daemon_factory):
    d = daemon_factory(RETIRE, in_process=True).start()
    add(d, "slow")
    slow = Consumer(d, "slow", ack=False)  # attached, never acks: lags like an abandoned one
    slow.start()
    assert slow.attached.wait(10)
    producer = Producer(d, 20)  # ~4 MB: past the 3 MiB lag threshold, below the cap
    producer.start()
    producer.join(60)
    assert producer.error is None
    lag = d.status()["metrics"]["quiver_subscriber_lag"]["slow"]["lag_bytes"]
    assert lag >= CAP // 2
    time.sleep(1.0)  # five grace periods
    assert d.status()["metrics"]["quiver_subscribers_retired_total"] == {}
    assert [s["name"] for s in request(d.admin_socket, "subscribers.list")] == ["slow"]
    slow.stop.set()
    slow.join(10)
    assert d.stop() == 0


def test_cap_filled_within_the_grace_holds_ingest_only_until_the_retirement(
        daemon_factory):
    """Abandoned and at the cap within its grace: ingest waits for the rest of the grace
    (a consumer coming back in it keeps its subscriber), then goes on by itself."""
    grace_s = 3.0
    d = daemon_factory({**SMALL, "retention.retire_grace_s": grace_s},
                       in_process=True).start()
    add(d, "live")
    add(d, "abandoned")
    live = Consumer(d, "live")
    live.start()
    assert live.attached.wait(10)
    started = time.monotonic()
    gaps = []
    with Client.connect(d.socket) as c:
        last = started
        for _ in range(120):  # unpaced: the cap is reached within the grace
            c.send(BUNDLE, client="p")
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
    metrics = d.status()["metrics"]
    assert metrics["quiver_subscribers_retired_total"] == {"lag_bytes": 1}
    assert metrics["quiver_ingest_throttle_total"] >= 1
    assert max(gaps) < grace_s + 2.0  # held back at most for the grace (and a sweep)
    print(f"\nat the cap within a {grace_s} s grace: longest wait for an ack "
          f"{max(gaps):.2f} s, 120 bundles in {time.monotonic() - started:.1f} s, "
          f"throttled appends {metrics['quiver_ingest_throttle_total']}")
    live.stop.set()
    live.join(10)
    assert d.stop() == 0


def test_retirement_survives_kill_9(daemon_factory):
    d = daemon_factory(RETIRE).start()  # a process of its own, to kill
    add(d, "live")
    add(d, "abandoned")
    live = Consumer(d, "live")
    live.start()
    assert live.attached.wait(10)
    producer = Producer(d, 30)  # ~6 MB: past the 3 MiB lag limit
    producer.start()
    producer.join(60)
    assert producer.error is None
    assert d.status()["metrics"]["quiver_subscribers_retired_total"] == {"lag_bytes": 1}
    d.kill()  # the remove is durable in ack.log, the reason in retired.json
    live.stop.set()
    live.join(10)
    d.start()
    assert [s["name"] for s in request(d.admin_socket, "subscribers.list")] == ["live"]
    assert "was retired" in refusal(d, "abandoned")
    d.stop()


def test_retired_file_mark_of_a_registered_name_is_void_and_damage_is_reported(
        daemon_factory):
    """A crash between the mark and the removes leaves the subscriber registered: the mark
    is dropped at the next start; an unreadable file is reported and does not stop it."""
    d = daemon_factory(RETIRE, in_process=True).start()
    add(d, "kept")
    assert d.stop() == 0
    path = d.data_dir / "retired.json"
    path.write_text('{"version":1,"retired":[{"name":"kept","reason":"lag_bytes",'
                    '"lag_bytes":1,"idle_s":1.0,"retired_at_ns":1}]}\n')
    d.start()
    assert d.status()["retired_subscribers"] == []
    assert json.loads(path.read_text())["retired"] == []
    with RangedReader.connect(d.socket) as r:
        assert r.open("kept")["shards"] == 1
    assert d.stop() == 0
    path.write_text("{not json")
    d.start()
    [event] = d.events("retired_file_unreadable")
    assert event["level"] == "warning" and "rewritten" in event["hint"]
    assert [s["name"] for s in request(d.admin_socket, "subscribers.list")] == ["kept"]
    assert d.stop() == 0
