"""What bench/segments.py needs beyond bench/_common.py: logs-like record batches,
a daemon with chosen ``[wal]``/``[segment]`` keys, and a timed producer process.

A logs-like batch has four columns, ~100 IPC bytes a row:

    ts       int64                       milliseconds, increasing
    level    dictionary<int32, utf8>     5 values, skewed (INFO most)
    service  dictionary<int32, utf8>     64 fixed values, or a drifting window
    message  utf8                        ~75 bytes, an HTTP access line

``stable`` batches all carry the same full dictionaries (a producer with a fixed
vocabulary: the finalizer's fast path). ``changing`` batches carry what
``dictionary_encode`` gives per batch: first-appearance order and a service
window that slides every batch, so no two dictionaries are equal and every
chunk needs a map (the unification path).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from _common import CLOCK_TICKS, Daemon  # bench/ is on sys.path (segments.py puts it there)

from quiverd.client.producer import Client
from quiverd.kernel.bundle import encode_ipc_stream

LEVELS = pa.array(["INFO", "DEBUG", "WARN", "ERROR", "FATAL"])
LEVEL_WEIGHTS = np.array([0.70, 0.15, 0.10, 0.04, 0.01])
STABLE_SERVICES = 64
SERVICE_UNIVERSE = pa.array([f"svc-{i:04d}-{'abcdefgh'[i % 8]}pi" for i in range(4096)])
SERVICE_WINDOW = 48  # services live in one changing batch
SERVICE_STEP = 7  # how far the window slides per batch
VERBS = pa.array(["GET", "GET", "GET", "POST", "PUT", "DELETE"])
RESOURCES = pa.array(["items", "users", "orders", "carts", "search", "health"])
STATUSES = pa.array(["200", "200", "200", "201", "204", "304", "404", "500"])
LOGS_SCHEMA_NAMES = ["ts", "level", "service", "message"]


def logs_batches(count: int, target_bytes: int, *, changing: bool, seed: int = 7
                 ) -> list[pa.RecordBatch]:
    """``count`` logs-like batches whose IPC streams are each ~``target_bytes``."""
    rng = np.random.default_rng(seed)
    probe = _logs_batch(2048, 0, rng, changing=changing, k=0)
    per_row = (len(encode_ipc_stream(probe)) - 1024) / 2048  # ~1 KiB of schema + dicts
    rows = max(int((target_bytes - 1024) / per_row), 16)
    return [_logs_batch(rows, k * rows, rng, changing=changing, k=k) for k in range(count)]


def _logs_batch(rows: int, first_row: int, rng: np.random.Generator, *, changing: bool,
                k: int) -> pa.RecordBatch:
    ts = 1_700_000_000_000 + first_row * 3 + np.cumsum(rng.integers(0, 6, rows))
    level_idx = pa.array(rng.choice(len(LEVELS), rows, p=LEVEL_WEIGHTS).astype(np.int32))
    if changing:
        start = (k * SERVICE_STEP) % (len(SERVICE_UNIVERSE) - SERVICE_WINDOW)
        svc_idx = pa.array(start + rng.integers(0, SERVICE_WINDOW, rows))
        level = pc.dictionary_encode(LEVELS.take(level_idx))
        service = pc.dictionary_encode(SERVICE_UNIVERSE.take(svc_idx))
    else:
        svc_idx = pa.array(rng.integers(0, STABLE_SERVICES, rows).astype(np.int32))
        level = pa.DictionaryArray.from_arrays(level_idx, LEVELS)
        service = pa.DictionaryArray.from_arrays(svc_idx, SERVICE_UNIVERSE[:STABLE_SERVICES])
    message = _messages(rows, first_row, rng)
    return pa.record_batch([pa.array(ts, pa.int64()), level, service, message],
                           names=LOGS_SCHEMA_NAMES)


def _messages(rows: int, first_row: int, rng: np.random.Generator) -> pa.Array:
    """'GET /api/v2/orders/123456 status=200 bytes=5123 took=17ms trace=8f3a...' lines."""
    def num(values: np.ndarray) -> pa.Array:
        return pc.cast(pa.array(values), pa.utf8())

    def pick(choices: pa.Array) -> pa.Array:
        return choices.take(pa.array(rng.integers(0, len(choices), rows)))

    trace = pc.utf8_lpad(num(rng.integers(0, 2**62, rows)), 19, "0")
    return pc.binary_join_element_wise(
        pick(VERBS), " /api/v", num(rng.integers(1, 4, rows)), "/", pick(RESOURCES), "/",
        num(np.arange(first_row, first_row + rows) * 7919 % 10**7), " status=",
        pick(STATUSES), " bytes=", num(rng.integers(0, 65536, rows)), " took=",
        num(rng.integers(0, 2000, rows)), "ms trace=", trace, "")


def configured_daemon(root: Path, *, shards: int, wal: dict[str, Any],
                      segment: dict[str, Any]) -> Daemon:
    """``_common.Daemon`` with chosen ``[wal]`` and ``[segment]`` keys (others default).

    The lake is off: with it on (the default) the uploader's Parquet encoding (≈ 0.25 GB/s
    per core) shares the 2 cores and sets the pace of "segments on"; bench/lake.py
    measures that. This measures what finalizing segments costs ingest.
    """
    settings = {f"wal.{k}": v for k, v in wal.items() if k != "flush_policy"}
    settings.update({f"segment.{k}": v for k, v in segment.items()})
    settings["log.level"] = "info"
    settings["lake.enabled"] = False
    return Daemon(root, policy=wal.get("flush_policy", "interval"), shards=shards,
                  settings=settings)


def producer(socket_path: str, name: str, payloads: list[bytes], warmup: int, bundles: int,
             barrier: Any, results: Any) -> None:
    """One producer process: send ``warmup`` bundles, wait for the others, then time
    ``bundles`` more, cycling through ``payloads`` (IPC streams), pipelined."""
    try:
        tables = [pa.ipc.open_stream(p).read_all() for p in payloads]
        with Client.connect(socket_path) as client:
            for _ in client.iter_send(itertools.islice(itertools.cycle(tables), warmup),
                                      client=name):
                pass
            barrier.wait(300)
            cpu0, t0 = _own_cpu_s(), time.perf_counter()
            sent = sum(1 for _ in client.iter_send(
                itertools.islice(itertools.cycle(tables), bundles), client=name))
            t1 = time.perf_counter()
        results.put({"t0": t0, "t1": t1, "bundles": sent, "cpu_s": _own_cpu_s() - cpu0})
    except BaseException as exc:  # reported to the parent, which fails the run
        barrier.abort()
        results.put({"error": repr(exc), "t0": 0.0, "t1": 0.0, "bundles": 0, "cpu_s": 0.0})


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def process_cpu_s() -> dict[int, tuple[int, float]]:
    """(parent pid, CPU seconds) of every user-space process (kernel threads, such as
    the writeback workers our own I/O wakes, have no cmdline and are left out)."""
    out: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if not f.read(1):
                    continue
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the process ended while we looked
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]),
                                (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


def others_cpu_s(before: dict[int, tuple[int, float]],
                 after: dict[int, tuple[int, float]]) -> float:
    """CPU seconds used between two snapshots by processes outside this one's tree."""
    ours = {os.getpid()}
    grew = True
    while grew:  # descendants: the daemon, producers, py-spy, their helpers
        new = {pid for pid, (ppid, _) in after.items() if ppid in ours} - ours
        ours |= new
        grew = bool(new)
    return sum(cpu - before.get(pid, (0, 0.0))[1]
               for pid, (_, cpu) in after.items() if pid not in ours)
