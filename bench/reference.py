"""A minimal durable ingest server: NOT PRODUCT CODE, A MEASURING STICK (issue 18).

    python bench/reference.py --socket PATH --dir WALDIR [--shards 2]

What can one Python process with one event loop ack per second while doing quiverd's
per-bundle essentials? ``bench/ingest.py`` runs this beside quiverd and divides
(the "Python-floor ratio"). It keeps the one promise that matters, ack only after the
covering fdatasync, and skips everything else quiverd does (protocol header, client
names, budgets, metrics, open segments, recovery).

Wire format (lean, not quiverd's):

    producer -> server   u32 length (LE) | Arrow IPC stream of `length` bytes
    server -> producer   u64 sequence (LE), per frame, in order, after its fdatasync

Per frame, on the loop: ``recv_into`` straight into a pooled per-frame buffer
(``asyncio.BufferedProtocol``, one copy), CRC-32C (``quiverd.kernel.crc``, the same
function quiverd uses), a full Arrow read + ``validate(full=True)``, then the frame joins
its shard's pending list (connection i -> shard i % shards). Per shard, two long-lived
threads: the writer ``os.writev``s everything pending (8-byte entry header: length +
CRC) into a fresh file; the syncer ``fdatasync``s everything written so far and acks
every covered frame with one ``call_soon_threadsafe``. Writes go on while a sync runs.
A failed write or sync stops the server with exit code 1, nothing further acked.

Prints READY when listening; exits 0 on SIGTERM. Derived from the lean_ingest.py
reference in the shared notes (its --validate --pipelined --buffered mode).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pyarrow as pa
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quiverd.kernel.crc import crc32c  # noqa: E402

ENTRY_HEADER = struct.Struct("<II")  # payload length, CRC-32C of the payload
FRAME_LEN = struct.Struct("<I")
ACK = struct.Struct("<Q")
IOV_MAX = 1024
POOL_BUFFERS = 32  # spare frame buffers kept per connection
MAX_FRAME_BYTES = 64 << 20  # quiverd's default ingest.max_bundle_bytes
SOCKET_BUFFER_BYTES = 4 << 20  # as quiverd's client and server


class Shard:
    """One WAL file, a writer thread and a syncer thread."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop,
                 fail: Callable[[BaseException], None]) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
        self.loop, self.fail = loop, fail
        self.pending_cv = threading.Condition()
        self.pending: list[tuple[bytes, bytearray, Conn, int]] = []
        self.written_cv = threading.Condition()
        self.written: list[tuple[Conn, int]] = []
        for target in (self._write_loop, self._sync_loop):
            threading.Thread(target=self._guard, args=(target,), daemon=True).start()

    def add(self, header: bytes, payload: bytearray, conn: Conn, seq: int) -> None:
        with self.pending_cv:
            self.pending.append((header, payload, conn, seq))
            self.pending_cv.notify()

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # an I/O error is fatal: the loop stops the server
            self.loop.call_soon_threadsafe(self.fail, exc)

    def _write_loop(self) -> None:
        while True:
            with self.pending_cv:
                while not self.pending:
                    self.pending_cv.wait()
                batch, self.pending = self.pending, []
            pieces = [p for header, payload, _, _ in batch for p in (header, payload)]
            for i in range(0, len(pieces), IOV_MAX):
                chunk = pieces[i:i + IOV_MAX]
                if os.writev(self.fd, chunk) != sum(len(p) for p in chunk):
                    raise OSError("short write to the WAL file")
            with self.written_cv:
                self.written.extend((conn, seq) for _, _, conn, seq in batch)
                self.written_cv.notify()

    def _sync_loop(self) -> None:
        while True:
            with self.written_cv:
                while not self.written:
                    self.written_cv.wait()
                covered, self.written = self.written, []
            os.fdatasync(self.fd)  # covers every write claimed above, and maybe more
            self.loop.call_soon_threadsafe(ack_all, covered)


def ack_all(covered: list[tuple[Conn, int]]) -> None:
    """On the loop: one write of acks per connection for a whole group commit."""
    by_conn: dict[Conn, list[bytes]] = {}
    for conn, seq in covered:
        by_conn.setdefault(conn, []).append(ACK.pack(seq))
        conn.release(seq)
    for conn, acks in by_conn.items():
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.write(b"".join(acks))


class Conn(asyncio.BufferedProtocol):
    """``recv_into`` per-frame buffers from a pool (one copy: kernel -> buffer); a buffer
    returns to the pool once its frame is acked (nothing reads it after the write)."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.transport: asyncio.Transport | None = None
        self.header = bytearray(FRAME_LEN.size)
        self.frame: bytearray | None = None  # None: reading the length prefix
        self.got = 0
        self.seq = 0
        self.held: dict[int, bytearray] = {}  # bounded by the producer's window
        self.pool: list[bytearray] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self.header if self.frame is None else self.frame
        return memoryview(target)[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.frame is None:
            if self.got == len(self.header):
                (length,) = FRAME_LEN.unpack(self.header)
                if not 0 < length <= MAX_FRAME_BYTES:
                    self._refuse(f"frame length {length} outside 1..{MAX_FRAME_BYTES}")
                    return
                self.frame, self.got = self._take_buffer(length), 0
            return
        if self.got < len(self.frame):
            return
        payload, self.frame, self.got = self.frame, None, 0
        try:
            view = pa.py_buffer(payload)  # zero copy
            crc = crc32c(payload)
            with pa.ipc.open_stream(view) as reader:
                for batch in reader:
                    batch.validate(full=True)
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            self._refuse(str(exc))
            return
        self.held[self.seq] = payload
        self.shard.add(ENTRY_HEADER.pack(len(payload), crc), payload, self, self.seq)
        self.seq += 1

    def _refuse(self, why: str) -> None:
        # No error frame in the lean protocol: the producer sees the connection end.
        print(f"reference: frame {self.seq} refused: {why}", file=sys.stderr, flush=True)
        self.got = 0
        assert self.transport is not None
        self.transport.close()

    def _take_buffer(self, length: int) -> bytearray:
        for i, buf in enumerate(self.pool):
            if len(buf) == length:
                return self.pool.pop(i)
        return bytearray(length)

    def release(self, seq: int) -> None:
        buf = self.held.pop(seq, None)
        if buf is not None and len(self.pool) < POOL_BUFFERS:
            self.pool.append(buf)


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    failure: list[BaseException] = []

    def fail(exc: BaseException) -> None:
        failure.append(exc)
        stop.set()

    shards = [Shard(Path(args.dir) / f"reference-{i}.wal", loop, fail)
              for i in range(args.shards)]
    accepted = 0

    def accept() -> Conn:
        nonlocal accepted
        accepted += 1
        return Conn(shards[(accepted - 1) % len(shards)])

    server = await loop.create_unix_server(accept, args.socket)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("READY", flush=True)
    async with server:
        await stop.wait()
    if failure:
        print(f"reference: WAL I/O failed, stopping: {failure[0]!r}", file=sys.stderr,
              flush=True)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="Unix socket to listen on")
    ap.add_argument("--dir", required=True, help="directory for the fresh WAL files")
    ap.add_argument("--shards", type=int, default=2, help="WAL files (writer+syncer pairs)")
    return uvloop.run(serve(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
