"""Malformed and abusive socket cases, 20,000 in the full tier, against one live daemon.

One daemon subprocess; cases come from a seeded generator (the same cases on every
run) and run 64 at a time, one case per connection (any malformed frame closes
the connection, so a connection cannot carry two). Meanwhile a good producer keeps
sending and getting acks, and the daemon's RSS (/proc/<pid>/status VmRSS) is
sampled against the bound documented in the README's "Operating it".

Every case must end in an ERROR frame or a clean close (end of stream), within
the case timeout: never a hang, never INTERNAL (a bug), never a daemon crash (issue 8).
2,000 cases in the default tier (every kind, each at least a few dozen times), the full
20,000 in the full tier (tests/tiers.py); ``QUIVERD_FUZZ_CASES`` overrides both.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from quiverd.client import Client
from quiverd.kernel.bundle import encode_ipc_stream
from quiverd.net.admin import request
from quiverd.protocol import codec as protocol
from quiverd.protocol.frames import ErrorCode, FrameType, Role
from tests.tiers import size

MiB = 1 << 20
CASES = size(2_000, 20_000, env="QUIVERD_FUZZ_CASES")
CONCURRENCY = 64
CASE_TIMEOUT_S = 15.0
SETTINGS = {
    "shards": 2,
    "ingest.max_bundle_bytes": 1 * MiB, "wal.max_entry_bytes": 2 * MiB,
    "ingest.max_pending_bytes": 4 * MiB,  # small: the budget is exercised
    "ingest.handshake_timeout_ms": 300, "ingest.idle_timeout_ms": 500,
    "ingest.max_connections": 256, "ingest.max_connections_per_uid": 200,
    "segment.target_size_bytes": 4 * MiB, "segment.max_open_duration_ms": 200,
}


def documented_rss_bound(settings: dict[str, Any]) -> int:
    """README, Operating it, Memory: the bound for this daemon's settings."""
    return (150 * MiB + 3 * settings["segment.target_size_bytes"]
            + 64 * MiB * settings["shards"] + settings["ingest.max_pending_bytes"]
            + settings["ingest.max_connections"] * MiB // 2)


@dataclass
class Case:
    kind: str
    chunks: list[bytes]
    half_close: bool = True  # False: the peer stalls (the server must time it out)
    codes: frozenset[int] = frozenset(ErrorCode) - {ErrorCode.INTERNAL}
    # A close without an ERROR is right only for bytes that were valid after all:
    # then this answer must have come first (None: an ERROR is required).
    quiet: type | None = None


@dataclass
class Outcome:
    kinds: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


class Generator:
    """Seeded case factory: valid frames, then broken in one of many ways."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        tables = [pa.table({"x": pa.array(range(n), pa.int64()), "s": [f"r{i}" for i in range(n)]})
                  for n in (1, 10, 200)]
        self.ipcs = [(encode_ipc_stream(t), t.num_rows) for t in tables]
        self.hello = protocol.encode_hello(Role.PRODUCER)
        self.kinds = [(w, getattr(self, f"_{name}")) for name, w in (
            ("garbage", 8), ("bad_hello", 8), ("after_hello", 8), ("bitflip", 12),
            ("truncated", 10), ("bad_ipc", 16), ("oversize", 4), ("wrong_frame", 6),
            ("pipeline", 8), ("subscriber", 8), ("announce_and_leave", 6),
            ("stall_handshake", 2), ("stall_mid_frame", 2), ("zero_len", 2))]
        self.weights = [w for w, _ in self.kinds]

    def case(self) -> Case:
        _, make = self.rng.choices(self.kinds, self.weights)[0]
        case: Case = make()
        if len(case.chunks) == 1 and self.rng.random() < 0.3:  # split anywhere
            data = case.chunks[0]
            cuts = sorted(self.rng.sample(range(len(data) + 1), min(3, len(data) + 1)))
            bounds = zip([0, *cuts], [*cuts, len(data)], strict=True)
            case.chunks = [data[a:b] for a, b in bounds if b > a]
        return case

    def bundle(self, request_id: int = 1, payload: bytes | None = None, rows: int | None = None,
               slot: int = 0) -> bytes:
        ipc, n = self.rng.choice(self.ipcs)
        parts = protocol.encode_bundle(request_id, "fuzz", {slot: payload or ipc},
                                       {slot: n if rows is None else rows})
        return b"".join(bytes(p) for p in parts)

    def _garbage(self) -> Case:
        return Case("garbage", [self.rng.randbytes(self.rng.randint(1, 300))])

    def _bad_hello(self) -> Case:
        raw = bytearray(self.hello)
        raw[self.rng.randrange(len(raw))] ^= self.rng.randint(1, 255)
        lo, hi = self.rng.randint(0, 3), self.rng.randint(0, 3)
        other = struct.pack("<IB3sHHB", 9, 1, b"QVR", lo, hi, self.rng.randint(0, 3))
        return Case("bad_hello", [self.rng.choice([bytes(raw), other])], quiet=protocol.HelloOk)

    def _after_hello(self) -> Case:
        return Case("after_hello", [self.hello + self.rng.randbytes(self.rng.randint(1, 300))])

    def _bitflip(self) -> Case:
        raw = bytearray(self.bundle())
        for _ in range(self.rng.randint(1, 3)):
            raw[self.rng.randrange(len(raw))] ^= 1 << self.rng.randrange(8)
        return Case("bitflip", [self.hello + bytes(raw)])

    def _truncated(self) -> Case:
        raw = self.bundle()
        return Case("truncated", [self.hello + raw[: self.rng.randrange(1, len(raw))]])

    def _bad_ipc(self) -> Case:
        """Framing and CRC right, Arrow IPC broken: what only pyarrow can judge."""
        ipc, rows = self.rng.choice(self.ipcs)
        raw = bytearray(ipc)
        how = self.rng.randrange(4)
        if how == 0:
            for _ in range(self.rng.randint(1, 4)):
                raw[self.rng.randrange(len(raw))] = self.rng.randrange(256)
        elif how == 1:
            raw = raw[: self.rng.randrange(len(raw))] or bytearray(b"\0")
        else:
            at = self.rng.randrange(len(raw) - 8)
            value = self.rng.choice([-1, -2, 0, 1 << 30, 0x7FFF_FFFF, -(1 << 31)])
            struct.pack_into("<i" if how == 2 else "<q", raw, at,
                             value if how == 2 else value << self.rng.choice([0, 20, 31]))
        return Case("bad_ipc", [self.hello + self.bundle(payload=bytes(raw), rows=rows)],
                    quiet=protocol.Ack)  # a harmless mutation is stored and acked

    def _oversize(self) -> Case:
        frame_len = self.rng.choice([2 * MiB, 1 << 31, 0xFFFF_FFFF])
        return Case("oversize", [self.hello + struct.pack("<IB", frame_len, FrameType.BUNDLE)],
                    codes=frozenset({ErrorCode.TOO_LARGE}))

    def _wrong_frame(self) -> Case:
        frames = [protocol.encode_subscribe("x", 1), protocol.encode_ack_bundle(0, 1, 2),
                  protocol.encode_hello(Role.PRODUCER), self.bundle(slot=63),
                  self.bundle(request_id=1, rows=999)]
        return Case("wrong_frame", [self.hello + self.rng.choice(frames)],
                    codes=frozenset({ErrorCode.MALFORMED}))

    def _pipeline(self) -> Case:
        """Valid bundles (acked), sometimes a repeated request id or a bad one last."""
        ids = [self.rng.randint(1, 4) for _ in range(self.rng.randint(1, 4))]
        body = b"".join(self.bundle(request_id=i) for i in ids)
        if self.rng.random() < 0.5:
            body += self.rng.randbytes(self.rng.randint(5, 40))
        return Case("pipeline", [self.hello + body], quiet=protocol.Ack)

    def _subscriber(self) -> Case:
        hello = protocol.encode_hello(Role.SUBSCRIBER)
        name = self.rng.choice(["fz", "nobody", "fz"])
        harmless = protocol.encode_nack_bundle(0, 1 << 40, 3)  # never finalized: ignored
        tail = self.rng.choice([b"", harmless, self.bundle(), protocol.encode_ack_bundle(9, 1, 1),
                                protocol.encode_subscribe("fz", 1), self.rng.randbytes(20),
                                struct.pack("<IBB", 2, FrameType.SUBSCRIBE, 0)])
        # Attached, valid frames, then end of stream: a clean close.
        valid = name == "fz" and tail in (b"", harmless)
        return Case("subscriber", [hello + protocol.encode_subscribe(name, 4) + tail],
                    quiet=protocol.Subscribed if valid else None)

    def _announce_and_leave(self) -> Case:
        """A big BUNDLE announced (budget taken), some of it sent, then end of stream."""
        frame_len = self.rng.randint(MiB // 2, MiB)
        return Case("announce_and_leave", [self.hello + struct.pack("<IB", frame_len, 3)
                                           + bytes(self.rng.randint(0, 64 * 1024))])

    def _stall_handshake(self) -> Case:
        return Case("stall_handshake", [self.hello[: self.rng.randint(0, len(self.hello) - 1)]],
                    half_close=False, codes=frozenset({ErrorCode.TIMEOUT}))

    def _stall_mid_frame(self) -> Case:
        raw = self.bundle()
        return Case("stall_mid_frame", [self.hello + raw[: self.rng.randrange(1, len(raw))]],
                    half_close=False, codes=frozenset({ErrorCode.TIMEOUT}))

    def _zero_len(self) -> Case:
        return Case("zero_len", [self.hello + struct.pack("<I", 0)],
                    codes=frozenset({ErrorCode.MALFORMED}))


async def run_case(path: str, case: Case) -> tuple[str, str | None]:
    """(outcome, failure): outcome names the ERROR code or "close"."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    decoder = protocol.FrameDecoder(1 << 20, from_client=False)
    errors: list[protocol.Error] = []
    answers: set[type] = set()
    try:
        await loop.sock_connect(sock, path)
        try:
            for chunk in case.chunks:
                await loop.sock_sendall(sock, chunk)
                await asyncio.sleep(0)
            if case.half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server judged the bytes before we finished: its answer is queued
        while True:
            try:
                data = await loop.sock_recv(sock, 1 << 16)
            except ConnectionResetError:
                # Closed with our bytes unread: fine after an ERROR, a failure without.
                if errors:
                    break
                return "reset", f"{case.kind}: reset without an ERROR frame"
            if not data:
                break
            for msg in decoder.feed(data):
                answers.add(type(msg))
                if isinstance(msg, protocol.Error) and msg.request_id == 0:
                    errors.append(msg)
    finally:
        sock.close()
    if not errors:
        if case.quiet is None or case.quiet not in answers:
            return "close", f"{case.kind}: closed without an ERROR {case.chunks[:1]!r:.60}"
        return "close", None
    err = errors[-1]
    name = ErrorCode(err.code).name if err.code in ErrorCode._value2member_map_ else str(err.code)
    if err.code == ErrorCode.AT_CAPACITY:  # refused: another case held the slots
        return name, None
    if err.code not in case.codes or not err.message:
        return name, f"{case.kind}: {name} {err.message!r} {case.chunks[:1]!r:.60}"
    return name, None


async def run_all(path: str, cases: list[Case], outcome: Outcome) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(case: Case) -> None:
        async with gate:
            try:
                name, failure = await asyncio.wait_for(run_case(path, case), CASE_TIMEOUT_S)
            except TimeoutError:
                name, failure = "hang", f"{case.kind}: no ERROR and no close in {CASE_TIMEOUT_S}s"
        outcome.kinds[case.kind] += 1
        outcome.codes[name] += 1
        if failure is not None:
            outcome.failures.append(failure)

    await asyncio.gather(*(one(c) for c in cases))


class Background:
    """The good producer and the RSS sampler, on threads, until ``stop``."""

    def __init__(self, socket_path: Any, pid: int) -> None:
        self.socket_path, self.pid = socket_path, pid
        self.done = threading.Event()
        self.acks = 0
        self.producer_error: BaseException | None = None
        self.peak_rss = 0
        self.threads = [threading.Thread(target=self._produce),
                        threading.Thread(target=self._sample)]

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(30)

    def _produce(self) -> None:
        table = pa.table({"good": pa.array(range(50), pa.int64())})
        try:
            with Client.connect(self.socket_path, timeout=30) as client:
                while not self.done.wait(0.01):
                    client.send(table, client="good-producer")
                    self.acks += 1
        except BaseException as exc:  # reported by the test
            self.producer_error = exc

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            self.peak_rss = max(self.peak_rss, rss_bytes(self.pid))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# The id keeps its full-tier size: both tiers run the same test ids.
def test_fuzz_20000_socket_cases_against_one_daemon(daemon_factory) -> None:
    d = daemon_factory(SETTINGS).start()
    request(d.admin_socket, "subscribers.add", {"name": "fz"})
    generator = Generator(seed=8)
    cases = [generator.case() for _ in range(CASES)]
    outcome = Outcome()
    started = time.monotonic()
    with Background(d.socket, d.proc.pid) as background:
        asyncio.run(run_all(str(d.socket), cases, outcome))
        time.sleep(0.1)  # the producer's last acks
    elapsed = time.monotonic() - started
    bound = documented_rss_bound(SETTINGS)
    print(f"\nfuzz: {CASES} cases in {elapsed:.1f}s, peak RSS {background.peak_rss / MiB:.0f} MiB"
          f" (bound {bound / MiB:.0f} MiB), good producer {background.acks} acks;"
          f" outcomes {dict(outcome.codes)}; kinds {dict(outcome.kinds)}")
    assert not outcome.failures, f"{len(outcome.failures)} bad cases, e.g. {outcome.failures[:5]}"
    assert sum(outcome.kinds.values()) == CASES
    # The smoke size must still reach every kind of abuse, not only the common ones.
    assert len(outcome.kinds) == len(generator.kinds), dict(outcome.kinds)
    assert background.producer_error is None, repr(background.producer_error)
    assert background.acks >= 50
    assert 0 < background.peak_rss <= bound
    assert d.proc.poll() is None, "the daemon died"
    status = d.status()
    assert status["ingest"]["errors"] >= CASES // 2 and status["ingest"]["timeouts"] > 0
    assert status["ingest"]["pending_bytes"] == 0  # every connection gave its budget back
    assert not d.events("ingest_connection_failed")
    assert d.stop() == 0
