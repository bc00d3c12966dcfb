"""tests/tiers.py: the tier picks each campaign's size; a campaign's own variable wins."""

from __future__ import annotations

import pytest

from tests.tiers import TIER_ENV, size, tier


def test_default_tier_is_smoke_and_full_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIER_ENV, raising=False)
    assert (tier(), size(5, 20)) == ("smoke", 5)
    monkeypatch.setenv(TIER_ENV, "full")
    assert (tier(), size(5, 20)) == ("full", 20)
    monkeypatch.setenv(TIER_ENV, " Smoke ")
    assert size(5, 20) == 5


def test_campaign_variable_wins_over_both_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUIVERD_SOME_ROUNDS", "200")
    for value in ("smoke", "full"):
        monkeypatch.setenv(TIER_ENV, value)
        assert size(5, 20, env="QUIVERD_SOME_ROUNDS") == 200
    monkeypatch.setenv("QUIVERD_SOME_ROUNDS", "")  # empty: as if unset
    assert size(5, 20, env="QUIVERD_SOME_ROUNDS") == 20


def test_unknown_tier_and_bad_sizes_are_refused_with_a_hint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIER_ENV, "ful")  # a typo must not quietly run the smoke sizes
    with pytest.raises(ValueError, match="not a test tier; hint: use one of smoke, full"):
        size(5, 20)
    monkeypatch.setenv(TIER_ENV, "full")
    monkeypatch.setenv("QUIVERD_SOME_ROUNDS", "lots")
    with pytest.raises(ValueError, match="not an integer; hint"):
        size(5, 20, env="QUIVERD_SOME_ROUNDS")
    with pytest.raises(ValueError, match="smoke size 0"):
        size(0, 20)
    with pytest.raises(ValueError, match="smoke size 30"):
        size(30, 20)
