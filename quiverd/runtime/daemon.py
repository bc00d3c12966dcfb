"""``quiverd serve``: one process, one root task group, one pipeline per shard.

    ingest listener ─▶ wal_writer[n] ─▶ segment_builder[n] ─▶ finalizer[n] ─▶ ack_logger[n]
                            ▲                                    │               │ (Changes)
                            └────────── WalReleased ─────────────┘    dispatcher[n], gc_sweeper[n]
    admin socket (status, subscribers), /metrics, /livez, /readyz, /healthz:
    runtime.status.StatusView

(each shard's wiring: ``quiverd.runtime.shard``)

Startup: take ``data_dir/LOCK`` (flock), recover every shard (segments, WAL
replay) in worker threads, start actors in dependency order, then listen, then
tell systemd READY. Shutdown (SIGTERM/SIGINT, or the ``stop`` event a caller
running the daemon in process passes): stop accepting and reading,
deliver pending acks, let end-of-stream flow down every pipeline (final
fdatasync, final segment), exit within ``shutdown_timeout_ms``; a second signal
exits at once.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio

from quiverd.acks import retired
from quiverd.kernel import logs
from quiverd.kernel.config import Config
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.faults import Hooks
from quiverd.kernel.layout import DataDir, shard_index
from quiverd.kernel.logs import Logger
from quiverd.kernel.metrics import IngestMetrics, Metrics
from quiverd.kernel.names import validate_subscriber_name
from quiverd.kernel.reply import Reply
from quiverd.net.admin import AdminServer
from quiverd.net.established import EstablishedSchemas
from quiverd.net.ingest import IngestServer
from quiverd.net.metrics_http import MetricsServer
from quiverd.net.rawsock import BoundSocket
from quiverd.net.whereabouts import lake_reply
from quiverd.runtime.retirement import Retirement
from quiverd.runtime.sdnotify import Notifier
from quiverd.runtime.shard import Shard
from quiverd.runtime.staging import Staging
from quiverd.runtime.status import StatusView
from quiverd.runtime.visibility import Visibility
from quiverd_actors.messages import ChangeSubscriber

if TYPE_CHECKING:
    from quiverd.runtime.lake import Lake

SubscriberOp = Literal["add", "remove"]
SubscriberStart = Literal["earliest", "latest"]
LAKE_SUBSCRIBER = "uploader"  # quiverd_actors.uploader.SUBSCRIBER (a test keeps them equal)
EXTEND_EVERY_S = 5.0  # while replaying, every 5 s ask systemd for 15 s more
EXTEND_USEC = 15_000_000


class Daemon:
    def __init__(self, cfg: Config, *, faults: Hooks | None = None,
                 stop: anyio.Event | None = None, handle_signals: bool = True,
                 bound: dict[Path, BoundSocket] | None = None) -> None:
        """``stop``: set it to begin a graceful shutdown (in-process callers and tests);
        ``handle_signals``: whether SIGTERM/SIGINT do the same (the main thread only);
        ``bound``: sockets already listening, by path (``serve.claim``), else bound here."""
        self.cfg = cfg
        self.bound = bound or {}
        self.log = logs.get("daemon")
        self.notifier = Notifier()
        self.faults = faults or {}
        self.metrics = Metrics()
        self.metrics_server: MetricsServer | None = None
        self.stop = stop
        self.handle_signals = handle_signals
        self.shards: list[Shard] = []
        self.ingest: IngestServer | None = None
        self.lake: Lake | None = None  # imported only when the lake is on
        self.staging: Staging | None = None
        self.retirement: Retirement | None = None  # once the shards run
        self.stopping = False
        self.view = StatusView(self, self.metrics)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run until shut down; the caller holds the data directory's LOCK.

        ``task_status.started()`` fires when the daemon is ready (sockets listening),
        so an in-process caller can ``await tg.start(daemon.run)``.
        """
        try:
            await self._run(task_status)
        finally:
            self.notifier.close()

    async def _run(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        cfg = self.cfg
        count = await anyio.to_thread.run_sync(shards_to_serve, cfg, self.log)
        self.staging = Staging(cfg, metrics=self.metrics)
        self.shards = [Shard(i, cfg, shard_count=count, faults=self.faults,
                             metrics=self.metrics, staging=self.staging,
                             verdict=self.staging.verdict) for i in range(count)]
        self.staging.wakers = [s.changes for s in self.shards]
        self.staging.views = lambda: [s.segments for s in self.shards]
        try:
            await self._serve(self.staging, task_status)
        finally:
            # The actors close what they own; a start that failed before they ran (a
            # shard's recovery, the lake, a socket) must not leave a shard's files open.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._close_recovered)
        self.log.info("quiverd_stopped")

    def _close_recovered(self) -> None:
        for shard in self.shards:
            if shard.recovered is not None:
                shard.recovered.wal.close()
                shard.recovered.ack_file.close()

    async def _serve(self, staging: Staging, task_status: anyio.abc.TaskStatus[None]) -> None:
        cfg = self.cfg
        async with anyio.create_task_group() as root:
            await self._recover()
            await root.start(staging.run)
            if self.handle_signals:
                root.start_soon(self._signals, root.cancel_scope)
            if self.stop is not None:
                root.start_soon(self._stop_on, self.stop, root.cancel_scope)
            async with anyio.create_task_group() as pipelines:
                for shard in self.shards:
                    await pipelines.start(shard.run)
                await self._start_lake(pipelines)
                staging.visibility = Visibility(  # the JOB op "visible" (SPEC §7)
                    self.shards, staging, lake=lambda: self.lake,
                    enabled=cfg.lake.enabled, subscriber=LAKE_SUBSCRIBER,
                    log=logs.get("visibility"))
                self.ingest = IngestServer(cfg.ingest, cfg.ingest_socket,
                                           [s.inbox for s in self.shards],
                                           limiter=anyio.CapacityLimiter(2),
                                           log=logs.get("ingest"),
                                           metrics=IngestMetrics(self.metrics),
                                           bound=self.bound.get(cfg.ingest_socket))
                self.ingest.jobs = staging
                self.retirement = await self._retirement(self.ingest)
                self.ingest.lake = lake_reply(cfg)
                if cfg.lake.schema_mode == "strict":
                    self.ingest.established = EstablishedSchemas(Path(cfg.data_dir),
                                                                 log=logs.get("ingest"))
                admin = AdminServer(cfg.admin_socket, self, cfg.admin, log=logs.get("admin"),
                                    bound=self.bound.get(cfg.admin_socket))
                admin.jobs = staging  # quiverd jobs list|abort
                self.ingest.hub.dispatchers = [s.dispatcher for s in self.shards
                                               if s.dispatcher is not None]
                await pipelines.start(self.ingest.serve)
                if cfg.metrics.listen:  # before the admin socket: ready means scrapeable
                    self.metrics_server = MetricsServer(cfg.metrics.listen, self.metrics,
                                                        log=logs.get("metrics"),
                                                        health=self.view.health,
                                                        live=self.view.liveness,
                                                        ready=self.view.readiness)
                    await root.start(self.metrics_server.serve)
                await root.start(admin.serve)
                await root.start(self.retirement.run)
                self.log.info("quiverd_ready", shards=len(self.shards), data_dir=cfg.data_dir,
                              ingest_socket=str(cfg.ingest_socket))
                self.notifier.ready(f"{len(self.shards)} shards")
                task_status.started()
                if self.notifier.watchdog_interval_s():
                    root.start_soon(self._watchdog)
            # Every pipeline drained: end the admin server and signal watchers.
            root.cancel_scope.cancel()

    def shutdown(self) -> None:
        """Begin a graceful stop (idempotent)."""
        if self.stopping:
            return
        self.stopping = True
        self.notifier.stopping()
        self.log.info("quiverd_stopping")
        if self.retirement is not None:
            self.retirement.stop()
        if self.lake is not None:
            self.lake.stop()  # first: its acks need the shards' ack loggers
        for shard in self.shards:
            shard.stopping.set()
        if self.ingest is not None:
            self.ingest.stop()

    async def _start_lake(self, group: anyio.abc.TaskGroup) -> None:
        if not self.cfg.lake.enabled:
            # The lake's modules are not even imported (OpenDAL, Parquet: ~30 MB of RSS).
            if any(LAKE_SUBSCRIBER in s.acks.registry for s in self.shards):
                self.log.warning(
                    "lake_disabled_subscriber_registered",
                    hint=f"lake.enabled = false but the subscriber {LAKE_SUBSCRIBER!r} is "
                    "registered: segments are kept until it acks them. Remove it with "
                    f"`quiverd subscribers remove {LAKE_SUBSCRIBER}` if the lake is off for good")
            return
        from quiverd.runtime.lake import Lake

        self.lake = Lake(self.cfg, self.shards, subscribe=self.subscriber_op,
                         metrics=self.metrics, faults=self.faults,
                         decided=self.staging.fate if self.staging else None)
        await group.start(self.lake.run)

    async def _retirement(self, ingest: IngestServer) -> Retirement:
        """Retirement of abandoned subscribers (``runtime.retirement``), its marks loaded;
        a mark of a name registered again is void and leaves the file."""
        path = DataDir(Path(self.cfg.data_dir)).retired
        try:
            marks = await anyio.to_thread.run_sync(retired.load, path)
        except (OSError, ValueError) as exc:
            marks = retired.RetiredMarks(path)
            self.log.warning("retired_file_unreadable", path=str(path), error=str(exc),
                             hint="it only holds why subscribers were retired; it is "
                             "rewritten at the next retirement")
        void = [m.name for m in marks if any(m.name in s.acks.registry for s in self.shards)]
        for name in void:
            marks.discard(name)
        if void:
            await anyio.to_thread.run_sync(marks.save)
        exempt = {LAKE_SUBSCRIBER, *(sub.name for sub in self.cfg.subscribers)}
        disk = 0
        if self.cfg.retire_lag_bytes is None:  # no cap, no limit: half of what fits
            st = await anyio.to_thread.run_sync(os.statvfs, self.cfg.data_dir)
            disk = st.f_bavail * st.f_frsize + sum(s.usage_bytes() for s in self.shards)
        retirement = Retirement(self.cfg, self.shards, ingest.hub, marks,
                                remove=lambda name: self.subscriber_op("remove", name),
                                exempt=exempt, metrics=self.metrics,
                                log=logs.get("retirement"), disk_bytes=disk)
        ingest.hub.refusal = retirement.refusal
        return retirement

    async def _signals(self, root_scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self.stopping:
                    self.log.warning("quiverd_second_signal", signal=signum)
                    os._exit(1)
                self._begin_stop(root_scope)

    async def _stop_on(self, stop: anyio.Event, root_scope: anyio.CancelScope) -> None:
        await stop.wait()
        self._begin_stop(root_scope)

    def _begin_stop(self, root_scope: anyio.CancelScope) -> None:
        self.shutdown()
        # Bound the drain: past the timeout, cancel everything and exit non-zero.
        root_scope.deadline = anyio.current_time() + self.cfg.shutdown_timeout_ms / 1000

    async def _recover(self) -> None:
        """Recover every shard in parallel worker threads; keep systemd's start timer fed."""
        async with anyio.create_task_group() as keepalive:
            keepalive.start_soon(self._extend_start_timeout)
            async with anyio.create_task_group() as shards:
                for shard in self.shards:
                    shards.start_soon(shard.recover)
            keepalive.cancel_scope.cancel()

    async def _extend_start_timeout(self) -> None:
        """While replay runs, ask systemd for more time (TimeoutStartSec stays short)."""
        while True:
            done = sum(s.recovered is not None for s in self.shards)
            self.notifier.extend_timeout(EXTEND_USEC, f"recovering: {done} of "
                                         f"{len(self.shards)} shards replayed")
            await anyio.sleep(EXTEND_EVERY_S)

    async def _watchdog(self) -> None:
        """Ping systemd only while every shard makes progress on the work it holds.

        A shard with appends written but not yet covered by an fdatasync must
        complete one within each interval; one that does not (a hung disk) stops
        the pings, and systemd restarts the daemon after WatchdogSec. A shard
        waiting for producers, subscribers or retention is idle, not stalled.
        """
        interval = self.notifier.watchdog_interval_s() or 1.0
        marks = [s.progress_mark() for s in self.shards]
        while True:
            stalled = [s.index for s, mark in zip(self.shards, marks, strict=True)
                       if s.stalled_since(mark)]
            if stalled:
                self.log.error("watchdog_shard_stalled", shards=stalled, interval_s=interval,
                               hint="an fdatasync has not returned for a whole watchdog "
                               "interval: check the disk (dmesg); systemd restarts quiverd "
                               "after WatchdogSec")
            else:
                self.notifier.watchdog()
            marks = [s.progress_mark() for s in self.shards]
            await anyio.sleep(interval)

    def status(self) -> dict[str, Any]:
        return self.view.status()

    def subscribers(self) -> list[dict[str, Any]]:
        return self.view.subscribers()

    def segments(self) -> list[dict[str, Any]]:
        return self.view.segments()

    async def subscriber_op(self, op: str, name: str, start: str = "earliest") -> dict[str, Any]:
        """Add or remove a subscriber on every shard (each shard's ack.log records it)."""
        validate_subscriber_name(name)
        if op not in ("add", "remove"):
            raise ConfigError("op", f"must be 'add' or 'remove', not {op!r}")
        if start not in ("earliest", "latest"):
            raise ConfigError("start", f"must be 'earliest' or 'latest', not {start!r}")
        replies: list[Reply[None]] = []
        for shard in self.shards:
            reply: Reply[None] = Reply()
            await shard.ack_tx.send(ChangeSubscriber(
                op=cast(SubscriberOp, op), name=name, start=cast(SubscriberStart, start),
                reply=reply))
            replies.append(reply)
        for reply in replies:
            await reply.settled()
        errors = [r.error for r in replies if r.error is not None]
        if len(errors) == len(replies):
            raise errors[0]
        self.log.info("subscriber_" + ("added" if op == "add" else "removed"), subscriber=name,
                      start=start)
        if op == "add" and self.retirement is not None:
            await self.retirement.readded(name)
        return {"name": name, "op": op, "shards": len(self.shards) - len(errors)}


def shards_to_serve(cfg: Config, log: Logger) -> int:
    """The configured shard count, raised to cover every shard directory on disk.

    Shard directories hold acknowledged data; serving fewer than exist would hide
    them from status, delivery and retention. Blocking (lists ``data_dir``).
    """
    data = DataDir(Path(cfg.data_dir))
    on_disk = [i for p in data.root.iterdir()
               if p.is_dir() and (i := shard_index(p.name)) is not None]
    count = max([cfg.shard_count, *(i + 1 for i in on_disk)])
    if count > cfg.shard_count:
        log.warning("shards_raised_to_data_on_disk", configured=cfg.shard_count, serving=count,
                    shard_dirs=sorted(on_disk),
                    hint=f"data_dir holds shard directories up to shard-{count - 1}; they keep "
                    f"being served. Set shards = {count} to silence this; to shrink, let "
                    "subscribers drain the extra shards first, then move the directory away")
    return count

