"""How long the operators' endpoints take to answer: idle, and under one producer.

    python bench/probes.py [--requests 300] [--dir PATH]

Starts ``python -m quiverd serve`` on a fresh data directory (one shard, the metrics
listener on a free loopback port), then times ``GET /livez``, ``/readyz`` and
``/metrics`` (a fifth as many: a scrape walks every series) one after the other from
this process: first with the daemon idle, then while a producer thread sends batches
of 16 bundles of ~190 KB (8,000 rows) as fast as they are acked. Prints p50/p99 per
endpoint and the producer's bundles/s during the timed part. The probes run on the event loop that
also serves ingest, so their p99 under load is the loop's scheduling delay.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa

from quiverd.client import Client

PATHS = ("/livez", "/readyz", "/metrics")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="per probe (a fifth for /metrics)")
    ap.add_argument("--dir", default=None, help="where the data directory goes")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="quiverd-probes-", dir=args.dir))
    port = _free_port()
    cfg = root / "config.toml"
    cfg.write_text(f'data_dir = "{root / "data"}"\nshards = 1\n'
                   f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "quiverd", "serve", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{port}"
        _wait_up(address, proc)
        _report("idle", address, args.requests)
        stop, sent = threading.Event(), [0]
        producer = threading.Thread(target=_produce, args=(root / "data" / "ingest.sock",
                                                           stop, sent))
        producer.start()
        time.sleep(1.0)  # warm: the producer is in its steady state
        started, before = time.monotonic(), sent[0]
        _report("ingest", address, args.requests)
        rate = (sent[0] - before) / (time.monotonic() - started)
        stop.set()
        producer.join()
        print(f"producer during the ingest part: {rate:.0f} bundles/s")
    finally:
        proc.terminate()
        code = proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"quiverd exited {code}")


def _report(label: str, address: str, requests: int) -> None:
    for path in PATHS:
        n = requests if path != "/metrics" else max(1, requests // 5)
        ms = sorted(_get_ms(address, path) for _ in range(n))
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        print(f"{label:6}  {path:8}  n={n:4}  p50 {ms[len(ms) // 2]:6.2f} ms  "
              f"p99 {p99:6.2f} ms")


def _get_ms(address: str, path: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as resp:
        resp.read()
    return (time.perf_counter() - t) * 1000


def _produce(sock: Path, stop: threading.Event, sent: list[int]) -> None:
    table = pa.table({"i": pa.array(range(8000), pa.int64()),
                      "s": pa.array([f"row-{i:08d}" for i in range(8000)])})
    with Client.connect(sock) as c:
        while not stop.is_set():
            c.send_many([table] * 16, client="bench")
            sent[0] += 16


def _wait_up(address: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/readyz", timeout=2) as resp:
                if json.loads(resp.read())["status"] == "ready":
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"quiverd did not get ready (exit {proc.poll()})")
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
