"""The reference side of ``bench/ingest.py``: ``bench/reference.py`` (the minimal durable
server, a measuring stick) driven by producer processes that mirror quiverd's.

Each producer does what ``quiverd.client.Client.iter_send`` does per bundle on its own
side: encode the table to an IPC stream (``encode_ipc_stream``, the client's call),
gather the frame into one ``sendmsg``, keep up to ``window`` bundles in flight (refill
the window, then read acks), time each bundle from submit start to the ``recv`` that
brought its ack. Only the frame header differs: ``u32 length`` instead of quiverd's.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from _common import process_cpu_s

from quiverd.client.core import tune_socket
from quiverd.kernel.bundle import encode_ipc_stream

SERVER = Path(__file__).resolve().parent / "reference.py"
FRAME_LEN = struct.Struct("<I")
ACK_BYTES = 8
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


@dataclass
class ReferenceRun:
    """The timed phase of one reference run."""

    seconds: float
    bundles: int
    latencies_s: list[float]
    server_cpu_s: float  # user + system, all threads of the reference server
    producer_cpu_s: float


class ReferenceServer:
    """``bench/reference.py`` on a fresh directory; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, root: Path, shards: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qr-", dir=root))
        self.socket = self.dir / "reference.sock"
        self.log_path = self.dir / "reference.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--socket", str(self.socket), "--dir", str(self.dir),
             "--shards", str(shards)], stdout=subprocess.PIPE, stderr=self._log)
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"READY":
            self.stop()
            raise RuntimeError(f"reference server not ready ({line!r}):\n{self.log_tail()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 10) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def run_reference(*, producers: int, ipc: bytes, warmup: int, bundles: int, window: int,
                  shards: int, root: Path, timeout_s: float) -> ReferenceRun:
    """Start the reference server, drive it from ``producers`` processes (each ``warmup``
    untimed then ``bundles`` timed bundles), stop it; it must exit 0."""
    server = ReferenceServer(root, shards)
    ctx = mp.get_context("spawn")  # no fork after pyarrow's threads exist
    barrier = ctx.Barrier(producers + 1)
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(str(server.socket), ipc, warmup, bundles,
                                                 window, barrier, results))
             for _ in range(producers)]
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(timeout_s)
        except threading.BrokenBarrierError:
            first = results.get(timeout=10)
            raise RuntimeError(f"reference: a producer failed before the timed phase: "
                               f"{first.get('error')}\n{server.log_tail()}") from None
        cpu_before = process_cpu_s(server.pid)
        outs = [results.get(timeout=timeout_s) for _ in procs]
        cpu = process_cpu_s(server.pid) - cpu_before
        for proc in procs:
            proc.join(timeout_s)
        failed = [o["error"] for o in outs if "error" in o]
        if failed:
            raise RuntimeError(f"reference: producer failed: {failed[0]}\n{server.log_tail()}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        exit_code = server.stop()
        log = server.log_tail()
        server.remove()
    if exit_code != 0:
        raise RuntimeError(f"reference server exited with {exit_code}:\n{log}")
    start, end = min(o["t0"] for o in outs), max(o["t1"] for o in outs)
    return ReferenceRun(seconds=end - start, bundles=sum(o["bundles"] for o in outs),
                        latencies_s=list(itertools.chain.from_iterable(o["lat"] for o in outs)),
                        server_cpu_s=cpu, producer_cpu_s=sum(o["cpu_s"] for o in outs))


def _producer(socket_path: str, ipc: bytes, warmup: int, count: int, window: int,
              barrier: Any, results: Any) -> None:
    """One producer process: warm up, wait for the others, send the timed volume."""
    try:
        table = pa.ipc.open_stream(ipc).read_all()
        if len(encode_ipc_stream(table)) != len(ipc):
            raise AssertionError("the re-encoded table differs in size from the payload")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            tune_socket(sock)
            sock.connect(socket_path)
            _pipeline(sock, table, warmup, window, [])
            barrier.wait(600)
            lat: list[float] = []
            cpu0, t0 = _own_cpu_s(), time.perf_counter()
            _pipeline(sock, table, count, window, lat)
            t1 = time.perf_counter()
        results.put({"t0": t0, "t1": t1, "bundles": count, "lat": lat,
                     "cpu_s": _own_cpu_s() - cpu0})
    except BaseException as exc:  # reported to the parent, which fails the run
        barrier.abort()
        results.put({"error": repr(exc), "t0": 0.0, "t1": 0.0, "bundles": 0, "lat": [],
                     "cpu_s": 0.0})


def _pipeline(sock: socket.socket, table: pa.Table, count: int, window: int,
              lat: list[float]) -> None:
    """Send ``count`` bundles, at most ``window`` unacked; append each one's latency."""
    started: deque[float] = deque()  # submit times of unacked bundles, in order
    buf = bytearray(64 * 1024)
    sent = acked = spare = 0  # spare: bytes of a partly received ack
    while acked < count:
        while sent < count and sent - acked < window:
            t0 = time.perf_counter()
            payload = encode_ipc_stream(table)
            _sendall(sock, [FRAME_LEN.pack(len(payload)), payload])
            started.append(t0)
            sent += 1
        n = sock.recv_into(buf)
        if n == 0:
            raise ConnectionError("the reference server closed the connection")
        now = time.perf_counter()
        done, spare = divmod(spare + n, ACK_BYTES)
        for _ in range(done):
            lat.append(now - started.popleft())
        acked += done


def _sendall(sock: socket.socket, parts: list[bytes]) -> None:
    # As the quiverd client: one gathering sendmsg, payloads never joined.
    views = deque(memoryview(p) for p in parts)
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.popleft())
            else:
                views[0] = views[0][sent:]
                sent = 0


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
