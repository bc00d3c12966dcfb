"""Crash tests: kill -9 at random moments, injected fdatasync failures, stalled fdatasync.

Every test runs the real daemon as a subprocess and real producers over the socket.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import anyio
import pytest

from quiverd.client import AsyncClient, Client
from tests.daemon.helpers import stored_bundles, tagged_table
from tests.tiers import size

# Kill -9 rounds: 5 in the default tier (each a random moment mid-stream, replay and a
# restart), 20 in the full tier; QUIVERD_CRASH_ITERATIONS overrides both.
CRASH_ITERATIONS = size(5, 20, env="QUIVERD_CRASH_ITERATIONS")


class Producer(threading.Thread):
    """Sends tagged bundles as fast as acks allow; records every ack it got."""

    def __init__(self, socket: Path, client: str, first_tag: int) -> None:
        super().__init__(daemon=True)
        self.socket, self.client, self.tag = socket, client, first_tag
        self.acked: dict[tuple[int, int], int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with Client.connect(self.socket) as c:
                while not self.stop.is_set():
                    tags = list(range(self.tag, self.tag + 8))
                    self.tag += 8
                    acks = c.send_many([tagged_table(t, rows=50 + t % 50) for t in tags],
                                       client=self.client)
                    for t, ack in zip(tags, acks, strict=True):
                        self.acked[(ack.shard, ack.sequence)] = t
        except Exception:
            pass  # the daemon was killed under us: what was acked is what counts


def wait_for_first_acks(producers: list[Producer], timeout_s: float = 30.0) -> None:
    """Until every producer has acks: a kill before the first one tests nothing (a fixed
    sleep from the start, 0.05-0.6 s, cut before the first ack in every one of 20 rounds
    on a loaded machine, where the first ack takes over half a second)."""
    deadline = time.monotonic() + timeout_s
    while not all(p.acked for p in producers):
        assert time.monotonic() < deadline, f"no ack within {timeout_s} s"
        assert all(p.is_alive() for p in producers), "a producer ended before its first ack"
        time.sleep(0.005)


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_no_acknowledged_bundle(daemon_factory):
    rng = random.Random(int(os.environ.get("QUIVERD_CRASH_SEED", "1234")))
    d = daemon_factory({"segment.max_open_duration_ms": 50,
                        "segment.target_size_bytes": 256 * 1024})
    acked: dict[tuple[int, int], int] = {}
    for iteration in range(CRASH_ITERATIONS):
        d.start()
        producers = [Producer(d.socket, f"p{n}", (iteration * 10 + n) * 1_000_000)
                     for n in range(2)]
        for p in producers:
            p.start()
        wait_for_first_acks(producers)
        time.sleep(rng.uniform(0.05, 0.6))
        d.kill()
        for p in producers:
            p.stop.set()
            p.join(10)
            for key, tag in p.acked.items():
                assert key not in acked, f"sequence {key} acked twice"
                acked[key] = tag
    d.start()
    assert d.stop() == 0  # a clean stop finalizes whatever replay put in the open segment
    stored = stored_bundles(d.data_dir)
    missing = [k for k in acked if k not in stored]
    assert not missing, f"{len(missing)} acknowledged bundles lost, e.g. {missing[:5]}"
    for key, tag in acked.items():
        table = stored[key].slots[0]
        assert table.equals(tagged_table(tag, rows=50 + tag % 50)), key
    assert len(acked) > CRASH_ITERATIONS  # the test did send data (every round some)


def test_no_ack_leaves_before_its_covering_fdatasync(daemon_factory, short_dir):
    """A gate stalls every WAL fdatasync: while it is closed, no ack may arrive."""
    gate = short_dir / "gate"
    d = daemon_factory({"wal.flush_interval_ms": 5},
                       in_process=True).start(faults=f"wal.fdatasync=gate:{gate}")

    async def scenario() -> None:
        async with await AsyncClient.connect(d.socket) as c:
            await c.send(tagged_table(0), client="g")  # gate open: acked normally
            gate.touch()
            acks: list[float] = []

            async def send(i: int) -> None:
                await c.send(tagged_table(i), client="g")
                acks.append(time.monotonic())

            async with anyio.create_task_group() as tg:
                for i in range(1, 9):
                    tg.start_soon(send, i)
                await anyio.sleep(1.0)
                assert acks == [], "an ack left while its fdatasync was stalled"
                status = d.status()
                assert sum(s["appends"] for s in status["shards"]) == 9  # written, not synced
                opened = time.monotonic()
                gate.unlink()
            assert len(acks) == 8 and min(acks) >= opened

    anyio.run(scenario)
    assert d.stop() == 0


@pytest.mark.parametrize("policy", ["interval", "always"])
def test_fdatasync_failure_is_fatal_and_restart_recovers_what_was_durable(daemon_factory, policy):
    d = daemon_factory({"shards": 1, "wal.flush_policy": policy,
                        "segment.max_open_duration_ms": 60_000})
    d.start(faults="wal.fdatasync=eio@4")
    acked: dict[tuple[int, int], int] = {}
    failed_at = None
    with Client.connect(d.socket) as c:
        for tag in range(200):
            try:
                ack = c.send(tagged_table(tag), client="f")
            except Exception as exc:
                failed_at = (tag, exc)
                break
            acked[(ack.shard, ack.sequence)] = tag
    assert failed_at is not None, "the injected fdatasync failure was not noticed"
    assert d.wait(30) == 70  # EX_SOFTWARE: systemd restarts
    assert d.events("quiverd_fatal_durability")
    assert len(acked) == 3  # syncs 1..3 succeeded, each covering one bundle
    d.start()
    assert d.stop() == 0
    stored = stored_bundles(d.data_dir)
    for key, tag in acked.items():
        assert stored[key].slots[0].equals(tagged_table(tag))
