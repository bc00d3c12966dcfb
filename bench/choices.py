"""The measurements behind hot-path choices: not built (issue 11), and issue 18's.

    python bench/choices.py [--mib 256] [--dir PATH] [--only space,crc,...]

1. WAL space: 1 MiB appends, fdatasync after each, into a file that is
   fresh (the baseline: what the WAL does), preallocated with ``fallocate``
   (``KEEP_SIZE``, and size-changing ``posix_fallocate``), or recycled (written and
   synced once before, so its pages are allocated and cached). Ratio = MiB/s / fresh.
2. CRC-32C of 1 MiB: google_crc32c's extension against its library's C function by
   ctypes (what ``quiverd.kernel.crc`` does for large buffers), each alone and in two
   threads at once (two-thread time / one-thread time: ≈ 2 = holds the GIL, ≈ 1 =
   releases it).
3. A CRC-32C combine in pure Python (what checksumming each byte once would need, per
   payload), against one C pass over the 1 MiB payload.

Issue 18 (one loop pass per read batch, long-lived writer/syncer threads), all under uvloop:

4. handoff: one ``anyio.to_thread.run_sync`` round trip per batch against a long-lived
   thread fed by ``queue.SimpleQueue`` that answers with one ``call_soon_threadsafe``.
5. stream: an anyio memory object stream, one send/receive per item, against appending
   each item to a ``collections.deque`` and waking the consumer once per batch.
6. schema: the per-bundle schema checks (``check_field_names``, ``fingerprint``,
   ``reject_compressed_bodies``) on a 64 KiB bundle, against a dict lookup keyed by the
   stream's schema message bytes.
7. validate: ``open_stream`` + ``validate(full=True)`` of a 64 KiB and a 1 MiB bundle,
   the per-bundle cost no cache removes.

Rounds alternate the variants; medians are printed. Run ``--only`` to pick parts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import google_crc32c
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import make_table  # noqa: E402

from quiverd.kernel import crc as crcmod  # noqa: E402
from quiverd.kernel.bundle import (  # noqa: E402
    check_field_names,
    fingerprint,
    reject_compressed_bodies,
)

MiB = 1 << 20
ROUNDS = 4
FALLOC_FL_KEEP_SIZE = 1
POLY = 0x82F63B78  # CRC-32C, reflected


def wal_space(directory: Path, mib: int) -> dict[str, float]:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    chunk = os.urandom(MiB)

    def keep(fd: int) -> None:
        if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(mib * MiB)):
            raise OSError(ctypes.get_errno(), "fallocate")

    def recycle(fd: int) -> None:
        for _ in range(mib):
            os.write(fd, chunk)
        os.fdatasync(fd)

    preps: dict[str, Callable[[int], None]] = {
        "fresh": lambda fd: None, "fallocate KEEP_SIZE": keep,
        "posix_fallocate": lambda fd: os.posix_fallocate(fd, 0, mib * MiB),
        "recycled": recycle,
    }
    speeds: dict[str, list[float]] = {name: [] for name in preps}
    for _ in range(ROUNDS):
        for name, prep in preps.items():
            path = directory / "choices.wal"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                prep(fd)
                os.lseek(fd, 0, os.SEEK_SET)
                t0 = time.perf_counter()
                for _ in range(mib):
                    os.write(fd, chunk)
                    os.fdatasync(fd)
                speeds[name].append(mib / (time.perf_counter() - t0))
            finally:
                os.close(fd)
                path.unlink()
    return {name: statistics.median(v) for name, v in speeds.items()}


def _two_thread_ratio(work: Callable[[], None]) -> tuple[float, float]:
    t0 = time.perf_counter()
    work()
    one = time.perf_counter() - t0
    threads = [threading.Thread(target=work) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return one, (time.perf_counter() - t0) / one


def crc_paths() -> dict[str, tuple[float, float]]:
    buf = pa.py_buffer(os.urandom(64 * MiB))
    c_extend = crcmod._EXTEND
    paths: dict[str, Callable[[], object]] = {
        "google_crc32c extension": lambda: google_crc32c.extend(0, buf),
    }
    if c_extend is not None:
        paths["C function by ctypes"] = lambda: c_extend(0, buf.address, buf.size)
    out = {}
    for name, fn in paths.items():
        def work(fn: Callable[[], object] = fn) -> None:
            for _ in range(4):
                fn()
        runs = [_two_thread_ratio(work) for _ in range(ROUNDS)]
        per_mib_us = statistics.median(r[0] for r in runs) / (4 * 64) * 1e6
        out[name] = (per_mib_us, statistics.median(r[1] for r in runs))
    return out


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B from CRC(A), CRC(B) and len(B) (zlib's crc32_combine, CRC-32C)."""
    p, k, n = 1 << 31, 3, len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def combine_cost() -> tuple[float, float]:
    a, b = os.urandom(1000), os.urandom(MiB)
    assert crc_combine(google_crc32c.value(a), google_crc32c.value(b), MiB) == \
        google_crc32c.value(a + b)
    t0 = time.perf_counter()
    for _ in range(2000):
        crc_combine(123, 456, MiB + 17)
    combine_us = (time.perf_counter() - t0) / 2000 * 1e6
    buf = pa.py_buffer(b)
    t0 = time.perf_counter()
    for _ in range(200):
        crcmod.crc32c(memoryview(buf))
    pass_us = (time.perf_counter() - t0) / 200 * 1e6
    return combine_us, pass_us


# ---- issue 18: hand-offs and per-bundle checks ------------------------------------------
HOPS = 2000  # round trips per hand-off measurement
ITEMS = 20000  # items per stream measurement
BATCH = 16  # items per wake-up in the deque variant (a read batch of 16 frames)


class _Clock:
    """Wall time and CPU time of the whole process (every thread) since creation: CPU
    is what a hand-off costs the GIL-bound daemon, and a shared machine disturbs it less."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def per_us(self, count: int) -> tuple[float, float]:
        return ((time.perf_counter() - self.wall) / count * 1e6,
                (time.process_time() - self.cpu) / count * 1e6)


async def to_thread_hops() -> tuple[float, float]:
    """µs per ``anyio.to_thread.run_sync`` round trip (one per batch today)."""
    clock = _Clock()
    for i in range(HOPS):
        await anyio.to_thread.run_sync(abs, i)
    return clock.per_us(HOPS)


async def simple_queue_hops() -> tuple[float, float]:
    """µs per round trip through a long-lived thread: ``SimpleQueue.put`` there, one
    ``call_soon_threadsafe`` back (the writer/syncer threads' shape)."""
    loop = asyncio.get_running_loop()
    work: queue.SimpleQueue[tuple[asyncio.Future[int], int] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (item := work.get()) is not None:
            fut, value = item
            loop.call_soon_threadsafe(fut.set_result, abs(value))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    clock = _Clock()
    for i in range(HOPS):
        fut: asyncio.Future[int] = loop.create_future()
        work.put((fut, i))
        await fut
    used = clock.per_us(HOPS)
    work.put(None)  # this bench's own thread: a sentinel ends it
    thread.join()
    return used


async def stream_items() -> tuple[float, float]:
    """µs per item through an anyio memory object stream (send + receive each)."""
    send, receive = anyio.create_memory_object_stream[int](256)

    async def consume() -> None:
        async with receive:
            async for _ in receive:
                pass

    clock = _Clock()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        async with send:
            for i in range(ITEMS):
                await send.send(i)
    return clock.per_us(ITEMS)


async def deque_items() -> tuple[float, float]:
    """µs per item appended to a deque, the consumer woken once per ``BATCH`` items."""
    items: collections.deque[int] = collections.deque()
    wake = asyncio.Event()

    async def consume() -> None:
        got = 0
        while got < ITEMS:
            await wake.wait()
            wake.clear()
            while items:
                items.popleft()
                got += 1

    clock = _Clock()
    consumer = asyncio.ensure_future(consume())
    for start in range(0, ITEMS, BATCH):
        for i in range(start, min(start + BATCH, ITEMS)):
            items.append(i)
        wake.set()
        await asyncio.sleep(0)  # a read callback returns to the loop after each batch
    await consumer
    return clock.per_us(ITEMS)


def handoffs() -> dict[str, tuple[float, float]]:
    """Medians (wall µs, CPU µs) of the four async measurements, under uvloop as the
    daemon runs."""
    runs: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)

    async def rounds() -> None:
        for _ in range(ROUNDS):
            runs["to_thread.run_sync per batch"].append(await to_thread_hops())
            runs["SimpleQueue + call_soon_threadsafe"].append(await simple_queue_hops())
            runs["memory stream, per item"].append(await stream_items())
            runs[f"deque, one wake per {BATCH} items"].append(await deque_items())

    anyio.run(rounds, backend="asyncio", backend_options={"use_uvloop": True})
    return {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for name, v in runs.items()}


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    # Thread CPU time: single-threaded calls, not slowed by other processes' turns.
    times = []
    for _ in range(ROUNDS):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(times)


def schema_checks() -> dict[str, float]:
    """µs per 64 KiB bundle: each schema check, and a cache keyed by the schema message.

    An IPC stream opens with its schema message, ``0xFFFFFFFF | i32 metadata length |
    metadata`` and no body: those bytes identify the schema exactly.
    """
    _, ipc = make_table(64 * 1024)
    payload = pa.py_buffer(ipc)
    schema = pa.ipc.open_stream(payload).schema
    view = memoryview(ipc)
    cache = {bytes(view[:8 + int.from_bytes(view[4:8], "little")]): fingerprint(schema)}

    def lookup() -> object:
        return cache.get(bytes(view[:8 + int.from_bytes(view[4:8], "little")]))

    out = {
        "open_stream + .schema": _per_call_us(lambda: pa.ipc.open_stream(payload).schema,
                                              2000),
        "check_field_names(schema)": _per_call_us(lambda: check_field_names(schema), 2000),
        "fingerprint(schema)": _per_call_us(lambda: fingerprint(schema), 2000),
        "reject_compressed_bodies(payload)": _per_call_us(
            lambda: reject_compressed_bodies(payload), 2000),
        "dict lookup by schema message bytes": _per_call_us(lookup, 20000),
    }
    assert lookup() is not None
    return out


def schema_key_hides_compression() -> bool:
    """Whether a zstd-compressed stream of the same table has the same schema message
    bytes: compression is flagged per record batch, so a cache keyed by the schema
    cannot stand in for ``reject_compressed_bodies``."""
    table, ipc = make_table(64 * 1024)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write(table)
    packed = sink.getvalue().to_pybytes()

    def key(stream: bytes) -> bytes:
        return stream[:8 + int.from_bytes(stream[4:8], "little")]

    return key(packed) == key(ipc) and len(packed) < len(ipc)


def validate_cost() -> dict[str, tuple[float, float]]:
    """µs per bundle and GB/s: open the stream, ``validate(full=True)`` each batch."""
    out = {}
    for size, name in ((64 * 1024, "64 KiB"), (MiB, "1 MiB")):
        _, ipc = make_table(size)
        payload = pa.py_buffer(ipc)

        def check(payload: pa.Buffer = payload) -> None:
            for batch in pa.ipc.open_stream(payload):
                batch.validate(full=True)

        us = _per_call_us(check, max(200_000_000 // size // 100, 20))
        out[name] = (us, len(ipc) / us / 1e3)
    return out


def gil_wait(switch_s: float, samples: int = 200) -> tuple[float, float]:
    """With the main thread busy in Python (the loop validating frames), how long a
    thread back from a GIL-free wait (a 200 µs sleep standing in for fdatasync) waits
    to run Python again; and the main thread's work done meanwhile (per second), which
    forced switches cost. Returns (median wait µs, main-thread work units per s)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    waits: list[float] = []
    done = threading.Event()

    def syncer() -> None:
        for _ in range(samples):
            t0 = time.perf_counter()
            time.sleep(0.0002)
            waits.append(time.perf_counter() - t0 - 0.0002)
        done.set()

    try:
        thread = threading.Thread(target=syncer, daemon=True)
        started, work = time.perf_counter(), 0
        thread.start()
        while not done.is_set():
            sum(range(2000))  # ~20 µs of pure Python, GIL held
            work += 1
        thread.join()
        return statistics.median(waits) * 1e6, work / (time.perf_counter() - started)
    finally:
        sys.setswitchinterval(old)


def issue18(parts: list[str]) -> None:
    if "handoff" in parts or "stream" in parts:
        hops = handoffs()
        print("\n| hand-off under uvloop, per round trip or item | wall µs | CPU µs (all "
              "threads) |\n|---|---:|---:|\n"
              + "\n".join(f"| {k} | {w:.1f} | {c:.1f} |" for k, (w, c) in hops.items()))
    if "schema" in parts:
        checks = schema_checks()
        print("\n| per 64 KiB bundle | CPU µs |\n|---|---:|")
        for name, us in checks.items():
            print(f"| {name} | {us:.2f} |")
        print(f"\nSchema message bytes of a zstd-compressed stream equal the plain one's: "
              f"{schema_key_hides_compression()} (then the compression check stays per bundle)")
    if "switch" in parts:
        print("\n| GIL switch interval | thread's wait for the GIL after a GIL-free call, "
              "µs (median) | busy main thread's work / s |\n|---|---:|---:|")
        for switch_s in (0.005, 0.0005):
            wait_us, work = gil_wait(switch_s)
            print(f"| {switch_s * 1000:g} ms | {wait_us:.0f} | {work:.0f} |")
    if "validate" in parts:
        print("\n| open_stream + validate(full=True) | CPU µs per bundle | GB/s |"
              "\n|---|---:|---:|")
        for name, (us, gb_s) in validate_cost().items():
            print(f"| {name} | {us:.1f} | {gb_s:.1f} |")


PARTS = ("space", "crc", "combine", "handoff", "stream", "schema", "validate", "switch")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB written per WAL-space run")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--only", type=lambda s: s.split(","), default=list(PARTS),
                   metavar="PART,...", help=f"run only these of {','.join(PARTS)}")
    args = p.parse_args()
    print(f"# hot-path choices: {os.cpu_count()} cores, files under {args.dir}, "
          f"{ROUNDS} rounds, medians")
    if "space" in args.only:
        space = wal_space(args.dir, args.mib)
        print("\n| WAL file, 1 MiB write + fdatasync | MiB/s | vs fresh |\n|---|---:|---:|")
        for name, speed in space.items():
            print(f"| {name} | {speed:.0f} | {speed / space['fresh']:.2f}x |")
    if "crc" in args.only:
        print("\n| CRC-32C path | µs per MiB | two threads / one (2 = holds the GIL) |"
              "\n|---|---:|---:|")
        for name, (us, ratio) in crc_paths().items():
            print(f"| {name} | {us:.0f} | {ratio:.2f} |")
    if "combine" in args.only:
        combine_us, pass_us = combine_cost()
        print(f"\nCRC-32C combine in Python: {combine_us:.1f} µs (held under the GIL) per "
              f"use; one GIL-free pass over 1 MiB: {pass_us:.1f} µs")
    issue18(args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
