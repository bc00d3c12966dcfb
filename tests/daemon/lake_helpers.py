"""Helpers for the lake's daemon tests: send known rows, read back what the lake holds."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq

from quiverd.client import Client
from quiverd.kernel.config import load
from quiverd.kernel.errors import QuiverError
from quiverd.kernel.logs import get as get_logger
from quiverd.lake.model import REGISTERED, FileRow
from quiverd.lake.tier import open_tier
from tests.conftest import DaemonProcess
from tests.tiers import size

BUNDLE_KEY = ("_quiver_shard", "_quiver_segment", "_quiver_bundle")
FAST_LAKE = {
    "segment.max_open_duration_ms": 100,
    "lake.file_duration_ms": 400,
    "lake.janitor.interval_s": 0,
    "lake.compaction.interval_s": 0,
}


def quiverd_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m quiverd ARGS`` (the lake commands read the daemon's config)."""
    return subprocess.run([sys.executable, "-m", "quiverd", *args], capture_output=True,
                          text=True, timeout=60)


def logs_table(client: int, batch: int, rows: int = 50) -> pa.Table:
    """Rows that say where they came from: (client, batch, i) is unique."""
    return pa.table({
        "client_no": pa.array([client] * rows, pa.int32()),
        "batch": pa.array([batch] * rows, pa.int64()),
        "i": pa.array(range(rows), pa.int64()),
        "msg": pa.array([f"c{client} b{batch} row {i}" for i in range(rows)]),
    })


def send_logs(d: DaemonProcess, clients: int, batches: int, *, two_slots_every: int = 3,
              start: int = 0) -> Counter[tuple[str, int]]:
    """Send ``batches`` bundles per client; every ``two_slots_every``-th also has slot 1.
    Returns rows sent per (client, slot)."""
    sent: Counter[tuple[str, int]] = Counter()
    with Client.connect(d.socket) as c:
        for b in range(start, start + batches):
            for k in range(clients):
                data: dict[int, pa.Table] = {0: logs_table(k, b)}
                if two_slots_every and b % two_slots_every == 0:
                    data[1] = pa.table({"batch": [b], "note": [f"side {k}/{b}"]})
                c.send(data, client=f"client-{k}")
                for slot, t in data.items():
                    sent[(f"client-{k}", slot)] += t.num_rows
    return sent


async def _rows(config_path: Path) -> list[FileRow]:
    cfg = load(config_path)
    async with open_tier(cfg, get_logger("test")) as tier:
        return await tier.catalog.list_files(states=REGISTERED)


def registered_rows(d: DaemonProcess) -> list[FileRow]:
    return anyio.run(_rows, d.config_path)


def read_object(row: FileRow, s3: Any = None) -> pa.Table:
    """A registered file's object, read with plain pyarrow: a file:// path, or an
    s3://bucket/key URI through a boto3 client ``s3`` (not through quiverd's code)."""
    if row.uri.startswith("file://"):
        return pq.read_table(uri_path(row.uri))
    parsed = urllib.parse.urlparse(row.uri)
    assert parsed.scheme == "s3" and s3 is not None, row.uri
    body = s3.get_object(Bucket=parsed.netloc, Key=urllib.parse.unquote(parsed.path[1:]))
    return pq.read_table(pa.BufferReader(body["Body"].read()))


def uri_path(uri: str) -> str:
    """The local path of a file:// URI (percent-decoded: keys hold ``client=``)."""
    parsed = urllib.parse.urlparse(uri)
    assert parsed.scheme == "file", uri
    return urllib.parse.unquote(parsed.path)


def lake_contents(d: DaemonProcess, s3: Any = None) -> tuple[list[FileRow], dict[str, pa.Table]]:
    rows = registered_rows(d)
    return rows, {r.file_id: read_object(r, s3) for r in rows}


def assert_exactly_once(rows: list[FileRow], tables: dict[str, pa.Table],
                        sent: Counter[tuple[str, int]]) -> None:
    """Every (bundle, slot) in exactly one registered file; row counts as sent."""
    got: Counter[tuple[str, int]] = Counter()
    seen: set[tuple[int, ...]] = set()
    for row in rows:
        t = tables[row.file_id]
        assert t.num_rows == row.row_count, row
        got[(row.client_name, row.slot)] += t.num_rows
        keys = set(zip(*(t.column(k).to_pylist() for k in BUNDLE_KEY), strict=True))
        for key in keys:
            assert (*key, row.slot) not in seen, f"bundle {key} slot {row.slot} in two files"
            seen.add((*key, row.slot))
    assert got == sent


def wait_for_lake(d: DaemonProcess, sent: Counter[tuple[str, int]], timeout: float = 60,
                  ) -> list[FileRow]:
    """Until the registered files hold as many rows as were sent (per client and slot)."""
    deadline = time.monotonic() + timeout
    rows: list[FileRow] = []
    while time.monotonic() < deadline:
        rows = registered_rows(d)
        got: Counter[tuple[str, int]] = Counter()
        for r in rows:
            got[(r.client_name, r.slot)] += r.row_count
        if got == sent:
            return rows
        assert all(got[k] <= sent[k] for k in got), f"more rows than sent: {got} vs {sent}"
        time.sleep(0.2)
    raise AssertionError(f"lake holds {sum(r.row_count for r in rows)} rows, "
                         f"sent {sum(sent.values())}:\n{d.log()[-4000:]}")


def wait_degraded(d: DaemonProcess, part: str, timeout: float = 30) -> dict[str, Any]:
    """Wait until ``status`` shows the lake ``part`` degraded; returns the lake section."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            lake: dict[str, Any] = d.status()["lake"]
        except QuiverError as exc:
            raise AssertionError(f"daemon gone (running: {d.running}):\n{d.log()[-3000:]}"
                                 ) from exc
        if part in lake.get("degraded", {}):
            return lake
        assert time.monotonic() < deadline, (lake, d.log()[-3000:])
        time.sleep(0.1)


def produce_through_kills(d: DaemonProcess, bundle: Callable[[int, int], Any], *,
                          rounds: int | None = None, seed: int = 9, producers: int = 2
                          ) -> set[tuple[int, int]]:
    """``rounds`` (default: 2 in the smoke tier, 4 in the full one) times: ``producers``
    threads send ``bundle(k, b)`` as client-k until the daemon is SIGKILLed at a random
    moment (0.3-1.5 s after the round's first acknowledgement: a loaded machine's first
    fdatasync can take longer than the whole window), then it restarts. Returns the
    (k, b) the daemon acknowledged; a send the kill cut off does not count."""
    import random
    import threading

    acked: set[tuple[int, int]] = set()
    rng = random.Random(seed)
    for round_no in range(size(2, 4) if rounds is None else rounds):
        stop = threading.Event()
        first_ack = threading.Event()
        errors: list[BaseException] = []

        def produce(k: int, round_no: int = round_no, stop: threading.Event = stop,
                    first_ack: threading.Event = first_ack,
                    errors: list[BaseException] = errors) -> None:
            try:
                with Client.connect(d.socket) as c:
                    b = round_no * 100_000
                    while not stop.is_set():
                        c.send(bundle(k, b), client=f"client-{k}")
                        acked.add((k, b))  # only once the daemon acknowledged it
                        first_ack.set()
                        b += 1
            except Exception as e:  # the daemon died under us: unacknowledged sends
                errors.append(e)    # do not count

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not first_ack.wait(0.05):
            if len(errors) == producers or time.monotonic() > deadline:
                stop.set()
                raise AssertionError(f"round {round_no}: no acknowledgement; producers' "
                                     f"errors {errors!r}; log {d.log()[-2000:]}")
        time.sleep(rng.uniform(0.3, 1.5))
        d.kill()
        stop.set()
        for t in threads:
            t.join(10)
        d.start()
    return acked
