"""A loss is reported once: later starts and fsck list it as known (shard-<n>/lost.json).

The newest of two segments is damaged after the WAL released it: the first start
reports its 7 sequences lost (``bundles_lost``). Once a later bundle lands in a segment
above them, they sit in a gap that stays unheld until the gc passes it; the next starts
must not report them again, ``status`` lists them under ``known_lost_sequences`` and
``quiverd fsck`` prints them as KNOWN and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from quiverd.client import Client
from quiverd.segments.reader import SegmentReader
from tests.daemon.helpers import flip, tagged_table
from tests.daemon.test_recovery_loss import two_segments_released


def fsck(d: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quiverd", "fsck", str(d.data_dir), *args],
                          capture_output=True, text=True, timeout=120)


def test_loss_is_reported_once_then_listed_as_known(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1, "segment.max_open_duration_ms": 50}, in_process=True).start()
    newest, sequences = two_segments_released(d)
    with SegmentReader.open(newest) as reader:
        footer = reader.footer
    flip(newest, footer.manifest_offset + footer.manifest_length // 2)
    gap = [min(sequences), max(sequences)]

    d.start()
    assert d.status()["shards"][0]["lost_sequences"] == [gap]
    reported = len(d.events("bundles_lost"))
    assert reported >= 1
    with Client.connect(d.socket) as c:  # a segment above the gap
        c.send_many([tagged_table(100)], client="c")
    assert d.stop() == 0
    for _ in range(2):
        d.start()
        shard = d.status()["shards"][0]
        assert shard["lost_sequences"] == [] and shard["known_lost_sequences"] == [gap], shard
        assert shard["replay"]["bundles_lost"] == 0
        assert d.stop() == 0
    assert len(d.events("bundles_lost")) == reported, d.events("bundles_lost")
    assert len(d.events("bundles_lost_known")) == 2
    done = fsck(d)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"KNOWN shard 0: WAL sequences {gap[0]}..{gap[1]}" in done.stdout
    assert "LOST " not in done.stdout
    out = json.loads(fsck(d, "--json").stdout)
    assert out["lost"] == [] and out["known_lost"][0]["sequences"] == [gap]
