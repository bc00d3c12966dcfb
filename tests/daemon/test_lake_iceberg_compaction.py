"""A daemon compacting every second while files keep coming, with no fault at all: no
pyiceberg read of the table may see a row twice. On c112309 a compaction of files still
queued for their append let the queued append add them next to their replacement:
67 of 251 reads saw rows twice in 10 s (8 compactions); the fixed projector: 0 of 304."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.daemon.iceberg_helpers import catalog, wait_projected
from tests.daemon.lake_helpers import FAST_LAKE, send_logs, wait_for_lake

pytestmark = pytest.mark.timeout(240)
RUN_S = 6.0


def test_iceberg_reads_never_see_a_row_twice_while_compacting(daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "lake.file_duration_ms": 150,
                        "lake.compaction.interval_s": 1, "lake.compaction.min_files": 2,
                        "lake.compaction.delete_grace_s": 3600,
                        "lake.iceberg.enabled": True, "lake.iceberg.linger_ms": 300,
                        "lake.iceberg.reconcile_interval_s": 30}, in_process=True).start()
    sent = send_logs(d, clients=1, batches=1, two_slots_every=0)
    started = time.monotonic()
    while not catalog(d).table_exists("quiver.client-0"):  # the first commit
        assert time.monotonic() < started + 60, d.log()[-3000:]
        time.sleep(0.1)
    reads = doubled = 0
    deadline = time.monotonic() + RUN_S
    b = 1
    while time.monotonic() < deadline:
        sent.update(send_logs(d, clients=1, batches=1, start=b, two_slots_every=0))
        b += 1
        keys = _keys(d)
        reads += 1
        doubled += len(keys) != len(set(keys))
    compactions = len(d.events("lake_compacted"))
    assert reads >= 20 and compactions >= 2, (reads, compactions)
    assert doubled == 0, f"{doubled} of {reads} reads saw rows twice ({compactions} compactions)"
    wait_for_lake(d, sent)
    wait_projected(d, timeout=90)
    keys = _keys(d)
    assert len(keys) == len(set(keys)) == sent[("client-0", 0)]
    assert d.stop() == 0


def _keys(d: Any) -> list[tuple[int, int]]:
    rows = catalog(d).load_table("quiver.client-0").scan(
        selected_fields=("batch", "i")).to_arrow()
    return list(zip(rows["batch"].to_pylist(), rows["i"].to_pylist(), strict=True))
