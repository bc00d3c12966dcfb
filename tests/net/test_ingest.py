"""The ingest listener in process: real Unix sockets, a stand-in WAL writer on a real stream.

The stand-in answers each AppendRequest with an Ack, optionally only once a test
opens its gate, which is how these tests hold bundles "in flight".
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pyarrow as pa
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from quiverd.kernel import logs
from quiverd.kernel.bundle import encode_ipc_stream
from quiverd.kernel.config import IngestConfig
from quiverd.net.budget import ByteBudget
from quiverd.net.ingest import IngestServer
from quiverd.net.rawsock import RawStream
from quiverd.protocol import codec as p
from quiverd_actors.messages import AppendRequest

KiB = 1024


@dataclass
class Wal:
    """Stand-in WAL writer: acks every request, after ``gate`` is set if there is one
    (``gates`` picks one per client name instead)."""

    gate: anyio.Event | None = None
    gates: dict[str, anyio.Event] = field(default_factory=dict)
    received: list[AppendRequest] = field(default_factory=list)
    arrived: anyio.Event = field(default_factory=anyio.Event)

    async def run(self, inbox: MemoryObjectReceiveStream[AppendRequest]) -> None:
        async with inbox, anyio.create_task_group() as tg:
            async for req in inbox:
                self.received.append(req)
                self.arrived.set()
                self.arrived = anyio.Event()
                tg.start_soon(self._answer, req, len(self.received))

    async def _answer(self, req: AppendRequest, sequence: int) -> None:
        gate = self.gates.get(req.bundle.client, self.gate)
        if gate is not None:
            await gate.wait()
        req.reply.send_nowait(p.Ack(request_id=req.request_id, shard=0, sequence=sequence))

    def open_all(self) -> None:
        for gate in [self.gate, *self.gates.values()]:
            if gate is not None:
                gate.set()


class Changes:
    """Server state the wire does not show (connections ended, budget queued or given
    back): the observed server pokes this whenever one changes."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    def poke(self) -> None:
        self.event.set()
        self.event = anyio.Event()

    async def until(self, condition: Callable[[], bool]) -> None:
        with anyio.fail_after(3):
            while not condition():
                await self.event.wait()


class ObservedBudget(ByteBudget):
    def __init__(self, total_bytes: int, per_uid_bytes: int, changes: Changes) -> None:
        super().__init__(total_bytes, per_uid_bytes)
        self.changes = changes

    async def take(self, nbytes: int, uid: int = 0,
                   queued: Callable[[], None] | None = None) -> None:
        self.changes.poke()  # the waiter is queued before the poke is seen
        await super().take(nbytes, uid, queued)

    def release(self, nbytes: int, uid: int = 0) -> None:
        super().release(nbytes, uid)
        self.changes.poke()


class ObservedServer(IngestServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changes = Changes()
        self.budget = ObservedBudget(self.budget.total_bytes, self.budget.per_uid_bytes,
                                     self.changes)

    async def _connection(self, stream: RawStream, uid: int) -> None:
        try:
            await super()._connection(stream, uid)
        finally:
            self.changes.poke()


class Serving:
    def __init__(self, server: ObservedServer) -> None:
        self.server = server
        self.peers: list[Peer] = []

    async def until(self, condition: Callable[[], bool]) -> None:
        await self.server.changes.until(condition)

    async def connect(self, *, hello: bool = True, then: bytes = b"") -> Peer:
        """A producer connection; ``then`` goes out in the same write as its HELLO, so
        a short idle timeout cannot run out while the test builds its first frame."""
        peer = Peer(await anyio.connect_unix(self.server.path))
        self.peers.append(peer)
        if hello:
            await peer.stream.send(p.encode_hello(p.Role.PRODUCER) + then)
            assert isinstance(await peer.next(), p.HelloOk)
        return peer


@asynccontextmanager
async def serving(tmp_path: Path, wal: Wal | None = None,
                  **settings: Any) -> AsyncIterator[Serving]:
    cfg = IngestConfig(socket_path=str(tmp_path / "in.sock"), **settings)
    tx, rx = anyio.create_memory_object_stream[AppendRequest](64)
    server = ObservedServer(cfg, Path(cfg.socket_path), [tx], limiter=anyio.CapacityLimiter(2),
                            log=logs.get("test"))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon((wal or Wal()).run, rx)
            await tg.start(server.serve)
            serving = Serving(server)
            try:
                yield serving
            finally:
                for peer in serving.peers:
                    await peer.stream.aclose()
                if wal is not None:
                    wal.open_all()
                server.stop()


class Peer:
    """A raw protocol client: what it sends is exactly what the test says."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.decoder = p.FrameDecoder(1 << 20, from_client=False)
        self.frames: list[p.Message] = []

    async def next(self) -> p.Message | None:
        """The next frame from the server; None once it closed the connection."""
        while not self.frames:
            try:
                data = await self.stream.receive(1 << 16)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return None
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    async def error(self) -> p.Error:
        """Skip to the connection-level ERROR; the connection must close after it."""
        while True:
            msg = await self.next()
            assert msg is not None, "closed without an ERROR frame"
            if isinstance(msg, p.Error):
                assert await self.next() is None, "ERROR not followed by a close"
                return msg

    async def send_bundle(self, request_id: int, rows: int = 10) -> None:
        await self.stream.send(bundle(request_id, rows))

    async def aclose(self) -> None:
        await self.stream.aclose()  # closing twice is harmless


def bundle(request_id: int, rows: int = 10, client: str = "c") -> bytes:
    import pyarrow as pa

    ipc = encode_ipc_stream(pa.table({"x": pa.array(range(rows), pa.int64())}))
    return b"".join(bytes(b) for b in p.encode_bundle(request_id, client, {0: ipc}, {0: rows}))


@pytest.mark.asyncio
async def test_ingest_silent_connection_gets_timeout_error_after_handshake_timeout(
        tmp_path: Path) -> None:
    async with serving(tmp_path, handshake_timeout_ms=200) as h:
        server = h.server
        silent = await h.connect(hello=False)
        with anyio.fail_after(3):
            err = await silent.error()
        assert (err.request_id, err.code) == (0, p.ErrorCode.TIMEOUT)
        assert "no HELLO within 200 ms" in err.message and "handshake_timeout_ms" in err.message
        assert server.stats.timeouts.value == 1


@pytest.mark.asyncio
async def test_ingest_idle_timeout_spares_bundles_in_flight_then_closes_when_idle(
        tmp_path: Path) -> None:
    wal = Wal(gate=anyio.Event())
    async with serving(tmp_path, wal, idle_timeout_ms=300) as h:
        server = h.server
        arrived = wal.arrived
        peer = await h.connect(then=bundle(1))
        await arrived.wait()
        await anyio.sleep(0.9)  # three idle periods with the bundle in flight: not idle
        assert server.stats.connections.value == 1
        started = anyio.current_time()
        wal.gate.set()
        with anyio.fail_after(3):
            ack = await peer.next()
            assert isinstance(ack, p.Ack) and ack.request_id == 1
            err = await peer.error()
        assert err.code == p.ErrorCode.TIMEOUT and "idle for 300 ms" in err.message
        assert anyio.current_time() - started >= 0.3  # the clock started at the ack


@pytest.mark.asyncio
async def test_ingest_stalled_half_sent_frame_is_closed_and_its_budget_returned(
        tmp_path: Path) -> None:
    async with serving(tmp_path, idle_timeout_ms=300) as h:
        server = h.server
        wire = bundle(1, rows=1000)
        peer = await h.connect(then=wire[: len(wire) // 2])
        with anyio.fail_after(3):
            err = await peer.error()
        assert err.code == p.ErrorCode.TIMEOUT
        assert "frame stalled" in err.message and f"of its {len(wire)} bytes" in err.message
        assert server.budget.held == 0 and server.stats.pending_bytes.value == 0


@pytest.mark.asyncio
async def test_ingest_per_uid_limit_refuses_with_at_capacity_and_frees_on_close(
        tmp_path: Path) -> None:
    async with serving(tmp_path, max_connections=8, max_connections_per_uid=2) as h:
        server = h.server
        first, second = [await h.connect() for _ in range(2)]
        third = await h.connect(hello=False)
        await third.stream.send(p.encode_hello(p.Role.PRODUCER))
        with anyio.fail_after(3):
            err = await third.error()
        assert err.code == p.ErrorCode.AT_CAPACITY
        assert "already has 2 connections" in err.message
        assert "max_connections_per_uid" in err.message
        await first.aclose()
        await h.until(lambda: server.stats.connections.value == 1)  # the server saw the close
        again = await h.connect()
        await again.send_bundle(7)
        ack = await again.next()
        assert isinstance(ack, p.Ack) and ack.request_id == 7
        assert server.stats.refused.value == 1
        await second.aclose()
        await again.aclose()


@pytest.mark.asyncio
async def test_ingest_max_connections_refuses_instead_of_leaving_peers_hanging(
        tmp_path: Path) -> None:
    async with serving(tmp_path, max_connections=2, max_connections_per_uid=2) as h:
        peers = [await h.connect(hello=False) for _ in range(2)]
        late = await h.connect(hello=False)
        with anyio.fail_after(3):  # answered at once, not queued in the backlog
            err = await late.error()
        assert err.code == p.ErrorCode.AT_CAPACITY and "ingest.max_connections" in err.message
        for peer in peers:
            await peer.aclose()


@pytest.mark.asyncio
async def test_ingest_waits_for_budget_before_allocating_the_next_frame(tmp_path: Path) -> None:
    wal = Wal(gate=anyio.Event())
    frame = bundle(1, rows=25_000)
    body = len(frame) - 5
    # Budget for one frame only: the server raises 0 to one largest frame.
    async with serving(tmp_path, wal, max_bundle_bytes=256 * KiB, max_pending_bytes=0) as h:
        server = h.server
        budget = server.budget.total_bytes
        assert body <= budget < 2 * body
        arrived = wal.arrived  # taken before sending: a big send returns only once read
        a = await h.connect(then=frame)
        await arrived.wait()
        assert server.stats.pending_bytes.value == body
        b = await h.connect(then=bundle(2, rows=25_000))
        await h.until(lambda: server.budget.waiting == 1)
        assert len(wal.received) == 1  # B's frame header arrived; its buffer was not allocated
        assert server.budget.waiting == 1 and server.stats.budget_waits.value == 1
        assert server.stats.pending_bytes.value == body
        wal.gate.set()  # A's ack gives its bytes back: B goes on
        with anyio.fail_after(3):
            assert isinstance(await a.next(), p.Ack)
            ack = await b.next()
        assert isinstance(ack, p.Ack) and ack.request_id == 2
        assert server.budget.held == 0
        await a.aclose()
        await b.aclose()


@pytest.mark.asyncio
async def test_ingest_connection_ending_with_bundles_in_flight_returns_budget_after_answers(
        tmp_path: Path) -> None:
    wal = Wal(gate=anyio.Event())
    async with serving(tmp_path, wal) as h:
        server = h.server
        arrived = wal.arrived
        peer = await h.connect(then=bundle(1))
        await arrived.wait()
        await peer.stream.send(b"\x05\x00\x00\x00\xee")  # unknown frame type: MALFORMED
        with anyio.fail_after(3):
            err = await peer.error()
        assert err.code == p.ErrorCode.MALFORMED
        # The bundle still sits in the WAL writer: its bytes are still counted.
        assert server.budget.held > 0
        assert server.stats.connections.value == 0  # its slot was freed at the hang-up
        wal.gate.set()
        await h.until(lambda: server.budget.held == 0)  # answered (and not sent)


@pytest.mark.asyncio
async def test_ingest_duplicate_request_id_in_flight_is_malformed(tmp_path: Path) -> None:
    wal = Wal(gate=anyio.Event())
    async with serving(tmp_path, wal) as h:
        peer = await h.connect()
        await peer.stream.send(bundle(5) + bundle(5))
        with anyio.fail_after(3):
            err = await peer.error()
        assert err.code == p.ErrorCode.MALFORMED
        assert "request_id 5 is already in flight" in err.message


@pytest.mark.asyncio
async def test_ingest_stop_ends_a_wait_for_budget(tmp_path: Path) -> None:
    wal = Wal(gate=anyio.Event())
    async with serving(tmp_path, wal, max_bundle_bytes=256 * KiB,
                       max_pending_bytes=0) as h:
        server = h.server
        arrived = wal.arrived
        await h.connect(then=bundle(1, rows=25_000))
        await arrived.wait()
        b = await h.connect(then=struct.pack("<IB", 250 * KiB, p.FrameType.BUNDLE))
        await h.until(lambda: server.budget.waiting == 1)
        server.stop()  # b waits for budget: stopping ends that wait
        wal.gate.set()
        with anyio.fail_after(3):
            err = await b.error()
        assert err.code == p.ErrorCode.SHUTTING_DOWN


@pytest.mark.asyncio
async def test_ingest_wait_for_budget_is_timed_as_a_stall_and_names_the_budget(
        tmp_path: Path) -> None:
    """Issue 26: a frame waiting for budget was never timed, so a uid's frames queued
    behind its own stalled ones waited wave after wave of idle timeouts. Now the wait is
    a stall from its start: closed after idle_timeout_ms, saying what it waited for."""
    wal = Wal(gates={"a": anyio.Event(), "b": anyio.Event()})
    async with serving(tmp_path, wal, max_bundle_bytes=256 * KiB, max_pending_bytes=0,
                       idle_timeout_ms=300) as h:
        server = h.server
        arrived = wal.arrived
        first = bundle(1, rows=25_000, client="a")
        a = await h.connect(then=first)  # most of the budget
        await arrived.wait()
        arrived = wal.arrived
        big = bundle(2, rows=25_000, client="b")
        b = await h.connect(then=bundle(1, client="b") + big)
        await arrived.wait()  # b's small bundle is in flight; its big one waits
        await h.until(lambda: server.budget.waiting == 1)
        started = anyio.current_time()
        wal.gates["b"].set()  # b's window empties while b waits for budget
        with anyio.fail_after(3):
            assert isinstance(await b.next(), p.Ack)
            err = await b.error()
        waited = anyio.current_time() - started
        assert err.code == p.ErrorCode.TIMEOUT and 0.25 <= waited < 1.5
        assert "frame stalled: waited" in err.message
        assert f"for {len(big) - 5} bytes of the pending-bytes budget" in err.message
        assert "uid 0 holds" in err.message and "max_pending_bytes_per_uid" in err.message
        assert server.budget.waiting == 0
        assert server.budget.held == len(first) - 5  # b's are given back; a's in flight
        assert server.stats.connections.value == 1  # a waits for its ack: never idle
        wal.gates["a"].set()
        with anyio.fail_after(3):
            assert isinstance(await a.next(), p.Ack)
        await h.until(lambda: server.budget.held == 0)


@pytest.mark.asyncio
async def test_ingest_fresh_connection_is_acked_while_its_uids_stalled_frames_hold_its_share(
        tmp_path: Path) -> None:
    """Issue 26: stalled frames of one uid held its whole share (and more waited behind
    them), so the uid's fresh connection got no ACK until they all timed out, wave after
    wave. A stalled frame holding budget another frame waits for gives it up after
    CONTENDED_STALL_MS; one nobody waits for is closed after idle_timeout_ms."""
    frame_len = 256 * KiB  # announced; each sends 16 KiB of it and stalls
    async with serving(tmp_path, max_bundle_bytes=256 * KiB, max_pending_bytes=2 * 1024 * KiB,
                       max_pending_bytes_per_uid=1024 * KiB, idle_timeout_ms=2500) as h:
        server = h.server
        began = anyio.current_time()
        stalled = [await h.connect(then=struct.pack("<IB", frame_len, p.FrameType.BUNDLE)
                                   + bytes(16 * KiB)) for _ in range(9)]
        await h.until(lambda: server.budget.waiting == 5)  # 4 hold the share, 5 wait
        started = anyio.current_time()
        fresh = await h.connect(then=bundle(1))
        with anyio.fail_after(3):  # the old code: after two idle timeouts (5 s)
            ack = await fresh.next()
        took = anyio.current_time() - started
        assert isinstance(ack, p.Ack) and ack.request_id == 1
        # The 5 granted after the first 4 gave up had been stalled since they began to
        # wait: one contended stall in all, not an idle timeout per wave.
        assert took < 2, f"the fresh connection's ACK took {took:.1f} s"
        contended = idle = 0
        for peer in stalled:
            with anyio.fail_after(6):
                err = await peer.error()
            assert err.code == p.ErrorCode.TIMEOUT and "frame stalled" in err.message
            if "while other frames wait for the budget it holds" in err.message:
                assert f"({frame_len - 1} bytes; uid 0 holds" in err.message
                contended += 1
            else:  # granted once nobody else waited: the idle timeout, from its wait
                assert "nothing received for 2500 ms" in err.message
                assert anyio.current_time() - began >= 2.4
                idle += 1
        assert contended >= 4 and contended + idle == 9
        await h.until(lambda: server.budget.held == 0 and server.budget.waiting == 0)
        assert server.stats.connections.value == 1  # the fresh one


@pytest.mark.asyncio
async def test_ingest_job_frames_wait_for_the_pending_budget_like_bundles(
        tmp_path: Path) -> None:
    """Issue 17: a JOB frame's buffer (up to 1 MiB) was allocated outside the budget, so
    stalled JOB frames on many connections held memory without bound."""
    mib = 1024 * KiB
    body = b'{"op": "status", "job_id": "j"' + b" " * (mib - 64) + b"}"  # valid JSON
    frame = struct.pack("<IBII", 1 + 8 + len(body), p.FrameType.JOB, 1, len(body)) + body
    async with serving(tmp_path, max_bundle_bytes=mib, max_pending_bytes=4 * mib,
                       max_pending_bytes_per_uid=4 * mib) as h:
        server = h.server
        before = pa.total_allocated_bytes()
        peers = [await h.connect() for _ in range(16)]
        for peer in peers:  # 16 JOB frames of 1 MiB announced, each stalled after 64 KiB
            await peer.stream.send(frame[: 64 * KiB])
        await h.until(lambda: server.budget.waiting == 12)  # 4 fit the 4 MiB budget
        assert server.budget.held == 4 * (len(frame) - 5)
        # The 12 others allocated nothing (the old code: 16 MiB of frame buffers).
        assert pa.total_allocated_bytes() - before <= 4 * mib + 64 * KiB
        async with anyio.create_task_group() as tg:  # the rest, as the budget comes back
            for peer in peers:
                tg.start_soon(peer.stream.send, frame[64 * KiB:])
        for peer in peers:  # each answered (this server takes no job requests)
            with anyio.fail_after(10):
                err = await peer.next()
            assert isinstance(err, p.Error) and err.request_id == 1
            assert "takes no job requests" in err.message
        await h.until(lambda: server.budget.held == 0)
