"""STREAM requests whose numbers name nothing: MALFORMED naming the field, never INTERNAL.

Against a real daemon over its socket (issue 26: a fetch after bundle index -2 answered
INTERNAL with an IndexError traceback; ``latest`` from a huge negative index reported
4.6e18 bundles).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from quiverd.client.consumer import RangedReader
from quiverd.kernel.errors import ProtocolError, QuiverError
from quiverd.net.admin import request
from quiverd.protocol.codec import Delivery
from quiverd.protocol.frames import ErrorCode
from tests.net.test_ranged_fetch import FAST, finalized, produce, wait_for
from tests.tiers import size

END = 2**32 - 1


def _ready(daemon_factory: Any) -> tuple[Any, dict[str, list[int]]]:
    """A daemon of 2 shards with 6 finalized bundles and subscriber "s"; its start."""
    d = daemon_factory(FAST, in_process=True).start()
    produce(d, list(range(6)))
    wait_for(lambda: finalized(d) >= 6)
    with RangedReader.connect(d.socket) as r:
        start = r.open("s", register=True)["start"]
    return d, start


def _ask(r: RangedReader, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The STREAM_OK body of a request and the DELIVERY frames before it (a fetch's);
    an ERROR raises its exception."""
    request_id = r._send(body)
    deliveries = 0
    while isinstance(msg := r._receive(), Delivery):
        deliveries += 1
    return r._check(msg, request_id), deliveries


def _refusal(d: Any, body: dict[str, Any]) -> ProtocolError:
    """The ERROR a request gets; the daemon closes that connection and serves the next."""
    with RangedReader.connect(d.socket) as r:
        with pytest.raises(ProtocolError) as caught:
            _ask(r, body)
    with RangedReader.connect(d.socket) as r:  # still serving
        assert r.open("s")["shards"] == 2
    return caught.value


def _a_live_shard(d: Any, start: dict[str, list[int]]) -> tuple[str, int]:
    """The shard holding the bundles (one client: one shard) and its first segment."""
    with RangedReader.connect(d.socket) as r:
        end = r.latest("s", start)["end"]
    (key,) = [k for k in start if end[k] != start[k]]
    return key, start[key][0]


def test_stream_fetch_after_bundle_index_minus_two_is_malformed_not_internal(daemon_factory):
    d, start = _ready(daemon_factory)
    key, seg = _a_live_shard(d, start)
    err = _refusal(d, {"op": "fetch", "subscriber": "s", "shard": int(key),
                       "after": [seg, -2], "through": [seg, END]})
    assert err.code == ErrorCode.MALFORMED, err  # the old code: INTERNAL (IndexError)
    assert "STREAM fetch: after[1] must be in -1 .. 4294967295" in str(err)
    assert "got -2" in str(err)


def test_stream_latest_from_a_huge_negative_index_is_malformed_not_a_count(daemon_factory):
    d, start = _ready(daemon_factory)
    key, seg = _a_live_shard(d, start)
    err = _refusal(d, {"op": "latest", "subscriber": "s",
                       "start": {**start, key: [seg, -(2**62)]}})
    assert err.code == ErrorCode.MALFORMED, err  # the old code: 4.6e18 "bundles"
    assert f"STREAM latest: start['{key}'][1] must be in -1 .. 4294967295" in str(err)


@pytest.mark.parametrize(("body", "names"), [
    ({"op": "fetch", "shard": 0, "after": [-1, -1], "through": [1, 0]},
     "fetch: after[0] must be in 0 .. 18446744073709551615"),
    ({"op": "fetch", "shard": 0, "after": [1, -1], "through": [1, 2**32]},
     "fetch: through[1] must be in -1 .. 4294967295"),
    ({"op": "fetch", "shard": 2, "after": [1, -1], "through": [1, 0]},
     "fetch: shard must be in 0 .. 1 (a shard of this daemon), got 2"),
    ({"op": "fetch", "shard": -1, "after": [1, -1], "through": [1, 0]},
     "fetch: shard must be in 0 .. 1"),
    ({"op": "latest", "start": {"0": [2**64, 0]}},
     "latest: start['0'][0] must be in 0 .. 18446744073709551615"),
    ({"op": "latest", "start": {"0": [1, -1]}, "cap": {"1": [1, -5]}},
     "latest: cap['1'][1] must be in -1"),
    ({"op": "latest", "start": {"7": [1, -1]}},
     "latest: key '7' of start must be a shard number, 0 .. 1 as a decimal string"),
    ({"op": "latest", "start": {"0": [1, -1]}, "max_bundles": -1},
     "latest: max_bundles must be in 0 .. 2147483647 (bundles; 0 is no limit), got -1"),
    ({"op": "ack_through", "through": {"0": [1, -3]}},
     "ack_through: through['0'][1] must be in -1"),
    ({"op": "ack_through", "through": {"-1": [1, 0]}},
     "ack_through: key '-1' of through must be a shard number"),
])
def test_stream_every_number_out_of_range_is_malformed_naming_field_and_range(
        daemon_factory, body, names):
    d, _ = _ready(daemon_factory)
    err = _refusal(d, {"subscriber": "s", **body})
    assert err.code == ErrorCode.MALFORMED and names in str(err), err
    assert "positions come from `open` and `latest` replies" in str(err)


def test_stream_positions_at_the_edges_of_their_ranges_are_answered(daemon_factory):
    d, start = _ready(daemon_factory)
    with RangedReader.connect(d.socket) as r:
        assert r.latest("s", start, max_bundles=2**31 - 1)["bundles"] == 6
        far = {k: [2**64 - 1, END] for k in start}  # after everything there can be
        latest = r.latest("s", far)
        assert latest["end"] == far and latest["bundles"] == 0
        assert list(r.fetch("s", 0, [2**64 - 1, -1], [2**64 - 1, END])) == []


# Integers near the live shard and segment (where a number out of range reaches a
# segment's bundles), huge ones and the edges; other JSON numbers where counts go.
_INT = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([-2, -1, 0, 1, END, END + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64]),
    st.integers(min_value=-(2**66), max_value=2**66),
)
_NUMBER = st.one_of(_INT, st.floats(allow_nan=False, allow_infinity=False), st.booleans())


def _bodies(shard: int, seg: int) -> st.SearchStrategy[dict[str, Any]]:
    """Requests of every op with numbers in every field, often the live ones."""
    shards = st.one_of(st.just(shard), _INT)
    position = st.lists(st.one_of(st.just(seg), st.integers(min_value=-3, max_value=3), _INT),
                        min_size=2, max_size=2)
    keys = st.one_of(st.just(str(shard)), st.sampled_from(["0", "1", "2", "-1", "01", "x"]))
    positions = st.dictionaries(keys, position, max_size=3)
    return st.one_of(
        st.fixed_dictionaries({"op": st.just("fetch"), "shard": shards, "after": position,
                               "through": position}),
        st.fixed_dictionaries({"op": st.just("latest"), "start": positions},
                              optional={"cap": positions, "max_bundles": _NUMBER,
                                        "lease_s": _NUMBER}),
        st.fixed_dictionaries({"op": st.just("open")}, optional={"lease_s": _NUMBER}),
        st.fixed_dictionaries({"op": st.just("ack_through"), "through": positions},
                              optional={"lease_s": _NUMBER}),
    )


def test_stream_random_numbers_in_every_field_never_answer_internal(daemon_factory):
    """Property: whatever JSON numbers fill a STREAM request's fields, the daemon answers
    STREAM_OK (never counting more bundles than there are) or a specific ERROR, never
    INTERNAL, and goes on serving."""
    d, start = _ready(daemon_factory)
    key, seg = _a_live_shard(d, start)
    answered: dict[str, int] = {}

    @settings(max_examples=size(100, 250), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_bodies(int(key), seg))
    def check(body: dict[str, Any]) -> None:
        with RangedReader.connect(d.socket, timeout=10) as r:
            try:
                reply, deliveries = _ask(r, {"subscriber": "s", **body})
                assert 0 <= reply.get("bundles", 0) <= 6 and deliveries <= 6, f"{body} -> {reply}"
                answered["ok"] = answered.get("ok", 0) + 1
            except QuiverError as exc:
                code = getattr(exc, "code", None)
                assert code != ErrorCode.INTERNAL, f"{body} -> {exc}"
                key = type(exc).__name__ if code is None else ErrorCode(code).name
                answered[key] = answered.get(key, 0) + 1

    # The two cases always run first (random search rarely hits a live segment
    # with an index below -1 and a range reaching its bundles).
    check = example({"op": "fetch", "shard": int(key), "after": [seg, -2],
                     "through": [seg, END]})(check)
    check = example({"op": "latest", "start": {key: [seg, -(2**62)]}})(check)
    check()
    assert answered.get("ok", 0) > 0 and answered.get("MALFORMED", 0) > 0, answered
    assert request(d.admin_socket, "subscribers.list")  # the daemon is still up
