"""The retry delay of the daemon's long-lived loops that wait for something outside it
(the catalog, the object store): exponential from ``base_s``, capped at ``max_s``, times
a jitter in [0.5, 1) so that loops failing together do not retry together.

    attempt   1     2     3     4     5     6 ...
    delay s   0.5–1 1–2   2–4   4–8   8–16  15–30 (with the defaults)
"""

from __future__ import annotations

import random

BASE_S = 0.5
MAX_S = 30.0


def backoff_s(attempt: int, *, base_s: float = BASE_S, max_s: float = MAX_S) -> float:
    """The delay before retry number ``attempt`` (1 = the first retry):
    ``min(max_s, base_s * 2**attempt)`` times a jitter in [0.5, 1)."""
    exponent = min(max(attempt, 0), 32)  # past 2**32 the cap decides anyway
    return random.uniform(0.5, 1.0) * min(max_s, base_s * 2.0 ** exponent)
