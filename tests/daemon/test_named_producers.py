"""Named producers (protocol v3, issue 29): every bundle stored exactly once although the
connection is cut between the daemon's fdatasync and its ACK, or before the daemon
answered, and through a kill -9 of the daemon; the numbers survive a restart after the
WAL was released (producers.json).

The cuts are real: the producer talks to the daemon through a Unix-socket proxy
(``CuttingProxy``) that reads the frames going each way and, as a seed draws, drops
both sides of the connection instead of forwarding an ACK (the bundle is durable, the
producer never hears so) or right after forwarding a BUNDLE (the daemon may be storing
it while the producer resends it).
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa

from quiverd.client import AsyncClient, Client
from quiverd.client.consumer import subscribe
from quiverd.kernel.bundle import encode_ipc_stream
from quiverd.protocol import codec as p
from tests.daemon.test_subscribers import add
from tests.tiers import size

CUTS = size(1000, 1000, env="QUIVERD_PRODUCER_CUTS")
FAST = {"shards": 1, "segment.max_open_duration_ms": 50}
HEADER = struct.Struct("<IB")


def table(i: int) -> pa.Table:
    return pa.table({"id": pa.array([i], pa.int64()), "pad": pa.array([f"row {i}"])})


class CuttingProxy:
    """A Unix-socket proxy to ``target`` that cuts connections at frame boundaries:
    instead of forwarding an ACK (chance ``p_ack``) or just after forwarding a BUNDLE
    (``p_bundle``), until ``limit`` cuts were made."""

    def __init__(self, path: Path, target: Path, *, seed: int, limit: int,
                 p_ack: float = 0.25, p_bundle: float = 0.05) -> None:
        self.path, self.target, self.limit = path, target, limit
        self.p_ack, self.p_bundle = p_ack, p_bundle
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.cuts = Counter[str]()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.closed = False
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def _cut_now(self, kind: str, chance: float) -> bool:
        with self.lock:
            if sum(self.cuts.values()) >= self.limit or self.rng.random() >= chance:
                return False
            self.cuts[kind] += 1
            return True

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(str(self.target))
            pair = (client, server)
            self._spawn(self._pump, client, server, p.FrameType.BUNDLE, pair)
            self._spawn(self._pump, server, client, p.FrameType.ACK, pair)

    def _pump(self, src: socket.socket, dst: socket.socket, watched: p.FrameType,
              pair: tuple[socket.socket, socket.socket]) -> None:
        buf = b""
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                buf += data
                while len(buf) >= HEADER.size:
                    length, kind = HEADER.unpack_from(buf)
                    end = 4 + length
                    if len(buf) < end:
                        break
                    frame, buf = buf[:end], buf[end:]
                    if kind == watched == p.FrameType.ACK and self._cut_now("before_ack",
                                                                           self.p_ack):
                        raise ConnectionAbortedError
                    dst.sendall(frame)
                    if kind == watched == p.FrameType.BUNDLE and self._cut_now(
                            "after_bundle", self.p_bundle):
                        raise ConnectionAbortedError
        except OSError:
            pass
        finally:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.listener.close()
        for t in self.threads:
            t.join(10)


def consume_ids(d: Any, name: str, want: int, idle_s: float = 3.0) -> Counter[int]:
    """Every id the subscriber ``name`` is delivered (acking each), until ``want`` came
    and then ``idle_s`` without more."""
    got: Counter[int] = Counter()

    async def run() -> None:
        async with subscribe(d.socket, name, window=256) as deliveries:
            while True:
                with anyio.move_on_after(idle_s if sum(got.values()) >= want else 60) as s:
                    b = await anext(deliveries)
                if s.cancelled_caught:
                    return
                for i in b.tables[0].column("id").to_pylist():
                    got[i] += 1
                await b.ack()

    anyio.run(run)
    return got


def test_named_producer_cut_between_fdatasync_and_ack_stores_each_bundle_once(
        daemon_factory: Any, short_dir: Path) -> None:
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "check")
    proxy = CuttingProxy(short_dir / "proxy.sock", d.socket, seed=29, limit=CUTS)
    n = 0
    try:
        with Client.connect(proxy.path, producer_id="collector-7", reconnect_s=30) as c:
            started = time.monotonic()
            while sum(proxy.cuts.values()) < CUTS:
                acks = c.send_many([table(n + i) for i in range(64)], client="telemetry")
                assert len(acks) == 64
                n += 64
                assert time.monotonic() - started < 300, (n, proxy.cuts)
            reconnects = c.reconnects
    finally:
        proxy.close()
    got = consume_ids(d, "check", want=n)
    twice = sorted(i for i, k in got.items() if k > 1)
    lost = sorted(set(range(n)) - set(got))
    assert not twice and not lost, f"{len(twice)} stored twice {twice[:10]}, {len(lost)} " \
                                   f"lost {lost[:10]} (of {n}; cuts {dict(proxy.cuts)})"
    # A cut of both directions of one connection at once is one reconnect.
    assert reconnects >= CUTS // 2
    assert proxy.cuts["before_ack"] > 0 and proxy.cuts["after_bundle"] > 0
    print(f"named producer: {n} bundles, {dict(proxy.cuts)} cuts, {reconnects} reconnects: "
          f"each stored once")


def numbered(d: Any, producer: str, incarnation: int, items: list[tuple[int, int]]
             ) -> list[p.Ack]:
    """Send ``(producer_seq, id)`` bundles as named producer (``producer``,
    ``incarnation``) on a connection of its own; the ACKs, in order."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(d.socket))
        s.sendall(p.encode_hello(p.Role.PRODUCER, producer=producer, incarnation=incarnation))
        for k, (pseq, i) in enumerate(items, 1):
            payload = encode_ipc_stream(table(i))
            s.sendall(b"".join(p.encode_bundle(k, "telemetry", {0: payload}, {0: 1},
                                               producer_seq=pseq)))
        dec = p.FrameDecoder(1 << 20, from_client=False)
        got: list[Any] = []
        while len(got) < len(items) + 1:
            data = s.recv(1 << 16)
            assert data, "the daemon closed the connection"
            got += dec.feed(data)
    assert isinstance(got[0], p.HelloOk) and got[0].version == 3
    assert all(isinstance(a, p.Ack) for a in got[1:]), got
    return sorted(got[1:], key=lambda a: a.request_id)


def test_named_producer_numbers_survive_a_restart_after_the_wal_was_released(
        daemon_factory: Any) -> None:
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "check")
    first = numbered(d, "collector-7", 77, [(k, k - 1) for k in range(1, 6)])
    producers = d.data_dir / "shard-0" / "producers.json"
    deadline = time.monotonic() + 20
    while not producers.exists():  # written before the WAL's first release
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.05)
    assert d.stop() == 0
    d.start()
    again = numbered(d, "collector-7", 77, [(3, 2), (6, 5)])
    assert again[0].sequence == first[2].sequence  # the first ACK's sequence
    assert again[1].sequence > first[-1].sequence  # a new one
    other = numbered(d, "collector-7", 78, [(3, 99)])  # another process: its own numbers
    assert other[0].sequence > again[1].sequence
    got = consume_ids(d, "check", want=7)
    assert got == Counter({0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 99: 1})
    assert d.status()["metrics"]["quiver_ingest_resends_total"] == 1, d.status()["metrics"]


def test_a_damaged_producers_file_is_set_aside_and_the_daemon_starts(
        daemon_factory: Any) -> None:
    d = daemon_factory(FAST, in_process=True).start()
    numbered(d, "collector-7", 5, [(1, 1)])
    producers = d.data_dir / "shard-0" / "producers.json"
    deadline = time.monotonic() + 20
    while not producers.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert d.stop() == 0
    producers.write_bytes(b'{"version": 1, "streams": [{"producer": ')
    d.start()
    [event] = d.events("producers_file_unreadable")
    assert "may be stored twice" in event["hint"] and not producers.exists()
    assert list((d.data_dir / "shard-0" / "quarantine").glob("producers.json.*.bad"))
    assert numbered(d, "collector-7", 5, [(2, 2)])[0].sequence > 0


def through_restarts(d: Any, producer: str, total: int, restarts: int,
                     restart: Any) -> Counter[int]:
    """A named producer sends ``total`` bundles from a thread while ``restart(d)`` is done
    ``restarts`` times at even points of it; then every id subscriber "check" gets."""
    sent: list[int] = []
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with Client.connect(d.socket, producer_id=producer, reconnect_s=60) as c:
                for start in range(0, total, 50):
                    c.send_many([table(i) for i in range(start, start + 50)],
                                client="telemetry")
                    sent.append(start + 50)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failure.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    for k in range(restarts):
        deadline = time.monotonic() + 60
        while (sent[-1] if sent else 0) < (k + 1) * total // (restarts + 1):
            assert time.monotonic() < deadline and not failure, failure
            time.sleep(0.01)
        restart(d)
    t.join(120)
    assert not t.is_alive() and not failure, failure
    return consume_ids(d, "check", want=total)


def test_named_producer_through_kill9_of_the_daemon_stores_each_bundle_once(
        daemon_factory: Any) -> None:
    d = daemon_factory(FAST).start()
    add(d, "check")

    def kill9(d: Any) -> None:
        d.kill()  # SIGKILL, mid-stream
        d.start()

    got = through_restarts(d, "collector-9", 3000, 3, kill9)
    twice = sorted(i for i, k in got.items() if k > 1)
    lost = sorted(set(range(3000)) - set(got))
    assert not twice and not lost, f"{len(twice)} twice {twice[:10]}, {len(lost)} lost {lost[:10]}"


def test_named_producer_rides_out_graceful_restarts(daemon_factory: Any) -> None:
    """A stop answers what is in flight SHUTTING_DOWN and closes: a named producer waits
    for the daemon to come back and resends, the application sees no error."""
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "check")

    def restart(d: Any) -> None:
        assert d.stop() == 0
        d.start()

    got = through_restarts(d, "collector-3", 2000, 2, restart)
    assert sorted(got) == list(range(2000)) and set(got.values()) == {1}


def test_async_named_producer_cut_between_fdatasync_and_ack_stores_each_bundle_once(
        daemon_factory: Any, short_dir: Path) -> None:
    d = daemon_factory(FAST, in_process=True).start()
    add(d, "check")
    cuts = max(50, CUTS // 5)
    proxy = CuttingProxy(short_dir / "proxy.sock", d.socket, seed=31, limit=cuts)
    n = 0

    async def run() -> int:
        nonlocal n
        async with await AsyncClient.connect(proxy.path, producer_id="collector-8",
                                             reconnect_s=30) as c:
            started = time.monotonic()
            while sum(proxy.cuts.values()) < cuts:
                assert time.monotonic() - started < 300, (n, proxy.cuts)
                acks = await c.send_many([table(n + i) for i in range(64)],
                                         client="telemetry")
                assert len(acks) == 64
                n += 64
            return c.reconnects

    try:
        reconnects = anyio.run(run)
    finally:
        proxy.close()
    got = consume_ids(d, "check", want=n)
    assert sorted(got) == list(range(n)) and set(got.values()) == {1}, (
        sorted(i for i, k in got.items() if k > 1)[:10], sorted(set(range(n)) - set(got))[:10])
    assert reconnects >= cuts // 2
