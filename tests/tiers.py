"""The suite's two tiers: one size per campaign, chosen by ``QUIVERD_TEST_TIER``.

Every change runs the default tier (``./scripts/test``): each campaign (kill -9 loops,
socket fuzz, power-cut rounds, Hypothesis state machines) at a smoke size that still
reaches every path it checks (several kills, every fault kind, every mode). The full tier
(``./scripts/test --full``, i.e. ``QUIVERD_TEST_TIER=full``) runs the sizes the suite had
before the split. Both tiers collect the same test ids: a tier changes how long a
campaign runs, never which tests exist. A campaign's own variable (e.g.
``QUIVERD_CRASH_ITERATIONS``) still wins over both, for longer soak runs.
"""

from __future__ import annotations

import os

TIER_ENV = "QUIVERD_TEST_TIER"
TIERS = ("smoke", "full")


def tier() -> str:
    """The tier this run uses: "smoke" (the default) or "full"."""
    value = os.environ.get(TIER_ENV, "").strip().lower() or "smoke"
    if value not in TIERS:
        # A typo must not silently run the smoke sizes while the caller believes
        # the full campaigns passed.
        raise ValueError(f"{TIER_ENV}={value!r} is not a test tier; "
                         f"hint: use one of {', '.join(TIERS)} (or leave it unset for smoke)")
    return value


def size(smoke: int, full: int, env: str | None = None) -> int:
    """A campaign's size in this tier; ``env``, when set in the environment, wins.

    ``smoke`` must still exercise every path of the campaign: the default tier is what
    every change is checked with.
    """
    if not 0 < smoke <= full:
        raise ValueError(f"smoke size {smoke} must be in (0, full={full}]")
    if env is not None and os.environ.get(env, "").strip():
        raw = os.environ[env].strip()
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not an integer; hint: unset it to use "
                             f"this tier's size ({smoke} smoke, {full} full)") from None
    return full if tier() == "full" else smoke
