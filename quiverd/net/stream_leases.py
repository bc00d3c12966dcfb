"""Stream leases: at most one live ranged reader (one Spark query) per subscriber.

Two queries on one subscriber each read from the oldest unacked bundle and each ack
what they committed, so the faster one's acks let retention delete what the slower one
has not read: rows missing from one query with no error (the issue-26 run lost 179,558
rows that way). A query's driver therefore names itself in its STREAM requests
(``holder``: an id it picked, with its pid and host for people to read) and the daemon
keeps, per subscriber, the one holder whose requests it answers:

    open / latest / ack_through with holder H ─▶ take(sub, H): held by another live
                                                 holder → SubscriberBusy, else H holds it
    ack_through without a holder ─────────────▶ check(sub): refused while a holder is live
    release (the query's stop()) ─────────────▶ release(sub, H)

A holder is live while the process that made its last request runs (its pid from
SO_PEERCRED of that connection: a killed driver frees the lease at once, so Spark's
restart of the same query from its checkpoint is not blocked) and, where the pid is not
known (another pid namespace), for ``lease_s`` after its last request. Fetches (the
executors) need no lease: they only read.

In memory only: a daemon restart forgets every lease, and the first query to ask after
it holds the subscriber. Bounded by the registered subscribers (one entry each).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from quiverd.kernel.errors import AtCapacity

DEFAULT_LEASE_S = 60.0
MAX_LEASE_S = 3600.0
MAX_HOLDER_CHARS = 200


class SubscriberBusy(AtCapacity):
    """Another live query reads this subscriber (wire code AT_CAPACITY: retry later)."""

    hint = ("two queries on one subscriber lose rows: give each query its own subscriber, "
            "or stop the other query first")


@dataclass
class Lease:
    holder: str
    pid: int  # of the process that made the last request; 0: not known
    since_wall: float  # time.time() when this holder took it
    renewed: float  # monotonic time of its last request
    lease_s: float


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True


class StreamLeases:
    """The subscriber -> holder table (see the module doc). Runs on the event loop."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 alive: Callable[[int], bool] = pid_alive) -> None:
        self._leases: dict[str, Lease] = {}
        self._clock, self._alive = clock, alive

    def take(self, subscriber: str, holder: str, *, pid: int,
             lease_s: float = DEFAULT_LEASE_S) -> None:
        """Make ``holder`` the subscriber's holder (renewed), or raise SubscriberBusy."""
        now = self._clock()
        held = self._live(subscriber, now)
        if held is not None and held.holder != holder:
            raise SubscriberBusy(self._busy_text(subscriber, held, now))
        lease_s = min(max(lease_s, 1.0), MAX_LEASE_S)
        if held is None:
            self._leases[subscriber] = Lease(holder=holder, pid=pid, since_wall=time.time(),
                                             renewed=now, lease_s=lease_s)
        else:
            held.pid, held.renewed, held.lease_s = pid or held.pid, now, lease_s

    def check(self, subscriber: str) -> None:
        """Raise SubscriberBusy if a live holder has the subscriber (a request with no
        holder of its own, such as an older client's ack, must not ack under a query)."""
        now = self._clock()
        held = self._live(subscriber, now)
        if held is not None:
            raise SubscriberBusy(self._busy_text(subscriber, held, now))

    def release(self, subscriber: str, holder: str) -> bool:
        """End ``holder``'s lease (its query stopped); False if it did not hold one."""
        held = self._leases.get(subscriber)
        if held is None or held.holder != holder:
            return False
        del self._leases[subscriber]
        return True

    def holder(self, subscriber: str) -> str | None:
        held = self._live(subscriber, self._clock())
        return None if held is None else held.holder

    def _live(self, subscriber: str, now: float) -> Lease | None:
        held = self._leases.get(subscriber)
        if held is None:
            return None
        if held.pid > 0:
            live = self._alive(held.pid)
        else:
            live = now - held.renewed < held.lease_s
        if not live:
            del self._leases[subscriber]
            return None
        return held

    @staticmethod
    def _busy_text(subscriber: str, held: Lease, now: float) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(held.since_wall))
        how = (f"while process {held.pid} runs" if held.pid > 0 else
               f"until {held.lease_s - (now - held.renewed):.0f} s after its last request")
        return (f"subscriber {subscriber!r} is read by another live query ({held.holder}, "
                f"since {since}, last request {now - held.renewed:.0f} s ago); it holds "
                f"the subscriber {how} or until it stops")


def holder_text(holder: str) -> str:
    """A holder as the daemon keeps it: printable and short."""
    clean = "".join(c if c.isprintable() else "?" for c in holder)
    return clean[:MAX_HOLDER_CHARS]
