"""Read your writes: a committed job's rows in the catalog now, not when a timer runs out.

    driver ──JOB visible(job_id, timeout_ms)──▶ Visibility.wait          (SPEC §7)
      1. the job is committed (staging, else the catalog)
      2. per shard: seal the open segment if it holds a bundle of the job, up to the
         highest WAL sequence acked so far ──▶ segment_builder (every bundle of the job
         was acked before its commit, so at or below it), then wait until ack.log lists
         the segment (``AckState.segment_floor``)
      3. the job's published bundles here: its staged bundles whose verdict is PUBLISH
      4. until the uploader has acked each of them (acked = its files are registered):
         ``Uploader.rush`` rotates the files holding them once all have arrived
      5. with the Iceberg projection on: until every file registered by then is in a
         committed snapshot (``Projector.projected_through``), so Iceberg readers see
         the rows too
    ◀── JOB_OK {"visible": true, "iceberg": true (null: projection off), "bundles",
        "waited_ms"}
        or, at the timeout: {"visible": false, "pending", "reason": committed and durable,
        the lake's state, what to check}; {"visible": true, "iceberg": false, "reason"}
        when the catalog holds the rows and the snapshot is late

Each step waits on the shards' ``Changes`` (the ack_logger's commits, staging's
decisions) and the builder's; nothing polls, and nothing here touches a bundle's
bytes. A daemon whose lake is off answers at once (``lake: false``): nothing of the
job will be in a catalog. The answer is this daemon's: a job written through several
daemons is visible when each of them says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from quiverd.acks.registry import UnknownSubscriber
from quiverd.kernel.errors import JobConflict
from quiverd.kernel.jobs import Verdict
from quiverd.kernel.logs import Logger

if TYPE_CHECKING:
    from quiverd.runtime.lake import Lake
    from quiverd.runtime.shard import Shard
    from quiverd.runtime.staging import Staging

BundleKey = tuple[int, int, int]  # (shard, segment_seq, bundle_index)
MAX_TIMEOUT_MS = 3_600_000
CHECK_HINT = ("check the lake with `quiverd status` (lake.state, lake.degraded) and the "
              "daemon's log")


class _Progress:
    """How far one request got, for the answer at the timeout."""

    def __init__(self) -> None:
        self.step = "sealing"  # sealing, deciding, publishing, projecting, visible
        self.bundles = 0
        self.pending = 0
        self.catalog = False  # every published bundle here is in a registered file
        self.iceberg: bool | None = None  # ... and in an Iceberg snapshot (None: off)


class Visibility:
    def __init__(self, shards: list[Shard], staging: Staging, *, lake: Callable[[], Lake | None],
                 enabled: bool, subscriber: str, log: Logger) -> None:
        self.shards, self.staging, self.lake = shards, staging, lake
        self.enabled, self.subscriber, self.log = enabled, subscriber, log

    async def wait(self, job_id: str, timeout_ms: int) -> dict[str, Any]:
        """Until every published bundle of ``job_id`` here is in a registered lake file,
        at most ``timeout_ms``; the JOB_OK body. JobConflict: the job is not committed."""
        base: dict[str, Any] = {"job_id": job_id, "node_id": self.staging.node_id,
                                "lake": self.enabled}
        if not self.enabled:
            return {**base, "visible": False, "bundles": 0, "pending": 0, "waited_ms": 0,
                    "reason": "the lake is off on this daemon (lake.enabled = false): no "
                    "catalog will hold the job's rows; its subscribers get them"}
        started = anyio.current_time()
        state = (await self.staging.lookup(job_id))["state"]
        if state != "committed":
            raise JobConflict(f"job {job_id!r} is {state}, not committed: none of its rows "
                              "will be published, so none can become visible",
                              hint="commit the job first")
        progress = _Progress()
        stopped = False
        with anyio.move_on_after(timeout_ms / 1000):
            async with anyio.create_task_group() as tg:

                async def stop_watch() -> None:
                    nonlocal stopped
                    await self.shards[0].stopping.wait()
                    stopped = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stop_watch)
                try:
                    await self._until_visible(job_id, progress)
                finally:
                    uploader = self._uploader()
                    if uploader is not None:
                        uploader.unrush(job_id)
                tg.cancel_scope.cancel()
        waited_ms = round((anyio.current_time() - started) * 1000, 1)
        out = {**base, "visible": progress.catalog, "iceberg": progress.iceberg,
               "bundles": progress.bundles, "pending": progress.pending,
               "waited_ms": waited_ms}
        if progress.step == "visible":
            self.log.info("job_visible", job_id=job_id, bundles=progress.bundles,
                          iceberg=progress.iceberg, waited_ms=waited_ms)
            return out
        out.update(self._not_yet(job_id, progress, waited_ms, stopped))
        self.log.warning("job_not_visible_yet", job_id=job_id, bundles=progress.bundles,
                         pending=progress.pending, step=progress.step, waited_ms=waited_ms,
                         reason=out["reason"])
        return out

    async def _until_visible(self, job_id: str, progress: _Progress) -> None:
        async with anyio.create_task_group() as tg:
            for shard in self.shards:
                tg.start_soon(self._sealed, shard, job_id)
        progress.step = "deciding"
        while True:  # the job's verdicts are final once its decision is known here
            versions = self._versions()
            keys = self._published(job_id)
            if keys is not None:
                break
            await self._any_change(versions)
        progress.step, progress.bundles = "publishing", len(keys)
        left = keys
        while True:
            versions = self._versions()
            left = self._left(left)
            progress.pending = len(left)
            if not left:
                break
            uploader = self._uploader()
            if uploader is not None:  # None while the lake (re)starts: asked again then
                uploader.rush(job_id, set(left))
            await self._any_change(versions)
        progress.catalog = True
        lake = self.lake()
        projector = lake.projector if lake is not None else None
        if projector is not None:
            progress.step, progress.iceberg = "projecting", False
            await projector.projected_through(time.time_ns())
            progress.iceberg = True
        progress.step = "visible"

    async def sealed(self, job_id: str, timeout_s: float) -> bool:
        """Until every bundle of ``job_id`` acked before now (its end markers among them)
        is in a finalized segment staging knows of; False at the timeout. A commit
        checks its winners' markers after this (``Staging.commit``)."""
        with anyio.move_on_after(timeout_s):
            async with anyio.create_task_group() as tg:
                for shard in self.shards:
                    tg.start_soon(self._sealed, shard, job_id)
            return True
        return False

    async def _sealed(self, shard: Shard, job_id: str) -> None:
        """Every bundle of the job on ``shard`` is in a segment ack.log lists."""
        through = int(shard.wal_stats.last_sequence.value)  # the job's were acked before
        segment = await shard.seals.sealed_through(job_id, through)
        while True:
            version = shard.changes.version
            if shard.acks.segment_floor > segment:
                return
            await shard.changes.wait_beyond(version)

    def _published(self, job_id: str) -> list[BundleKey] | None:
        """The job's bundles published here; None while its decision is not known here."""
        if job_id not in self.staging.jobs:
            return []  # none of its bundles is in a live segment of this daemon
        out: list[BundleKey] = []
        for shard in self.shards:
            for info in shard.segments:
                for idx, ref in (info.staged or {}).items():
                    if ref.job_id != job_id:
                        continue
                    verdict = self.staging.verdict(ref)
                    if verdict is Verdict.HOLD:
                        return None
                    if verdict is Verdict.PUBLISH:
                        out.append((shard.index, info.segment_seq, idx))
        return out

    def _left(self, keys: list[BundleKey]) -> list[BundleKey]:
        """The bundles the uploader has not acked yet (a deleted segment was acked by all).
        A bundle once acked stays so: callers pass the previous answer back in."""
        left: list[BundleKey] = []
        for key in keys:
            index, seg, idx = key
            shard = self.shards[index]
            if seg not in shard.segments:
                continue
            try:
                if shard.acks.is_done(self.subscriber, seg, idx):
                    continue
            except UnknownSubscriber:  # the lake's subscriber is not registered yet
                pass
            left.append(key)
        return left

    def _versions(self) -> list[int]:
        return [s.changes.version for s in self.shards]

    async def _any_change(self, versions: list[int]) -> None:
        """Until any shard's ack state or staging's decisions change after ``versions``."""
        async with anyio.create_task_group() as tg:

            async def one(shard: Shard, version: int) -> None:
                await shard.changes.wait_beyond(version)
                tg.cancel_scope.cancel()

            for shard, version in zip(self.shards, versions, strict=True):
                tg.start_soon(one, shard, version)

    def _uploader(self) -> Any:
        lake = self.lake()
        return lake.uploader if lake is not None else None

    def _not_yet(self, job_id: str, progress: _Progress, waited_ms: float, stopped: bool
                 ) -> dict[str, Any]:
        lake = self.lake()
        state = lake.status()["state"] if lake is not None else "starting"
        degraded = lake.health.status() if lake is not None else {}
        seconds = waited_ms / 1000
        if stopped:
            what = "quiverd is stopping"
        elif progress.step == "sealing":
            what = f"its bundles were not all in finalized segments after {seconds:.1f} s"
        elif progress.step == "deciding":
            what = f"the commit had not reached this daemon's staging after {seconds:.1f} s"
        elif progress.step == "projecting":
            what = (f"its rows are in the catalog (spark.read.format(\"quiver\") reads them) "
                    f"but not yet in an Iceberg snapshot after {seconds:.1f} s")
        else:
            what = (f"{progress.pending} of its {progress.bundles} bundles here are not in "
                    f"the catalog after {seconds:.1f} s")
        if degraded:
            parts = "; ".join(f"{part}: {f.get('kind')}: {f.get('error')}"
                              for part, f in degraded.items())
            why = f"the lake is degraded ({parts})"
        else:
            why = f"the lake is {state}"
        reason = (f"job {job_id!r} is committed and durable, but not visible yet on "
                  f"{self.staging.node_id}: {what}; {why}. Its rows are published when the "
                  "lake catches up; nothing is lost, and running the job again would write "
                  f"them twice: {CHECK_HINT}")
        return {"reason": reason, "step": progress.step,
                "lake_state": state,
                "degraded": degraded}
