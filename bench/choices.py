"""The measurements behind hot-path choices that were *not* built (issue 11).

    python bench/choices.py [--mib 256] [--dir PATH]

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

Rounds alternate the variants; medians are printed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quiverd.kernel import crc as crcmod  # noqa: E402

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB written per WAL-space run")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args()
    print(f"# hot-path choices: {os.cpu_count()} cores, files under {args.dir}, "
          f"{ROUNDS} rounds, medians")
    space = wal_space(args.dir, args.mib)
    print("\n| WAL file, 1 MiB write + fdatasync | MiB/s | vs fresh |\n|---|---:|---:|")
    for name, speed in space.items():
        print(f"| {name} | {speed:.0f} | {speed / space['fresh']:.2f}x |")
    print("\n| CRC-32C path | µs per MiB | two threads / one (2 = holds the GIL) |"
          "\n|---|---:|---:|")
    for name, (us, ratio) in crc_paths().items():
        print(f"| {name} | {us:.0f} | {ratio:.2f} |")
    combine_us, pass_us = combine_cost()
    print(f"\nCRC-32C combine in Python: {combine_us:.1f} µs (held under the GIL) per use; "
          f"one GIL-free pass over 1 MiB: {pass_us:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
