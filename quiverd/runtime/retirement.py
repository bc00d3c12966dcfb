"""Retirement: a subscriber with no live consumer does not hold the daemon hostage.

    shards' Changes / over_cap / 1 s timer ─▶ Retirement.check ─▶ retired.json (the reason)
                                                                 └─▶ subscriber remove on
                                                                     every shard (ack.log)

Every registered subscriber that has a live consumer (a SUBSCRIBE session attached to
a shard's dispatcher, or a ranged reader's lease: a Spark query's driver that runs) is
left alone, however far behind it is: a slow consumer is what the size cap's
backpressure is for. One without a consumer is retired when

- ``lag_bytes``: its lag in some shard (bytes of the segments from its mark on) reached
  ``retention.retire_after_lag_bytes / shards`` and it has been without a consumer for
  ``retire_grace_s`` (a consumer restarting, or one that connects now and then, keeps
  its subscriber). The default limit is half the shard's size cap under
  ``backpressure``, so the retirement comes before the cap holds ingest back (if the
  cap fills within the grace, ingest waits for the rest of it, then goes on); none
  under ``drop_oldest`` (the cap drops its bundles instead); without a cap, half of what
  the data directory's filesystem could hold at start (its free bytes plus the shards'
  own), so the disk does not fill for it either;
- ``idle``: it has been without a consumer for ``retire_idle_s`` and is behind at all.

Retiring writes the reason to ``retired.json`` (``quiverd.acks.retired``), then removes
the subscriber on every shard as ``quiverd subscribers remove`` does (durable in
ack.log; its segments can go), logs ``subscriber_retired`` at error level and counts
``quiver_subscribers_retired_total{reason}``. A consumer that comes back with the name
is refused with the reason (UNKNOWN_SUBSCRIBER), a ranged reader's ``register`` does not
bring it back; ``quiverd subscribers add`` does, and voids the mark.

Exempt: the lake's own subscriber (``uploader``) and the subscribers the config file
declares (``[[subscribers]]``): the operator declared those for good, and every start
registers them again.

"Without a consumer since" is kept in memory, from the first check that sees the name:
a start, or a registration, counts as the moment it was last seen, so a restart gives
each the grace again (never a retirement sooner than configured). Bounded by the
registered subscribers (one entry each).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from quiverd.acks.registry import UnknownSubscriber
from quiverd.acks.retired import RetiredMark, RetiredMarks
from quiverd.kernel.config import Config
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics

if TYPE_CHECKING:
    from quiverd.net.consumers import SubscriberHub
    from quiverd.runtime.shard import Shard

CHECK_INTERVAL_S = 1.0  # besides every ack state change and every time ingest hits a cap
# At most 4 checks a second under a stream of changes: a check sums the segment sizes
# above each consumerless subscriber's mark (O(segments) each), and at 4 a second even a
# producer at 12 MB/s fills less than half of a 6 MiB cap between two of them.
MIN_SPACING_S = 0.25

Remove = Callable[[str], Awaitable[Any]]


class Retirement:
    def __init__(self, cfg: Config, shards: Sequence[Shard], hub: SubscriberHub,
                 marks: RetiredMarks, *, remove: Remove, exempt: set[str],
                 metrics: Metrics, log: Logger, disk_bytes: int = 0) -> None:
        """``disk_bytes``: what the data directory could hold (free + the shards' bytes),
        half of which is the lag limit when neither a cap nor a limit is configured."""
        self.cfg, self.shards, self.hub, self.marks = cfg, shards, hub, marks
        self.remove, self.exempt, self.log = remove, exempt, log
        self.retired = metrics.subscribers_retired
        limit = cfg.retire_lag_bytes
        self.lag_limit_bytes = disk_bytes // 2 if limit is None else limit  # daemon-wide
        self.lag_bytes = self.lag_limit_bytes // max(len(shards), 1)  # per shard
        self.grace_s = cfg.retention.retire_grace_s
        self.idle_s = float(cfg.retention.retire_idle_s)
        self.last_live: dict[str, float] = {}
        self.stopped = False

    @property
    def enabled(self) -> bool:
        return bool(self.lag_bytes or self.idle_s)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Check on every change and once a second, until cancelled or ``stop``."""
        task_status.started()
        self.log.info("subscriber_retirement", lag_limit_bytes=self.lag_limit_bytes,
                      grace_s=self.grace_s, idle_limit_s=self.idle_s,
                      exempt=sorted(self.exempt))
        if not self.enabled:
            return
        while not self.stopped:
            versions = [(s.changes, s.changes.version) for s in self.shards]
            versions += [(s.over_cap, s.over_cap.version) for s in self.shards]
            await self.check()
            await anyio.sleep(MIN_SPACING_S)
            with anyio.move_on_after(CHECK_INTERVAL_S):
                async with anyio.create_task_group() as tg:
                    async def wake(c: Any, v: int) -> None:
                        await c.wait_beyond(v)
                        tg.cancel_scope.cancel()
                    for changes, version in versions:
                        tg.start_soon(wake, changes, version)

    def stop(self) -> None:
        """No retirement starts from now on (the daemon is stopping)."""
        self.stopped = True

    async def check(self) -> None:
        """Retire every subscriber that is due (module doc)."""
        now = time.monotonic()
        names = self._names()
        for name in [n for n in self.last_live if n not in names]:
            del self.last_live[name]  # removed: bounded by the registered subscribers
        for name in sorted(names - self.exempt):
            if self.stopped:
                return
            if self._live(name):
                self.last_live[name] = now
                continue
            # First seen now (registered since the last check, or this is the first
            # check of this start): its time without a consumer starts now.
            idle = now - self.last_live.setdefault(name, now)
            reason, lag = self._due(name, idle)
            if reason:
                await self._retire(name, reason, lag, idle)

    def _names(self) -> set[str]:
        return {sub.name for s in self.shards for sub in s.acks.registry}

    def _live(self, name: str) -> bool:
        if self.hub.leases.holder(name) is not None:
            return True
        return any(session.name == name and not session.closed
                   for s in self.shards if s.dispatcher is not None
                   for session in s.dispatcher.sessions)

    def _due(self, name: str, idle: float) -> tuple[str, int]:
        """(reason, lag bytes over every shard), or ("", lag) if not due."""
        total, due = 0, ""
        behind = False
        for s in self.shards:
            if name not in s.acks.registry:
                continue
            lag = s.segments.bytes_from(s.acks.covered_below(name))
            total += lag
            behind = behind or lag > 0 or s.acks.lag(name).bundles_pending > 0
            if self.lag_bytes and lag >= self.lag_bytes and idle >= self.grace_s:
                due = "lag_bytes"
        if not due and self.idle_s and idle >= self.idle_s and behind:
            due = "idle"
        return due, total

    async def _retire(self, name: str, reason: str, lag: int, idle: float) -> None:
        mark = RetiredMark(name=name, reason=reason, lag_bytes=lag, idle_s=round(idle, 3),
                           retired_at_ns=time.time_ns())
        self.marks.add(mark)
        # The reason first: a crash before the removes leaves a registered subscriber
        # (the mark is void while the name is registered) and the next check decides again.
        await anyio.to_thread.run_sync(self.marks.save)
        try:
            await self.remove(name)
        except UnknownSubscriber:
            pass  # removed meanwhile (an operator): the mark still says why it would be
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # The shards stop (a shutdown): the mark is void while the name is registered.
            self.stopped = True
            return
        self.retired.labels(reason).inc()
        self.last_live.pop(name, None)
        self.log.error("subscriber_retired", subscriber=name, reason=reason, lag_bytes=lag,
                       idle_s=round(idle, 1), lag_limit_bytes=self.lag_limit_bytes,
                       grace_s=self.grace_s, idle_limit_s=self.idle_s,
                       hint=f"no consumer read subscriber {name!r}, so it was removed before "
                       "it could stop ingest (retention.retire_after_lag_bytes, retire_idle_s; "
                       f"0 = never). Re-add it with `quiverd subscribers add {name}`; a "
                       "subscriber that must never be retired belongs in the config file "
                       "([[subscribers]])")

    def refusal(self, name: str) -> str | None:
        """Why ``name`` is gone, for a consumer coming back; None unless it was retired."""
        mark = self.marks.get(name)
        if mark is None or any(name in s.acks.registry for s in self.shards):
            return None  # never retired, or registered again (the mark is void)
        return mark.text()

    async def readded(self, name: str) -> None:
        """``quiverd subscribers add``: the mark goes (void already: the name is registered)."""
        if self.marks.discard(name):
            await anyio.to_thread.run_sync(self.marks.save)
            self.log.info("subscriber_retirement_cleared", subscriber=name)

    def status(self) -> list[dict[str, Any]]:
        return [{"name": m.name, "reason": m.reason, "lag_bytes": m.lag_bytes,
                 "idle_s": m.idle_s,
                 "retired_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                             time.gmtime(m.retired_at_ns / 1e9))}
                for m in self.marks if self.refusal(m.name) is not None]
