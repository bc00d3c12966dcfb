"""The daemon's GIL switch interval: 0.5 ms, overridable for measurements, never fatal."""

from __future__ import annotations

import pytest

from quiverd.runtime.serve import GIL_SWITCH_INTERVAL_S, gil_switch_interval_s


@pytest.mark.parametrize(("value", "expected"), [
    (None, GIL_SWITCH_INTERVAL_S), ("0.001", 0.001), ("0.005", 0.005),
    ("fast", GIL_SWITCH_INTERVAL_S), ("0", GIL_SWITCH_INTERVAL_S),
    ("-1", GIL_SWITCH_INTERVAL_S), ("5", GIL_SWITCH_INTERVAL_S),
])
def test_gil_switch_interval_from_the_environment(value, expected):
    env = {} if value is None else {"QUIVERD_GIL_SWITCH_S": value}
    assert gil_switch_interval_s(env) == expected
