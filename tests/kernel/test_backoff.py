"""The one retry backoff of the daemon's outward-waiting loops (quiverd.kernel.backoff)."""

from __future__ import annotations

import pytest

from quiverd.kernel.backoff import backoff_s


@pytest.mark.parametrize(("attempt", "low", "high"), [
    (1, 0.5, 1.0), (2, 1.0, 2.0), (3, 2.0, 4.0), (5, 8.0, 16.0), (6, 15.0, 30.0),
    (10_000, 15.0, 30.0),  # capped, and no huge integer power on the way
])
def test_backoff_doubles_from_half_a_second_to_thirty_with_jitter(attempt: int, low: float,
                                                                  high: float) -> None:
    delays = [backoff_s(attempt) for _ in range(200)]
    assert all(low <= d <= high for d in delays)
    assert max(delays) - min(delays) > (high - low) / 4  # jittered, not one value


def test_backoff_base_and_cap_are_the_callers() -> None:
    assert all(0.05 <= backoff_s(1, base_s=0.05, max_s=2.0) <= 0.1 for _ in range(50))
    assert all(1.0 <= backoff_s(9, base_s=0.05, max_s=2.0) <= 2.0 for _ in range(50))
