"""bench/reference.py, the measuring stick of bench/ingest.py: it must keep the promise it
is compared on (ack each frame, in order, after its bytes are in the WAL file), refuse a
frame Arrow rejects, and exit 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pyarrow as pa
import pytest

from quiverd.kernel.bundle import encode_ipc_stream
from quiverd.kernel.crc import crc32c

SERVER = Path(__file__).resolve().parents[2] / "bench" / "reference.py"
ENTRY_HEADER = struct.Struct("<II")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    sock = tmp_path / "ref.sock"
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--socket", str(sock), "--dir", str(tmp_path),
         "--shards", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"READY"
        yield proc, sock
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_reference_acks_in_order_after_writing_each_frame(
        server: tuple[subprocess.Popen[bytes], Path], tmp_path: Path) -> None:
    proc, path = server
    payloads = [encode_ipc_stream(pa.table({"x": pa.array(range(n))})) for n in (1, 50, 3)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(b"".join(_frame(p) for p in payloads))
        acks = struct.unpack("<3Q", _recv_exactly(sock, 24))
    assert acks == (0, 1, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    wal = (tmp_path / "reference-0.wal").read_bytes()  # the first connection's shard
    offset = 0
    for payload in payloads:
        length, crc = ENTRY_HEADER.unpack_from(wal, offset)
        body = wal[offset + ENTRY_HEADER.size:offset + ENTRY_HEADER.size + length]
        assert (length, crc, body) == (len(payload), crc32c(payload), payload)
        offset += ENTRY_HEADER.size + length
    assert offset == len(wal)
    assert (tmp_path / "reference-1.wal").read_bytes() == b""


def test_reference_closes_a_connection_on_an_invalid_stream_without_ack(
        server: tuple[subprocess.Popen[bytes], Path], tmp_path: Path) -> None:
    proc, path = server
    good = encode_ipc_stream(pa.table({"x": pa.array([1, 2])}))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(_frame(good) + _frame(b"\xff" * 64))
        # The close may beat the good frame's ack (it stays written): never a second ack.
        assert _recv_exactly(sock, 16) in (b"", struct.pack("<Q", 0))
    wal, want = tmp_path / "reference-0.wal", ENTRY_HEADER.size + len(good)
    deadline = time.monotonic() + 10  # the writer thread is not waited for at exit
    while wal.stat().st_size < want and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert wal.stat().st_size == want


@pytest.mark.parametrize("length", [0, 64 * 1024 * 1024 + 1])
def test_reference_closes_a_connection_on_a_frame_length_out_of_bounds(
        server: tuple[subprocess.Popen[bytes], Path], length: int) -> None:
    _, path = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(struct.pack("<I", length))
        assert sock.recv(8) == b""


def _load_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_reference", SERVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_shard_never_acks_after_a_failed_fdatasync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _load_reference()
    acked: list[object] = []

    def fdatasync(fd: int) -> None:
        raise OSError(errno.EIO, "injected")

    # Only the reference module sees the failing fdatasync.
    monkeypatch.setattr(ref, "os", SimpleNamespace(**{**vars(os), "fdatasync": fdatasync}))
    monkeypatch.setattr(ref, "ack_all", acked.append)

    async def main() -> BaseException:
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[BaseException] = loop.create_future()
        shard = ref.Shard(tmp_path / "wal", loop, failed.set_result)
        shard.add(b"12345678", bytearray(b"payload"), object(), 0)
        return await asyncio.wait_for(failed, 10)

    exc = asyncio.run(main())
    assert isinstance(exc, OSError) and exc.errno == errno.EIO
    assert acked == []
    assert (tmp_path / "wal").read_bytes() == b"12345678payload"  # written, never acked
