"""The lake inside the daemon: the uploader, the indexer, the janitor and compaction.

    dispatcher[n] ──Delivery──▶ uploader ──▶ object store + catalog ──NOTIFY──▶ indexer
                                                    └──registered──▶ projector ──▶ Iceberg
                                         janitor, compactor (timers)

Readiness never waits for the lake: ingest and delivery go on while the catalog or
the store is down (the WAL and segments hold the data, within retention), and the
lake connects, recovers and starts once the catalog answers, retrying with backoff.
The built-in subscriber ``uploader`` is registered on every shard the first time
the lake runs (start "earliest": everything still retained goes to the lake).

The lake never stops the daemon: whatever it raises (catalog down, store
misconfigured, staging disk full, a bug) marks a part of ``health`` degraded, is
logged (``lake_unavailable``) and retried with backoff; ``state`` is ``degraded``
while any part is, as ``status``, ``/metrics`` and ``/healthz`` show.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from quiverd.kernel import logs
from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.config import Config
from quiverd.kernel.errors import (
    CatalogUnavailable,
    StoreDenied,
    StoreMisconfigured,
    StoreUnavailable,
)
from quiverd.kernel.faults import Hooks
from quiverd.kernel.jobs import JobDecision
from quiverd.kernel.metrics import Metrics
from quiverd.lake.footers import Footers
from quiverd.lake.health import LakeHealth
from quiverd.lake.iceberg import catalog_uri
from quiverd.lake.iceberg.remote import RemoteProjection, Settings
from quiverd.lake.tier import Tier, open_tier
from quiverd_actors.dispatcher import Session
from quiverd_actors.indexer import Indexer
from quiverd_actors.janitor import Janitor
from quiverd_actors.messages import LocalDelivery
from quiverd_actors.projector import Projector
from quiverd_actors.uploader import INGESTED_AT, SUBSCRIBER, Uploader

if TYPE_CHECKING:
    from quiverd.runtime.shard import Shard

Subscribe = Callable[[str, str, str], Awaitable[Any]]  # (op, name, start): Daemon.subscriber_op


class Lake:
    def __init__(self, cfg: Config, shards: list[Shard], *, subscribe: Subscribe,
                 metrics: Metrics, faults: Hooks,
                 decided: Callable[[str], JobDecision | None] | None = None) -> None:
        self.cfg, self.shards, self.subscribe = cfg, shards, subscribe
        self.decided = decided  # staging's decisions: what becomes of staged files
        self.m, self.faults = metrics, faults
        self.log = logs.get("lake")
        self.health = LakeHealth(log=self.log)
        self.tier: Tier | None = None
        self.uploader: Uploader | None = None
        self.janitor: Janitor | None = None
        self.projector: Projector | None = None
        self.scope = anyio.CancelScope()
        self.state = "starting"

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Register the subscriber, then run the lake until cancelled (``stop``)."""
        await self._ensure_subscriber()
        task_status.started()
        with self.scope:
            attempt = 0
            while True:
                try:
                    await self._serve()
                except Exception as raised:  # noqa: BLE001 - the lake must never stop ingest
                    exc = _first(raised)
                    attempt += 1
                    delay = backoff_s(attempt)
                    part, kind = _part_of(exc)
                    self.health.fail(part, kind, exc)
                    self.state = f"waiting: {exc}"
                    self.m.lake_errors.labels("start").inc()
                    self.log.error("lake_unavailable", part=part, kind=kind, error=str(exc),
                                   retry_in_s=round(delay, 1), hint=getattr(exc, "hint", ""),
                                   exc_info=part == "lake")
                    await anyio.sleep(delay)

    def stop(self) -> None:
        self.scope.cancel()

    async def _serve(self) -> None:
        cfg = self.cfg
        async with open_tier(cfg, self.log) as tier:
            self.tier = tier
            try:
                await tier.recover()
                self.health.ok("catalog")  # it answered: start-up faults are over
                self.health.ok("lake")
                await self._run_actors(tier)
            finally:
                self.tier = None
                self.uploader = None

    async def _run_actors(self, tier: Tier) -> None:
        cfg = self.cfg.lake
        dispatchers = [s.dispatcher for s in self.shards if s.dispatcher is not None]
        tx, rx = anyio.create_memory_object_stream[LocalDelivery](cfg.window_bundles)
        session = Session(name=SUBSCRIBER, window=cfg.window_bundles, deliveries=tx, local=True)
        encoders = anyio.CapacityLimiter(cfg.parallelism)
        self.projector = self._projector(tier)
        # The footers the uploader's writer made, for the indexer and the projector.
        footers = Footers(["indexer", "projector"] if self.projector else ["indexer"])
        if self.projector is not None:
            self.projector.footers = footers
        self.uploader = Uploader(tier, dispatchers, session, limiter=encoders,
                                 log=self.log, metrics=self.m, health=self.health,
                                 hook=self.faults.get("lake"),
                                 registered=self.projector.registered if self.projector else None,
                                 footers=footers, decided=self.decided)
        indexer = Indexer(tier, limiter=encoders, log=self.log, metrics=self.m,
                          time_column=cfg.time_column or INGESTED_AT,
                          hook=self.faults.get("lake"), footers=footers)
        self.janitor = Janitor(tier, log=self.log, metrics=self.m,
                               held=self.projector.referenced if self.projector else None,
                               replaced=self.projector.nudge if self.projector else None)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.uploader.run, rx)
                for d in dispatchers:
                    d.attach(session)
                await tg.start(indexer.run)
                await tg.start(self.janitor.run)
                if self.projector is not None:
                    await tg.start(self.projector.run)
                self.state = "running"
                self.log.info("lake_started", node_id=tier.node_id, source_id=tier.source_id,
                              store=tier.store.uri(""), catalog=tier.catalog.backend)
        finally:
            for d in dispatchers:
                d.detach(session)
            tx.close()

    def _projector(self, tier: Tier) -> Projector | None:
        """The Iceberg projection's actor (``[lake.iceberg] enabled``), or None."""
        cfg = self.cfg
        if not cfg.lake.iceberg.enabled:
            return None

        settings = Settings(catalog_uri=catalog_uri(cfg.catalog, Path(cfg.data_dir)),
                            warehouse=tier.store.location(""),
                            io_properties=tier.store.iceberg_io_properties(),
                            cfg=cfg.lake.iceberg, parent_pid=os.getpid())
        return Projector(tier, RemoteProjection(settings), log=self.log, metrics=self.m,
                         health=self.health)

    async def _ensure_subscriber(self) -> None:
        if all(SUBSCRIBER in s.acks.registry for s in self.shards):
            return
        await self.subscribe("add", SUBSCRIBER, "earliest")

    def status(self) -> dict[str, object]:
        m = self.m
        tier = self.tier
        return {
            "enabled": True,
            "state": "degraded" if self.health.degraded else self.state,
            "degraded": self.health.status(),
            "node_id": tier.node_id if tier else None,
            "source_id": tier.source_id if tier else None,
            "store": tier.store.uri("") if tier else None,
            "catalog": tier.catalog.backend if tier else None,
            "files_uploaded": int(m.lake_files_uploaded.total()),
            "bytes_uploaded": int(m.lake_upload_bytes.total()),
            "rows": int(m.lake_rows.total()),
            "bundles_already_registered": int(m.lake_bundles_skipped.total()),
            "open_files": len(self.uploader.files) if self.uploader else 0,
            "buffered_bytes": int(m.lake_buffered_bytes.total()),
            "unacked_bundles": int(m.lake_unacked.total()),
            "pending_files": int(m.lake_pending_uploads.total()),
            "pending_bytes": int(m.lake_pending_bytes.total()),
            "store_denied": bool(m.lake_denied.total()),
            "errors": {k: int(v) for k, v in m.lake_errors.by_label("kind").items() if v},
            "transitions": {k: int(v) for k, v in m.lake_transitions.by_label("state").items()},
            "scrub": self.janitor.scrub_status() if self.janitor else None,
            "iceberg": self.projector.status() if self.projector
            else {"enabled": self.cfg.lake.iceberg.enabled, "state": "not started"},
        }


def _first(exc: Exception) -> Exception:
    """The first error inside task-group wrapping (anyio groups even a single error)."""
    while isinstance(exc, ExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _part_of(exc: Exception) -> tuple[str, str]:
    """Which part of the lake an error that ended the lake's run belongs to."""
    if isinstance(exc, CatalogUnavailable):
        return "catalog", "unavailable"
    if isinstance(exc, StoreMisconfigured):
        return "store", exc.kind
    if isinstance(exc, StoreDenied):
        return "store", "denied"
    if isinstance(exc, StoreUnavailable):
        return "store", "unavailable"
    if isinstance(exc, OSError):
        return "staging", "io"
    return "lake", "internal"
