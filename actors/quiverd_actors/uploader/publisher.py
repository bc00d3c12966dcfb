"""Publisher: a sealed Stable file in, an uploaded, verified, registered lake file out.

    Sealed ──▶ put_file (conditional create, CRC32C in metadata, verify) ──▶ Uploaded
           ──▶ footer to ``lake.footers`` (the indexer and the projector read it there)
           ──▶ catalog.register (row + coverage, one transaction, NOTIFY) ──▶ MetaRegistered

``publish`` returns the file's row once it is registered (its bundles may be acked) and
None when it had to be abandoned (its bundles are nacked and delivered again). The
store's own retries cover throttling, 5xx, timeouts and resets; after them the upload
is tried again with a longer backoff, forever: the local file and the WAL/segments keep
the data. An authorization error is not retried by the store: it is logged and counted
(``quiver_lake_store_denied`` = 1) and checked again at the store's slowest retry
pace, so fixed credentials are noticed without a restart. A store that rejects the
configuration at run time (a missing bucket) is retried the same way, never an exit.
Every failure after the store's own retries marks the lake's ``store`` part degraded
(``LakeHealth``); the next verified upload clears it. ``WatchedSteps`` (below) does the
same for the ``catalog`` part around every catalog step the uploader retries.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import anyio

from quiverd.kernel.backoff import backoff_s
from quiverd.kernel.errors import (
    CatalogUnavailable,
    CorruptRecord,
    ObjectExists,
    StoreDenied,
    StoreMisconfigured,
    StoreUnavailable,
    VerifyFailed,
)
from quiverd.kernel.faults import Hook
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import Metrics
from quiverd.lake.bundles import coverage
from quiverd.lake.catalog import DuplicateCoverage
from quiverd.lake.footers import Footers
from quiverd.lake.health import LakeHealth
from quiverd.lake.model import FileRow, FileState
from quiverd.lake.parquet import FileFacts
from quiverd.lake.tier import Tier
from quiverd_actors.uploader.files import OpenFile, Sealed, Steps, file_row

P = ParamSpec("P")
T = TypeVar("T")


class Publisher:
    def __init__(self, tier: Tier, steps: Steps, *, log: Logger, metrics: Metrics,
                 health: LakeHealth, footers: Footers | None = None) -> None:
        self.tier, self.steps, self.log, self.m = tier, steps, log, metrics
        self.health = health
        self.footers = footers
        self.denied_retry_s = max(1.0, tier.cfg.lake.store.retry_max_ms / 1000)

    async def publish(self, s: Sealed) -> FileRow | None:
        f, facts = s.file, s.facts
        key = self.tier.object_key(f.client, f.slot, s.path.name, f.hour)
        took = await self._upload(f, key, s.path, facts)
        if took is None:
            return None
        uri = self.tier.store.uri(key)
        uploaded_at = time.time_ns()
        await self.steps.transition(f, FileState.UPLOADED, took, uri=uri, object_key=key,
                                    uploaded_at=uploaded_at)
        row = file_row(self.tier, f, facts, uri=uri, key=key, local=s.path,
                       uploaded_at=uploaded_at)
        started = anyio.current_time()
        if self.footers is not None:
            # Before the registration's NOTIFY, so that the indexer finds it.
            self.footers.put(f.file_id, facts.footer)
        try:
            await self.steps.catalog(self.tier.catalog.register, row, coverage(f.bundles))
        except DuplicateCoverage as exc:
            if self.footers is not None:
                self.footers.forget(f.file_id)
            self.m.lake_errors.labels("duplicate").inc()
            await self.steps.catalog(self.tier.abandon, row,
                                     reason=f"duplicate coverage: {exc}")
            return None
        self.steps.event(f, FileState.META_REGISTERED, anyio.current_time() - started,
                         uri=uri, rows=facts.rows, bytes=facts.compressed_size)
        return row

    async def _upload(self, f: OpenFile, key: str, path: Path, facts: FileFacts
                      ) -> float | None:
        """Upload until it works; the seconds it took, or None if the file was abandoned."""
        attempt = 0
        while True:
            started = anyio.current_time()
            try:
                await self.tier.store.put_file(key, path, size=facts.compressed_size,
                                               crc32c=facts.crc32c)
            except (StoreDenied, StoreMisconfigured) as exc:
                kind = "denied" if isinstance(exc, StoreDenied) else exc.kind
                self.m.lake_denied.labels().set(kind == "denied")
                self.m.lake_errors.labels(kind).inc()
                self.health.fail("store", kind, exc)
                self.log.error(f"lake_upload_{kind}", file_id=f.file_id, key=key,
                               error=str(exc), local_path=str(path), hint=exc.hint)
                await anyio.sleep(self.denied_retry_s)
                continue
            except (StoreUnavailable, VerifyFailed) as exc:
                attempt += 1
                kind = "verify" if isinstance(exc, VerifyFailed) else "unavailable"
                self.m.lake_errors.labels(kind).inc()
                if kind == "unavailable":
                    self.health.fail("store", kind, exc)
                delay = backoff_s(attempt)
                self.log.warning("lake_upload_failed", file_id=f.file_id, key=key,
                                 error=str(exc), retry_in_s=round(delay, 2))
                await anyio.sleep(delay)
                continue
            except (ObjectExists, CorruptRecord, OSError) as exc:
                # A key taken by a different object, or a local file that no longer
                # matches what was sealed (or cannot be read): build the file again from
                # the bundles, which are nacked and delivered again.
                kind = "exists" if isinstance(exc, ObjectExists) else "local_file"
                self.m.lake_errors.labels(kind).inc()
                self.log.error("lake_upload_refused", file_id=f.file_id, key=key,
                               error=str(exc), local_path=str(path))
                row = file_row(self.tier, f, facts, uri="", key="", local=path, uploaded_at=0)
                await self.steps.catalog(self.tier.abandon, row, reason=f"{kind}: {exc}")
                return None
            took = anyio.current_time() - started
            self.health.ok("store")
            self.m.lake_denied.labels().set(0)
            self.m.lake_upload_latency.observe(took)
            self.m.lake_files_uploaded.labels().inc()
            self.m.lake_upload_bytes.labels().inc(facts.compressed_size)
            await self.steps.fault("object_written")
            return took


class WatchedSteps(Steps):
    """``Steps`` whose catalog calls also keep the lake's ``catalog`` part's health."""

    def __init__(self, tier: Tier, *, log: Logger, metrics: Metrics, hook: Hook | None,
                 health: LakeHealth) -> None:
        super().__init__(tier, log=log, metrics=metrics, hook=hook)
        self.health = health

    async def catalog(self, fn: Callable[P, Awaitable[T]], *args: P.args,
                      **kwargs: P.kwargs) -> T:
        async def watched(*a: P.args, **k: P.kwargs) -> T:
            try:
                result = await fn(*a, **k)
            except CatalogUnavailable as exc:
                self.health.fail("catalog", "unavailable", exc)
                raise
            self.health.ok("catalog")
            return result

        return await super().catalog(watched, *args, **kwargs)
