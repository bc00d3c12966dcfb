"""A stop under heavy load that outlasts ``shutdown_timeout_ms``: said, exited 75, recovered.

The open segment is large (no age or size trigger during the run), so the drain's last
finalize cannot finish in 20 ms. The daemon must log ``shutdown_timed_out`` with what it
left (bundles not acked, not finalized), exit 75 (EX_TEMPFAIL; the unit lists it in
SuccessExitStatus), and the next start must bring back every acknowledged bundle,
exactly once.
"""

from __future__ import annotations

import time
from typing import Any

from quiverd.runtime import serve
from tests.daemon.helpers import stored_bundles, tagged_table
from tests.daemon.test_disk_full import ROWS, Producer

MiB = 1024 * 1024


def test_stop_past_shutdown_timeout_says_what_was_left_and_replay_recovers_it(
        daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "shutdown_timeout_ms": 20,
                        "segment.target_size_bytes": 512 * MiB,
                        "segment.max_open_duration_ms": 600_000})
    d.start()
    producers = [Producer(d.socket, f"p{n}", n * 1_000_000) for n in range(3)]
    for p in producers:
        p.start()
    deadline = time.monotonic() + 20
    while sum(len(p.acked) for p in producers) < 400:
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.05)
    code = d.stop()
    for p in producers:
        p.stop.set()
        p.join(10)
    assert code == serve.EXIT_STOP_TIMED_OUT, d.log()[-3000:]
    [left] = d.events("shutdown_timed_out")
    assert left["shard"] == 0 and left["bundles_not_finalized"] > 0, left
    assert left["bundles_not_acked"] >= 0 and left["timeout_ms"] == 20, left
    assert not d.events("quiverd_fatal_durability") and "Traceback" not in d.log()
    d.settings["shutdown_timeout_ms"] = 60_000
    d._write_config()
    d.start()
    assert d.stop(90) == 0, d.log()[-3000:]
    acked = {k: v for p in producers for k, v in p.acked.items()}
    stored = stored_bundles(d.data_dir)  # asserts none is stored twice
    missing = [k for k in acked if k not in stored]
    assert not missing, f"{len(missing)} acknowledged bundles lost, e.g. {missing[:5]}"
    for key, tag in acked.items():
        assert stored[key].slots[0].equals(tagged_table(tag, rows=ROWS)), key
