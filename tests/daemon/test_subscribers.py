"""Subscribers end to end: delivery, acks, deletion, out-of-order marks, crash, retention."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import anyio
import pytest

from quiverd.client import Client, subscribe
from quiverd.net.admin import request
from tests.daemon.helpers import tagged_table
from tests.tiers import size

FAST = {"shards": 1, "segment.max_open_duration_ms": 50}


def add(d: Any, name: str, start: str = "earliest") -> None:
    request(d.admin_socket, "subscribers.add", {"name": name, "start": start})


def produce(d: Any, tags: list[int], client: str = "p") -> list[Any]:
    with Client.connect(d.socket) as c:
        return c.send_many([tagged_table(t) for t in tags], client=client)


def segment_files(d: Any) -> list[int]:
    return sorted(int(p.stem) for p in (d.data_dir / "shard-0/segments").glob("*.qseg"))


def announced(d: Any) -> int:
    """Segments the daemon has finalized *and* recorded in ack.log."""
    return sum(s["segments"] for s in d.status()["shards"])


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def consume(d: Any, name: str, *, want: int, ack: Any = lambda b: True,
            idle_s: float = 2.0) -> list[Any]:
    """Receive until ``want`` bundles arrived (or idle); ack those ``ack`` accepts."""
    got: list[Any] = []

    async def run() -> None:
        async with subscribe(d.socket, name, window=256) as deliveries:
            while len(got) < want:
                with anyio.move_on_after(idle_s) as scope:
                    b = await anext(deliveries)
                if scope.cancelled_caught:
                    return
                got.append(b)
                if ack(b):
                    await b.ack()
            await anyio.sleep(0.2)  # let the last acks reach the daemon

    anyio.run(run)
    return got


def test_segment_is_deleted_only_when_every_subscriber_acked_it(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "a")
    add(d, "b")
    for batch in range(3):  # three segments (age trigger between batches)
        produce(d, [batch * 10 + i for i in range(4)])
        wait_for(lambda n=batch: announced(d) == n + 1)
    segs = segment_files(d)
    consume(d, "a", want=12)
    time.sleep(0.3)
    assert segment_files(d) == segs  # b acked nothing: nothing deleted
    oldest = segs[0]
    got = consume(d, "b", want=12, ack=lambda b: b.id[1] == oldest)
    assert len(got) == 12
    wait_for(lambda: segment_files(d) == segs[1:])  # exactly the oldest went
    metrics = d.status()["metrics"]
    assert metrics["quiver_gc_evictions_total"] == {"acked": 1}
    assert metrics["quiver_subscriber_lag"]["b"]["lag_segments"] == 2
    assert d.stop() == 0


def test_out_of_order_acks_hold_the_mark_until_the_gap_closes_and_survive_restart(
        daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "s")
    for batch in range(3):
        produce(d, [batch])
        wait_for(lambda n=batch: announced(d) == n + 1)
    s1, s2, s3 = segment_files(d)
    consume(d, "s", want=3, ack=lambda b: b.id[1] != s1)  # ack 2 and 3, not 1
    time.sleep(0.3)
    assert segment_files(d) == [s1, s2, s3]  # the mark cannot pass the gap at s1
    lag = d.status()["metrics"]["quiver_subscriber_lag"]["s"]
    assert lag["lag_segments"] == 3
    assert d.stop() == 0
    d.start()  # gap set rebuilt from ack.log
    got = consume(d, "s", want=3)
    assert [b.id[1] for b in got] == [s1]  # only the gap is redelivered
    wait_for(lambda: segment_files(d) == [])  # mark converged past all three
    assert d.stop() == 0


def test_from_latest_sees_only_new_data_from_earliest_sees_everything(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "keeper")  # holds old segments so they stay retained
    produce(d, [1, 2])
    wait_for(lambda: announced(d) == 1)
    add(d, "late", "latest")
    add(d, "early", "earliest")
    produce(d, [3])
    wait_for(lambda: announced(d) == 2)
    late = consume(d, "late", want=3, idle_s=1.0)
    early = consume(d, "early", want=3, idle_s=1.0)
    assert [b.tables[0]["tag"][0].as_py() for b in late] == [3]
    assert sorted(b.tables[0]["tag"][0].as_py() for b in early) == [1, 2, 3]
    assert d.stop() == 0


def test_nack_is_redelivered_with_backoff(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "n")
    produce(d, [7])
    seen: list[float] = []

    async def run() -> None:
        async with subscribe(d.socket, "n") as deliveries:
            async for b in deliveries:
                seen.append(time.monotonic())
                if len(seen) < 3:
                    await b.nack()
                else:
                    await b.ack()
                    return

    anyio.run(run)
    assert len(seen) == 3
    assert seen[1] - seen[0] >= 0.04 and seen[2] - seen[1] >= 0.09  # 0.1 s·2^n, jitter ≥ 0.5
    wait_for(lambda: segment_files(d) == [])
    assert d.stop() == 0


def test_remove_releases_the_subscribers_hold(daemon_factory):
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "stuck")
    produce(d, [1])
    wait_for(lambda: announced(d) == 1)
    add(d, "other", "latest")
    request(d.admin_socket, "subscribers.remove", {"name": "stuck"})
    produce(d, [2])
    consume(d, "other", want=1)
    wait_for(lambda: segment_files(d) == [])
    assert d.stop() == 0


def test_kill_before_floor_write_then_gc_does_not_reuse_the_segment_number(daemon_factory):
    # A kill between a segment's rename and its FLOOR write left FLOOR one behind;
    # once that segment was acked and deleted, its number was handed out again and
    # ack.log took the new segment for a deleted one's orphan: acked data vanished.
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50})
    d.start(faults="finalize=kill:dir_fsynced")
    add(d, "x")
    with Client.connect(d.socket) as c:
        c.send_many([tagged_table(t) for t in range(4)], client="p")
    assert d.wait(20) == -9  # the first segment is durable, FLOOR was never written
    first = segment_files(d)
    assert len(first) == 1
    d.start()
    assert {b.tables[0]["tag"][0].as_py() for b in consume(d, "x", want=4)} == {0, 1, 2, 3}
    wait_for(lambda: segment_files(d) == [])  # acked by x: deleted
    assert d.stop() == 0
    d.start()
    produce(d, [10, 11])
    assert {b.tables[0]["tag"][0].as_py() for b in consume(d, "x", want=2)} == {10, 11}
    assert d.stop() == 0
    assert not d.events("segment_orphan_removed")
    floor = (d.data_dir / "shard-0/segments/FLOOR").read_text()
    assert int(floor.split(":")[1].strip(" }\n")) > first[0]


class Consumer(threading.Thread):
    """Acks everything it receives; records which ids it acked (the ack may be lost)."""

    def __init__(self, d: Any, name: str) -> None:
        super().__init__(daemon=True)
        self.d, self.name = d, name
        self.received: list[tuple[int, int, int]] = []
        self.tags: dict[tuple[int, int, int], int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        async def main() -> None:
            async with subscribe(self.d.socket, self.name) as deliveries:
                async for b in deliveries:
                    self.received.append(b.id)
                    self.tags[b.id] = b.tables[0]["tag"][0].as_py()
                    await b.ack()
                    if self.stop.is_set():
                        return
        try:
            anyio.run(main)
        except Exception:
            pass  # killed under us


@pytest.mark.slow
def test_kill_9_during_ingest_delivery_and_acks_keeps_at_least_once(daemon_factory):
    rng = random.Random(int(os.environ.get("QUIVERD_CRASH_SEED", "99")))
    # 5 kills in the default tier, 20 in the full (tests/tiers.py); the env var wins.
    iterations = size(5, 20, env="QUIVERD_CRASH_ITERATIONS")
    d = daemon_factory({"shards": 2, "segment.max_open_duration_ms": 30})
    d.start()
    add(d, "x")
    add(d, "y")
    acked_tags: set[int] = set()
    seen: dict[str, set[int]] = {"x": set(), "y": set()}
    tag = 0
    for _ in range(iterations):
        d.start() if d.proc.poll() is not None else None
        consumers = [Consumer(d, "x"), Consumer(d, "y")]
        for c in consumers:
            c.start()
        stop_at = time.monotonic() + rng.uniform(0.1, 0.5)
        try:
            with Client.connect(d.socket) as c:
                while time.monotonic() < stop_at:
                    tags = list(range(tag, tag + 4))
                    tag += 4
                    c.send_many([tagged_table(t) for t in tags], client=f"c{tag % 3}")
                    acked_tags.update(tags)
        except Exception:
            pass
        d.kill()
        for c in consumers:
            c.join(10)
            seen[c.name].update(c.tags.values())
    d.start()
    for name in ("x", "y"):  # drain: everything acked to a producer reaches every subscriber
        got = consume(d, name, want=len(acked_tags) + 1000, idle_s=2.0)
        seen[name].update(b.tables[0]["tag"][0].as_py() for b in got)
        missing = acked_tags - seen[name]
        assert not missing, f"{name} never received {sorted(missing)[:10]}"
    assert d.stop() == 0


def test_durable_ack_is_not_delivered_again_after_restart(daemon_factory):
    d = daemon_factory(FAST).start()
    add(d, "z")
    produce(d, list(range(10)))
    first = consume(d, "z", want=10)
    assert len(first) == 10
    d.kill()  # acks were made durable before the daemon applied them (group commit)
    d.start()
    again = consume(d, "z", want=10, idle_s=1.0)
    assert again == []
    assert d.stop() == 0


def test_removing_an_attached_subscriber_ends_its_connection_with_an_error(daemon_factory):
    from quiverd.kernel.errors import ProtocolError

    d = daemon_factory(FAST, in_process=True).start()
    add(d, "gone")
    produce(d, [1])
    outcome: list[BaseException] = []

    async def run() -> None:
        try:
            with anyio.fail_after(10):
                async with subscribe(d.socket, "gone") as deliveries:
                    async for b in deliveries:
                        await anyio.to_thread.run_sync(
                            lambda: request(d.admin_socket, "subscribers.remove",
                                            {"name": "gone"}))
                        del b  # never acked
        except ProtocolError as exc:
            outcome.append(exc)

    anyio.run(run)
    assert outcome and "was removed" in str(outcome[0])
    assert d.stop() == 0


def test_window_shared_across_shards_never_stalls_delivery(daemon_factory):
    """Window 1 with a backlog on both shards: an ack on one shard must wake the other."""
    from quiverd.net.ingest import shard_of

    d = daemon_factory({"shards": 2, "segment.max_open_duration_ms": 50}, in_process=True).start()
    add(d, "w")
    names = {shard_of(f"c{i}", 2): f"c{i}" for i in range(20)}
    assert len(names) == 2
    for shard, client in names.items():
        produce(d, [shard * 100 + i for i in range(15)], client=client)
    wait_for(lambda: sum(s["segments"] for s in d.status()["shards"]) >= 2)
    got: list[Any] = []

    async def run() -> None:
        with anyio.fail_after(30):
            async with subscribe(d.socket, "w", window=1) as deliveries:
                async for b in deliveries:
                    got.append(b.id)
                    await b.ack()
                    if len(got) == 30:
                        return

    anyio.run(run)
    assert len(set(got)) == 30
    assert {i[0] for i in got} == {0, 1}
    assert d.stop() == 0


def test_config_subscribers_are_registered_at_startup(daemon_factory):
    d = daemon_factory(FAST, in_process=True)
    with open(d.config_path, "a") as f:
        f.write('\n[[subscribers]]\nname = "from-config"\nstart = "earliest"\n')
    d.start()
    names = [s["name"] for s in request(d.admin_socket, "subscribers.list")]
    assert names == ["from-config"]
    produce(d, [1])
    assert [b.tables[0]["tag"][0].as_py() for b in consume(d, "from-config", want=1)] == [1]
    assert d.stop() == 0
    d.start()  # registered once, not again on every start
    assert [s["name"] for s in request(d.admin_socket, "subscribers.list")] == ["from-config"]
    assert d.stop() == 0


def test_reject_is_final_survives_kill_9_and_lets_the_segment_go(daemon_factory):
    """REJECT_BUNDLE: the bundle is done for that subscriber (never delivered to it
    again, also after a kill -9), other subscribers still get it, and the segment is
    deleted once every subscriber is done with it."""
    d = daemon_factory(FAST).start()
    add(d, "r")
    add(d, "other")
    produce(d, [1, 2, 3])
    wait_for(lambda: announced(d) == 1)
    seen: list[int] = []

    async def run() -> None:
        async with subscribe(d.socket, "r", window=8) as deliveries:
            async for b in deliveries:
                tag = b.tables[0]["tag"][0].as_py()
                seen.append(tag)
                await (b.reject() if tag == 2 else b.ack())
                if len(seen) == 3:
                    await anyio.sleep(0.3)  # let the answers reach the daemon
                    return

    anyio.run(run)
    assert sorted(seen) == [1, 2, 3]
    assert d.status()["metrics"]["quiver_subscriber_rejects_total"] == {"r": 1}
    d.kill()
    d.start()
    assert consume(d, "r", want=3, idle_s=1.0) == []  # neither the acked nor the rejected
    segs = segment_files(d)
    assert len(segs) == 1  # "other" holds it
    other = consume(d, "other", want=3)
    assert sorted(b.tables[0]["tag"][0].as_py() for b in other) == [1, 2, 3]
    wait_for(lambda: segment_files(d) == [])
    assert d.stop() == 0


def test_a_version_1_subscriber_keeps_working_and_cannot_send_reject(daemon_factory):
    import socket

    from quiverd.protocol import codec as p

    d = daemon_factory(FAST, in_process=True).start()
    add(d, "v1")
    produce(d, [5, 6])
    wait_for(lambda: announced(d) == 1)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(d.socket))
        s.sendall(p.encode_hello(p.Role.SUBSCRIBER, min_version=1, max_version=1)
                  + p.encode_subscribe("v1", 4))
        dec = p.FrameDecoder(1 << 24, from_client=False)
        got: list[Any] = []
        while sum(isinstance(m, p.Delivery) for m in got) < 2:
            got += dec.feed(s.recv(1 << 20))
        assert isinstance(got[0], p.HelloOk) and got[0].version == 1
        first = next(m for m in got if isinstance(m, p.Delivery))
        s.sendall(p.encode_ack_bundle(first.shard, first.segment_seq, first.bundle_index))
        time.sleep(0.3)  # its own read batch (a batch with a bad frame is dropped whole)
        s.sendall(p.encode_reject_bundle(0, first.segment_seq, 1))
        errors: list[Any] = []
        while not errors:
            data = s.recv(1 << 20)
            assert data, "closed without an ERROR"
            errors = [m for m in dec.feed(data) if isinstance(m, p.Error)]
    assert errors[0].code == p.ErrorCode.MALFORMED
    assert "REJECT_BUNDLE needs protocol version 2" in errors[0].message
    again = consume(d, "v1", want=2, idle_s=1.0)  # the ack before it was kept
    assert [b.tables[0]["tag"][0].as_py() for b in again] == [6]
    assert d.stop() == 0
