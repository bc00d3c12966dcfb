"""bench/ingest.py's report: ratios per round with their spread, CPU per bundle, and any
subset of sides (``--sides``) summarized and printed without the missing ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ingest  # noqa: E402


def _timed(bundles_s: float, cpu_us: float = float("nan")) -> ingest.Timed:
    return ingest.Timed(seconds=1.0, bundles=int(bundles_s), payload_bytes=int(bundles_s) * 1000,
                        latencies_s=[0.001, 0.002], cpu_s=cpu_us * bundles_s / 1e6)


EXTRA = {"timed_window": [0.0, 1.0], "daemon_cpu_cores": 1.0, "daemon_loop_cpu_cores": 0.5,
         "daemon_worker_cpu_cores": 0.5, "daemon_sys_cpu_cores": 0.1, "producer_cpu_cores": 0.3,
         "machine_cpu_cores": 1.5, "foreign_cpu_cores": 0.0, "daemon_fsyncs": 10,
         "daemon_peak_rss_mib": 150.0, "entries_per_fsync": 4.0}
SCN = ingest._scenario(4, 64 * 1024, "interval", 8)


def test_summarize_ratios_per_round_median_and_range_all_sides() -> None:
    rounds = [ingest.Round(daemon=_timed(d, 400), extra=EXTRA, reference=_timed(r, 100),
                           baseline=_timed(b))
              for d, r, b in ((2000, 8000, 10000), (3000, 6000, 10000), (2500, 10000, 5000))]
    row = ingest.summarize(SCN, 65536, rounds)
    assert row["floor_ratio_each"] == [0.25, 0.5, 0.25]
    assert row["floor_ratio"] == 0.25 and row["floor_ratio_range"] == [0.25, 0.5]
    assert row["ratio"] == pytest.approx(0.3) and row["ratio_range"] == [0.2, 0.5]
    assert row["daemon"]["cpu_us_per_bundle"] == pytest.approx(400)
    assert row["reference"]["cpu_us_per_bundle"] == pytest.approx(100)
    lines = ingest.target_lines([row])
    assert any("reference bundles/s (BELOW >= 0.8x)" in line for line in lines)
    assert any("400 µs daemon CPU per bundle (ABOVE <= 120 µs)" in line for line in lines)
    assert "0.25x (0.25-0.50)" in ingest.markdown([row])


def test_summarize_reference_alone_prints_without_daemon_or_ratios() -> None:
    row = ingest.summarize(SCN, 65536, [ingest.Round(reference=_timed(5000, 120))])
    assert "daemon" not in row and "ratio" not in row and "floor_ratio" not in row
    table = ingest.markdown([row])
    assert "| 5000 |" in table and table.count("|") > 20
    assert "reference" in ingest._line(row)
    assert ingest.target_lines([row]) == []
