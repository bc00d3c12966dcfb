"""The pending-bytes budget: bytes received but not yet durable, across all connections.

A BUNDLE or JOB frame's header announces its length; the connection takes that many
bytes of budget *before* the frame buffer is allocated and gives them back when
the request is answered (a bundle's ACK or ERROR from the WAL writer, a JOB's
reply) or the connection ends without submitting it. A connection that finds the
budget spent stops reading until earlier requests are answered: memory held for
frames is bounded by ``ingest.max_pending_bytes`` whatever the peers do.

Each peer uid (SO_PEERCRED, like ``ingest.max_connections_per_uid``) may hold at
most ``per_uid_bytes`` of it (``ingest.max_pending_bytes_per_uid``, by default half
the budget). A fixed share, not "total / uids active now": bytes are held by
frames that may stall until ``ingest.idle_timeout_ms``, so a share that shrinks
when a second uid turns up would come too late, the first uid already holding
everything. With half, whatever one uid holds or stalls, the other half stays out of
its reach: another uid is held up only by its own frames or by other uids' (as with
the connection limit, several peers together can still fill it). One uid alone still
has half the budget, far more than group commit needs in flight.

Waiters are served first come, first served, so a large frame is not starved by a
stream of small ones; a waiter whose uid is at its share waits for its own uid's
bytes only, and neither it nor its uid's later waiters hold up other uids. There
is at most one waiter per connection, so the queue is bounded by
``ingest.max_connections``.

A waiter must not wait for ever behind frames that stall while holding what it needs
(issue 26: nine stalled 64 MiB frames of one uid kept that uid's 10-row bundle from any
ACK until their idle timeouts, one wave after another). ``contended(uid)`` says whether
some waiter needs bytes that ``uid``'s frames hold: a waiter of that uid, or any waiter
within its share held up by the whole budget being spent. The reader closes a stalled
frame holding contended bytes after ``reader.CONTENDED_STALL_MS`` rather than
``ingest.idle_timeout_ms``, and times the wait for budget itself as a stall
(``quiverd/net/reader.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    uid: int
    granted: anyio.Event = field(default_factory=anyio.Event)


class ByteBudget:
    def __init__(self, total_bytes: int, per_uid_bytes: int | None = None) -> None:
        if total_bytes < 1:
            raise ValueError(f"budget of {total_bytes} bytes")
        per_uid = total_bytes if per_uid_bytes is None else per_uid_bytes
        if not 1 <= per_uid <= total_bytes:
            raise ValueError(f"per-uid share of {per_uid} bytes in a budget of {total_bytes}")
        self.total_bytes = total_bytes
        self.per_uid_bytes = per_uid
        self.available = total_bytes
        self.by_uid: dict[int, int] = {}  # bytes each uid holds (uids holding none: absent)
        self._waiters: deque[_Waiter] = deque()
        self._waiting_uids: Counter[int] = Counter()  # waiters per uid
        # Some waiter within its share waits for free bytes (every uid's bytes would do).
        self._short_of_total = False

    @property
    def held(self) -> int:
        return self.total_bytes - self.available

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_take(self, nbytes: int, uid: int = 0) -> bool:
        """Take ``nbytes`` for ``uid`` now if they are free, within its share, and no
        waiter is before it in line (module docstring)."""
        self._check(nbytes)
        if not self._fits(uid, nbytes) or not self._first_in_line(uid):
            return False
        self._grant_one(uid, nbytes)
        return True

    def contended(self, uid: int) -> bool:
        """Some waiter needs bytes that ``uid``'s frames hold (module docstring)."""
        return self._short_of_total or uid in self._waiting_uids

    async def take(self, nbytes: int, uid: int = 0,
                   queued: Callable[[], None] | None = None) -> None:
        """Take ``nbytes`` for ``uid``, waiting in line; ``queued`` runs once it is in
        line (``contended`` counts it then). Cancellation takes nothing."""
        if self.try_take(nbytes, uid):
            return
        waiter = _Waiter(nbytes, uid)
        self._waiters.append(waiter)
        self._waiting_uids[uid] += 1
        self._grant()  # grants nobody (try_take said so); says who is short of what
        if queued is not None:
            queued()
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                self.release(nbytes, uid)  # granted just as we were cancelled: hand it on
            else:
                self._remove(waiter)
                self._grant()  # a big waiter leaving the head may unblock smaller ones
            raise

    def release(self, nbytes: int, uid: int = 0) -> None:
        self._check(nbytes)
        left = self.by_uid.get(uid, 0) - nbytes
        assert left >= 0, f"uid {uid} released more budget than it took"
        if left:
            self.by_uid[uid] = left
        else:
            self.by_uid.pop(uid, None)
        self.available += nbytes
        assert self.available <= self.total_bytes, "released more budget than was taken"
        self._grant()

    def _grant(self) -> None:
        at_share: set[int] = set()  # uids whose first waiter is over its share
        self._short_of_total = False
        for waiter in list(self._waiters):
            if waiter.uid in at_share:
                continue  # behind its own uid's first waiter: order within a uid is kept
            if not self._fits_share(waiter.uid, waiter.nbytes):
                at_share.add(waiter.uid)  # waits for its own uid's bytes, holds up nobody
                continue
            if waiter.nbytes > self.available:
                self._short_of_total = True
                return  # first in line for free bytes: nobody behind it jumps the queue
            self._remove(waiter)
            self._grant_one(waiter.uid, waiter.nbytes)
            waiter.granted.set()

    def _remove(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        left = self._waiting_uids[waiter.uid] - 1
        if left:
            self._waiting_uids[waiter.uid] = left
        else:
            del self._waiting_uids[waiter.uid]

    def _first_in_line(self, uid: int) -> bool:
        """No waiter goes before a new one of ``uid``. Between calls nobody queued could
        be granted (every change runs ``_grant``), so a queued waiter within its share
        waits for free bytes, first in line; one over its share only holds up its uid."""
        at_share: set[int] = set()
        for waiter in self._waiters:
            if waiter.uid in at_share:
                continue
            if self._fits_share(waiter.uid, waiter.nbytes):
                return False
            at_share.add(waiter.uid)
        return uid not in at_share

    def _grant_one(self, uid: int, nbytes: int) -> None:
        self.available -= nbytes
        self.by_uid[uid] = self.by_uid.get(uid, 0) + nbytes

    def _fits_share(self, uid: int, nbytes: int) -> bool:
        return self.by_uid.get(uid, 0) + nbytes <= self.per_uid_bytes

    def _fits(self, uid: int, nbytes: int) -> bool:
        return nbytes <= self.available and self._fits_share(uid, nbytes)

    def _check(self, nbytes: int) -> None:
        # Callers size the share to hold the largest frame, so this is a bug, not input.
        assert 0 <= nbytes <= self.per_uid_bytes, f"{nbytes} bytes exceed a uid's share"
