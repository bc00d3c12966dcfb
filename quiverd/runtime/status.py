"""What the daemon reports about itself: ``status``, subscribers and their lag, segment
listings, the metrics summary, the gauges read at scrape time, and the probes.

    admin socket  status, segments, subscribers.list ─┐
    GET /metrics  derived gauges (lag, usage, lake)  ─┤
    GET /healthz  health()    (nothing degraded)     ─┼─▶ StatusView ─▶ shards, ingest,
    GET /livez    liveness()  (the loop answers)     ─┤                 lake, staging
    GET /readyz   readiness() (appends are taken)    ─┘

Read-only and on the event loop: every value is read where it changes, so no
report ever sees a table mid-update. The view reads the daemon's parts through
``Parts`` (a Protocol), not the daemon itself.

The three probes answer different questions. ``/livez`` is answered by the event loop
itself, so answering is the proof it runs: a liveness probe restarts only a daemon
that no longer answers, never one whose lake is degraded. ``/readyz`` says whether an
append sent now is taken: no while the daemon starts or stops, while a shard's
pipeline has ended, while a shard is at its retention size cap under
``backpressure`` (appends wait or get AT_CAPACITY), while a shard's WAL is at its own
bound (no segment has released it yet), or while a shard's WAL finds no disk space.
``/healthz`` says whether anything is degraded (the lake).
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from quiverd.kernel.config import Config
from quiverd.kernel.metrics import Metrics, build_versions
from quiverd.wal import format as walformat

UPLOADER = "uploader"  # quiverd_actors.uploader.SUBSCRIBER (not imported: it loads the lake)

if TYPE_CHECKING:
    from quiverd.net.ingest import IngestServer
    from quiverd.runtime.lake import Lake
    from quiverd.runtime.retirement import Retirement
    from quiverd.runtime.shard import Shard
    from quiverd.runtime.staging import Staging


# /readyz calls a WAL full when an entry of the shard's mean size (4 KiB of payload at
# least) does not fit in it: the writer then waits for a release (or refuses).
MIN_PROBE_ENTRY_BYTES = walformat.ENTRY_OVERHEAD_LEN + walformat.SLOT_META_LEN + 4096


class Parts(Protocol):
    """The daemon's live parts the view reads (the runtime's Daemon is one)."""

    cfg: Config
    shards: list[Shard]
    ingest: IngestServer | None
    lake: Lake | None
    staging: Staging | None
    retirement: Retirement | None
    stopping: bool


class StatusView:
    def __init__(self, parts: Parts, metrics: Metrics) -> None:
        self.parts, self.metrics = parts, metrics
        self.started = time.monotonic()
        self.versions = build_versions()
        self._derive_gauges()

    def status(self) -> dict[str, Any]:
        p = self.parts
        ingest = p.ingest.stats if p.ingest else None
        return {
            "pid": os.getpid(),
            "data_dir": p.cfg.data_dir,
            "stopping": p.stopping,
            "connections": int(ingest.connections.value) if ingest else 0,
            "ingest": ingest.as_dict() if ingest else {},
            "shards": [s.status() for s in p.shards],
            "lake": {**p.lake.status(), "freshness_s": self.freshness_s()} if p.lake
            else {"enabled": False},
            "staging": p.staging.status() if p.staging else {},
            "retired_subscribers": p.retirement.status() if p.retirement else [],
            "ready": self.readiness(),
            "storage": self.storage(),
            "build": self.versions,
            "metrics": self.metrics_summary(),
        }

    def liveness(self) -> dict[str, Any]:
        """``/livez``: always ``alive`` (the loop is running this); never reads the disk."""
        return {"status": "alive", "uptime_s": round(time.monotonic() - self.started, 3),
                "version": self.versions["version"], "pid": os.getpid()}

    def readiness(self) -> dict[str, Any]:
        """``/readyz``: ``ready``, or ``not_ready`` with each reason (module doc)."""
        p = self.parts
        reasons: list[str] = []
        if p.stopping:
            reasons.append("stopping: appends are refused with SHUTTING_DOWN")
        if p.ingest is None:
            reasons.append("starting: the ingest socket is not served yet")
        backpressure = p.cfg.retention.size_cap_policy == "backpressure"
        for s in p.shards:
            if s.recovered is None:
                reasons.append(f"shard {s.index}: recovering")
            elif not s.unfinished:
                reasons.append(f"shard {s.index}: its pipeline has ended")
            elif backpressure and s.gate.over():
                reasons.append(f"shard {s.index}: at its retention size cap "
                               f"({s.usage_bytes()} of {s.gate.cap_bytes} bytes): appends "
                               "wait for subscribers' acks (or get AT_CAPACITY)")
            elif not s.recovered.wal.fits(_typical_entry_bytes(s)):
                wal = s.recovered.wal
                reasons.append(f"shard {s.index}: its WAL is full ({wal.live_bytes} bytes in "
                               f"{wal.file_count} files): appends wait until a segment is "
                               "written and releases it (or get AT_CAPACITY)")
            if s.wal_stats.disk_full.value:
                reasons.append(f"shard {s.index}: the WAL finds no disk space")
        return {"status": "not_ready" if reasons else "ready", "reasons": reasons}

    def storage(self) -> dict[str, Any]:
        """Bytes the shards hold (WAL + segments + ack.log, the size cap's measure) over the
        size cap, or over the data directory's filesystem when there is no cap."""
        shards = self.parts.shards
        used = sum(s.usage_bytes() for s in shards)
        cap = sum(s.gate.cap_bytes for s in shards) if self.parts.cfg.retention.size_cap_bytes \
            else 0
        try:
            st = os.statvfs(self.parts.cfg.data_dir)
            fs_bytes, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            fs_bytes = free = 0
        over = cap or fs_bytes
        return {"used_bytes": used, "cap_bytes": cap, "filesystem_bytes": fs_bytes,
                "free_bytes": free, "utilisation_ratio": used / over if over else 0.0}

    def health(self) -> dict[str, Any]:
        """``/healthz``: ``ok``, or ``degraded`` with each degraded part by name
        (``lake.store``, ``lake.catalog``, ``lake.staging``, ``lake.lake``)."""
        lake = self.parts.lake
        degraded = {f"lake.{part}": fault for part, fault in
                    (lake.health.status().items() if lake else ())}
        return {"status": "degraded" if degraded else "ok", "degraded": degraded,
                "stopping": self.parts.stopping}

    def subscribers(self) -> list[dict[str, Any]]:
        shards = self.parts.shards
        names = sorted({sub.name for s in shards for sub in s.acks.registry})
        return [{"name": n, **self._lag(n)} for n in names]

    def _lag(self, name: str) -> dict[str, Any]:
        segments = bundles = nbytes = 0
        oldest: list[int] = []
        for shard in self.parts.shards:
            if name not in shard.acks.registry:
                continue
            lag = shard.acks.lag(name)
            segments += lag.segments_behind
            bundles += lag.bundles_pending
            below = shard.acks.covered_below(name)
            nbytes += shard.segments.bytes_from(below)
            if lag.bundles_pending:
                first = next((s for s in shard.segments if s.segment_seq >= below), None)
                if first is not None:
                    oldest.append(first.min_ts_ns)
            if shard.segment_stats.open_min_ts_ns:
                oldest.append(shard.segment_stats.open_min_ts_ns)
        dropped = int(self.metrics.subscriber_dropped.by_label("subscriber").get(name, 0))
        age = max(0.0, (time.time_ns() - min(oldest)) / 1e9) if oldest else 0.0
        return {"lag_segments": segments, "lag_bytes": nbytes, "lag_bundles": bundles,
                "dropped_bundles": dropped, "oldest_pending_s": round(age, 3)}

    def freshness_s(self) -> float | None:
        """How far the lake is behind: the age of the oldest acked bundle not yet in its
        Iceberg table (not yet registered: the uploader's oldest pending bundle, by its
        segment's oldest ingestion time; registered, not yet projected: the projector's
        oldest file). None without a lake."""
        lake = self.parts.lake
        if lake is None:
            return None
        registered = any(UPLOADER in s.acks.registry for s in self.parts.shards)
        pending = self._lag(UPLOADER)["oldest_pending_s"] if registered else 0.0
        iceberg = float(self.metrics.lake_iceberg_lag_seconds.total())
        return round(max(pending, iceberg), 3)

    def metrics_summary(self) -> dict[str, Any]:
        """The registry's design-document series, summed over shards, for `status --json`."""
        m = self.metrics
        return {
            "quiver_gc_evictions_total": _ints(m.gc_evictions.by_label("reason")),
            "quiver_ingest_throttle_total": int(m.ingest_throttle.total()),
            "quiver_ingest_resends_total": int(m.ingest_resends.total()),
            "quiver_subscriber_dropped_bundles_total":
                _ints(m.subscriber_dropped.by_label("subscriber")),
            "quiver_subscriber_rejects_total":
                _ints(m.subscriber_rejects.by_label("subscriber")),
            "quiver_subscribers_retired_total":
                _ints(m.subscribers_retired.by_label("reason")),
            "quiver_segment_dropped_total": int(m.segments_dropped.total()),
            "quiver_wal_corrupt_entries_total": int(m.wal_corrupt_entries.total()),
            "quiver_bundles_lost_total": int(m.bundles_lost.total()),
            "quiver_bundles_acked_total": int(m.bundles_acked.total()),
            "quiver_acked_bytes_total": int(m.bytes_acked.total()),
            "quiver_lost_bytes_total": _ints(m.lost_bytes.by_label("reason")),
            "quiver_core_bytes": {str(s.index): s.usage_bytes() for s in self.parts.shards},
            "quiver_subscriber_lag": {sub["name"]: {k: v for k, v in sub.items() if k != "name"}
                                      for sub in self.subscribers()},
        }

    def segments(self) -> list[dict[str, Any]]:
        rows = []
        for shard in self.parts.shards:
            for seg in shard.segments:
                rows.append({"shard": shard.index, "segment_seq": seg.segment_seq,
                             "bundles": seg.bundle_count, "bytes": seg.size_bytes,
                             "first_sequence": seg.first_sequence,
                             "last_sequence": seg.last_sequence,
                             "min_ts_ns": seg.min_ts_ns, "max_ts_ns": seg.max_ts_ns,
                             "path": str(seg.path)})
        return rows

    def _derive_gauges(self) -> None:
        """Gauges read from live state when collected (on the event loop)."""
        m = self.metrics

        def per_shard(name: str, doc: str, label: str, read: Any) -> None:
            m.derive(name, doc, (label,),
                     lambda: {(str(s.index),): read(s) for s in self.parts.shards})

        per_shard("quiver_core_bytes", "bytes a shard holds: WAL + segments + ack.log",
                  "core_id", lambda s: s.usage_bytes())
        per_shard("quiver_core_cap_fraction", "a shard's bytes over its share of the size "
                  "cap (0 without a cap)", "core_id",
                  lambda s: s.usage_bytes() / s.gate.cap_bytes if s.gate.cap_bytes else 0.0)
        per_shard("quiver_wal_bytes", "live WAL bytes", "shard",
                  lambda s: s.status_wal("wal_bytes"))
        per_shard("quiver_wal_files", "WAL files", "shard", lambda s: s.status_wal("wal_files"))
        per_shard("quiver_segments", "finalized segments on disk", "shard",
                  lambda s: len(s.segments))
        per_shard("quiver_segment_bytes", "bytes of finalized segments on disk", "shard",
                  lambda s: s.segments.total_bytes())
        per_shard("quiver_segments_unverified", "segments whose stream bytes no CRC has "
                  "checked since startup (first read or scrubber to come)", "shard",
                  lambda s: s.checks.unverified_count)
        per_shard("quiver_scrub_pass_progress", "fraction of the current scrub pass's bytes "
                  "checked", "shard", lambda s: (s.checks.pass_done_bytes / s.checks.pass_bytes
                                                 if s.checks.pass_bytes else 1.0))
        for key, doc in (("lag_bundles", "bundles a subscriber has not acked"),
                         ("lag_segments", "segments a subscriber's mark is behind"),
                         ("lag_bytes", "bytes of the segments a subscriber still needs"),
                         ("oldest_pending_s", "age of the oldest bundle a subscriber has "
                          "not acked (its segment's oldest ingestion time, or the open "
                          "segment's)")):
            m.derive(f"quiver_subscriber_{key}", doc, ("subscriber",),
                     functools.partial(self._lag_gauge, key))
        m.derive("quiver_lake_freshness_seconds", "age of the oldest acked bundle not "
                 "yet in an Iceberg snapshot (not yet registered, or registered and not "
                 "yet projected); absent without a lake", (),
                 lambda: {} if (f := self.freshness_s()) is None else {(): f})
        m.derive("quiver_delivery_held_seconds", "age of the undecided job at which a "
                 "shard's deliveries and streams wait (absent: none waits)", ("shard", "job_id"),
                 self._held_gauge)
        m.derive("quiver_storage_utilisation_ratio", "bytes the shards hold (WAL + segments "
                 "+ ack.log) over retention.size_cap_bytes, or over the data directory's "
                 "filesystem size when there is no cap", (),
                 lambda: {(): self.storage()["utilisation_ratio"]})
        m.derive("quiver_storage_free_bytes", "bytes free for quiverd on the data "
                 "directory's filesystem (statvfs f_bavail)", (),
                 lambda: {(): self.storage()["free_bytes"]})
        m.derive("quiver_ready", "1 while the daemon takes appends (GET /readyz 200), else 0",
                 (), lambda: {(): float(self.readiness()["status"] == "ready")})
        m.derive("quiver_lake_degraded", "1 while a part of the lake (store, catalog, "
                 "staging) is degraded, with the kind of fault; 0 per part otherwise",
                 ("part", "kind"), self._lake_gauge)

    def _lag_gauge(self, key: str) -> dict[tuple[str, ...], float]:
        return {(sub["name"],): sub[key] for sub in self.subscribers()}

    def _held_gauge(self) -> dict[tuple[str, ...], float]:
        staging = self.parts.staging
        if staging is None:
            return {}
        return {(str(shard), h["job_id"]): h["age_s"]
                for shard, h in staging.status()["holding"].items()}

    def _lake_gauge(self) -> dict[tuple[str, ...], float]:
        lake = self.parts.lake
        return lake.health.gauge() if lake is not None else {}


def _typical_entry_bytes(shard: Shard) -> int:
    """The mean WAL entry this shard has written (``MIN_PROBE_ENTRY_BYTES`` at least)."""
    w = shard.wal_stats
    mean = w.bytes_written.value / w.appends.value if w.appends.value else 0
    return max(MIN_PROBE_ENTRY_BYTES, int(mean))


def _ints(values: dict[str, float]) -> dict[str, int]:
    """Counters by label for status, without the ones still at 0."""
    return {k: int(v) for k, v in values.items() if v}
