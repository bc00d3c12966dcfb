"""Every number quiverd exports, in one registry: Prometheus text and `status --json` alike.

    Metrics ──(prometheus_client CollectorRegistry)──▶ GET /metrics   (net/metrics_http.py)
        │                                         └──▶ status --json  (runtime/daemon.py)
        ├─ counters and gauges: ``Series`` of plain values, one per label set
        ├─ histograms: prometheus_client ``Histogram`` (ack latency, fdatasync latency)
        └─ derived state (lag, usage, segments): ``derive`` callbacks read at collect time

Actors hold bound values (``WalMetrics`` etc., one label set each) and change them
on the event loop with ``inc``/``set``; reads are plain attribute reads, so the
ingest path pays no lock. Collection runs on the event loop too (the HTTP
endpoint and the admin socket both serve from it), so a scrape never sees a
table being changed under it.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from quiverd import __version__

# Seconds: group commit is 25 ms by default, an fdatasync 0.1-1 ms on a good disk.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


class Value:
    """One counter or gauge value (one label set)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value


class Series:
    """A named counter or gauge family; ``labels(...)`` gives one value."""

    def __init__(self, name: str, doc: str, kind: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.kind, self.label_names = name, doc, kind, labels
        self.values: dict[tuple[str, ...], Value] = {}

    def labels(self, *values: object) -> Value:
        key = tuple(str(v) for v in values)
        assert len(key) == len(self.label_names), (self.name, key)
        found = self.values.get(key)
        if found is None:
            found = self.values[key] = Value()
        return found

    def total(self) -> float:
        return sum(v.value for v in self.values.values())

    def by_label(self, label: str) -> dict[str, float]:
        """Values summed per value of ``label`` (e.g. evictions by reason)."""
        i = self.label_names.index(label)
        out: dict[str, float] = {}
        for key, v in self.values.items():
            out[key[i]] = out.get(key[i], 0) + v.value
        return out

    def family(self) -> Metric:
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        fam = cls(self.name, self.doc, labels=list(self.label_names))
        for key, v in sorted(self.values.items()):
            fam.add_metric(list(key), v.value)
        return fam


@dataclass(frozen=True)
class Derived:
    """A gauge computed when collected: ``read()`` -> {label values: value}."""

    name: str
    doc: str
    labels: tuple[str, ...]
    read: Callable[[], dict[tuple[str, ...], float]]


class Metrics:
    """The daemon's one registry: every series is declared here, nowhere else."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._series: list[Series] = []
        self._derived: list[Derived] = []
        c, g, sh = self._counter, self._gauge, ("shard",)
        # WAL writer (per shard)
        self.wal_appends = c("quiver_wal_appends_total", "WAL entries written", sh)
        self.wal_written_bytes = c("quiver_wal_written_bytes_total", "WAL bytes written", sh)
        self.wal_fsyncs = c("quiver_wal_fsyncs_total", "WAL fdatasync calls that returned", sh)
        self.bundles_acked = c("quiver_bundles_acked_total",
                               "bundles acknowledged to producers (after their fdatasync)", sh)
        self.bytes_acked = c("quiver_acked_bytes_total",
                             "payload bytes of acknowledged bundles", sh)
        self.wal_inflight = g("quiver_wal_inflight_bundles",
                              "bundles written, waiting for the fdatasync that covers them", sh)
        self.wal_last_sequence = g("quiver_wal_last_sequence", "last WAL sequence written", sh)
        self.wal_capacity_waits = c("quiver_wal_capacity_waits_total",
                                    "appends that waited for WAL space", sh)
        self.ingest_rejected = c("quiver_ingest_rejected_total",
                                 "bundles refused with AT_CAPACITY", sh)
        self.ingest_resends = c("quiver_ingest_resends_total",
                                "named producers' bundles sent again and answered with the "
                                "first one's outcome, not stored again", sh)
        self.ingest_throttle = c("quiver_ingest_throttle_total",
                                 "appends held back by the retention size cap", sh)
        self.wal_disk_full = g("quiver_wal_disk_full",
                               "1 while the WAL writer holds or refuses bundles because the "
                               "disk is full", sh)
        # Writes refused for lack of space (ENOSPC, EDQUOT, or the free-space reserve):
        # file is "wal" (appends), "segment" (segment files, FLOOR), "sidecar" (releases) or
        # "acklog" (outcome records, retried once space returns).
        self.disk_full = c("quiver_disk_full_total",
                           "writes that found no disk space (each is retried or refused, "
                           "never lost)", ("shard", "file"))
        # Segment builder and finalizer
        self.open_bundles = g("quiver_open_segment_bundles", "bundles in the open segment", sh)
        self.open_bytes = g("quiver_open_segment_bytes", "payload bytes in the open segment", sh)
        self.open_streams = g("quiver_open_segment_streams", "streams in the open segment", sh)
        self.segments_sealed = c("quiver_segments_sealed_total", "segments sealed",
                                 ("shard", "reason"))
        self.segments_finalized = c("quiver_segments_finalized_total",
                                    "segment files written durably", sh)
        self.segment_finalized_bytes = c("quiver_segment_finalized_bytes_total",
                                         "bytes of segment files written", sh)
        self.segment_write_failures = c("quiver_segment_write_failures_total",
                                        "segment or FLOOR writes that failed before their "
                                        "rename and are retried (the WAL still holds the data)",
                                        sh)
        # ack logger
        self.ack_log_records = c("quiver_ack_log_records_total", "ack.log records written", sh)
        self.ack_log_fsyncs = c("quiver_ack_log_fsyncs_total", "ack.log fdatasync calls", sh)
        self.ack_log_compactions = c("quiver_ack_log_compactions_total",
                                     "ack.log compactions", sh)
        self.ack_log_bytes = g("quiver_ack_log_bytes", "size of ack.log", sh)
        # dispatcher
        self.delivered = c("quiver_delivered_bundles_total", "bundles sent to subscribers",
                           ("shard", "subscriber"))
        self.redelivered = c("quiver_redelivered_bundles_total",
                             "bundles sent again (nack, reconnect)", ("shard", "subscriber"))
        self.subscriber_acks = c("quiver_subscriber_acks_total", "acks from subscribers",
                                 ("shard", "subscriber"))
        self.subscriber_nacks = c("quiver_subscriber_nacks_total", "nacks from subscribers",
                                  ("shard", "subscriber"))
        self.subscriber_rejects = c("quiver_subscriber_rejects_total",
                                    "rejects from subscribers (never delivered to them again)",
                                    ("shard", "subscriber"))
        self.sessions = g("quiver_subscriber_sessions", "attached subscriber connections", sh)
        # gc sweeper (names from the design document)
        self.gc_evictions = c("quiver_gc_evictions_total", "segments deleted, by reason",
                              ("shard", "reason"))
        self.segments_dropped = c("quiver_segment_dropped_total",
                                  "segments deleted while some subscriber lacked bundles", sh)
        self.subscriber_dropped = c("quiver_subscriber_dropped_bundles_total",
                                    "bundles a subscriber never got (retention)",
                                    ("shard", "subscriber"))
        self.subscribers_retired = c("quiver_subscribers_retired_total",
                                     "subscribers removed for having no live consumer "
                                     "(retention.retire_*), by reason: lag_bytes, idle",
                                     ("reason",))
        self.gc_sweeps = c("quiver_gc_sweeps_total", "gc sweeps", sh)
        self.gc_delete_batches = c("quiver_gc_delete_batches_total",
                                   "deletion batches (one marker write, one dir fsync each)", sh)
        # scrubber: whole-file CRCs off the startup path (first read, background passes)
        self.scrub_bytes = c("quiver_scrub_bytes_total", "segment bytes the scrubber read "
                             "and CRC-checked", sh)
        self.scrub_segments = c("quiver_scrub_segments_total",
                                "segments the scrubber found intact", sh)
        self.scrub_passes = c("quiver_scrub_passes_total", "scrub passes over every segment "
                              "completed", sh)
        self.segments_corrupt = c("quiver_segments_corrupt_total", "segments found corrupt "
                                  "after startup and quarantined, by the check that found "
                                  "them (read: before first delivery; scrub)",
                                  ("shard", "found_by"))
        # Bytes some subscriber will never get, by why: the gc's ``size_cap`` (under
        # drop_oldest) and ``max_age`` deletions, the scrubber's quarantine and the one at
        # startup (runtime.shard). Whole segment files, the unit all of them work in: one
        # a subscriber had partly acked counts whole.
        self.lost_bytes = c("quiver_lost_bytes_total", "bytes deleted before every "
                            "subscriber had them, by reason: drop_oldest (size cap), expired "
                            "(max_age), corrupt (a segment quarantined at startup or after, "
                            "its bundles lost); counted as whole segment file sizes (WAL "
                            "entries skipped as damage: quiver_wal_corrupt_entries_total)",
                            ("shard", "reason"))
        # recovery
        self.wal_corrupt_entries = c("quiver_wal_corrupt_entries_total",
                                     "WAL entries found corrupt at replay", sh)
        self.bundles_lost = c("quiver_bundles_lost_total", "acknowledged bundles recovery "
                              "found neither in a segment nor in the WAL", sh)
        # ingest listener (daemon-wide)
        self.connections = g("quiver_ingest_connections", "open connections", ())
        self.connections_total = c("quiver_ingest_connections_total", "connections accepted", ())
        self.ingest_bundles = c("quiver_ingest_bundles_total", "bundles received and valid", ())
        self.ingest_errors = c("quiver_ingest_protocol_errors_total",
                               "connections ended by a protocol error", ())
        self.ingest_unauthorized = c("quiver_ingest_unauthorized_total",
                                     "peers refused by the uid/gid allowlist", ())
        self.ingest_refused = c("quiver_ingest_refused_total",
                                "connections refused at max_connections(_per_uid)", ())
        self.ingest_timeouts = c("quiver_ingest_timeouts_total",
                                 "handshake, idle or stalled-frame timeouts", ())
        self.pending_bytes = g("quiver_ingest_pending_bytes",
                               "bundle bytes received, not yet durable (budget in use)", ())
        self.budget_waits = c("quiver_ingest_budget_waits_total",
                              "times a connection stopped reading to wait for budget", ())
        # latencies
        self.ack_latency = Histogram(
            "quiver_ack_latency_seconds", "from the WAL writer taking a bundle to its ack "
            "(write + group-commit wait + fdatasync)", sh, buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self.fdatasync_latency = Histogram(
            "quiver_wal_fdatasync_seconds", "duration of one WAL fdatasync", sh,
            buckets=LATENCY_BUCKETS, registry=self.registry)
        # lake (uploader, indexer, janitor, compaction; daemon-wide)
        self.lake_transitions = c("quiver_lake_file_transitions_total",
                                  "lake files entering a lifecycle state", ("state",))
        self.lake_files_uploaded = c("quiver_lake_files_uploaded_total",
                                     "Parquet files uploaded and verified", ())
        self.lake_upload_bytes = c("quiver_lake_upload_bytes_total",
                                   "Parquet bytes uploaded and verified", ())
        self.lake_rotations = c("quiver_lake_rotations_total",
                                "Active files closed to Stable, by reason", ("reason",))
        self.lake_rows = c("quiver_lake_rows_total", "rows appended to Parquet files", ())
        self.lake_staged_files = c("quiver_lake_staged_files_total",
                                   "files of a job's rows written while it was undecided, by "
                                   "outcome: published (every bundle came published), lost "
                                   "(its attempt was not the winner), stalled, unclaimed, "
                                   "failed (given up: the bundles took the usual path)",
                                   ("outcome",))
        self.lake_dead_letters = c("quiver_lake_dead_letters_total",
                                   "bundles the lake could not write, set aside as dead "
                                   "letters and rejected, by client and reason (schema, "
                                   "encode, cast, other)", ("client", "reason"))
        self.lake_errors = c("quiver_lake_errors_total", "storage tier errors, by kind",
                             ("kind",))
        self.lake_bundles_skipped = c("quiver_lake_bundles_already_registered_total",
                                      "redelivered bundles acked without a second upload "
                                      "(a registered file holds them)", ())
        self.lake_buffered_bytes = g("quiver_lake_buffered_bytes",
                                     "Arrow bytes waiting for their row group", ())
        self.lake_unacked = g("quiver_lake_unacked_bundles",
                              "bundles the uploader holds until their files are registered", ())
        self.lake_pending_uploads = g("quiver_lake_pending_files",
                                      "Stable files not yet registered", ())
        self.lake_pending_bytes = g("quiver_lake_pending_bytes",
                                    "bytes of Stable files not yet registered", ())
        self.lake_denied = g("quiver_lake_store_denied",
                             "1 while the object store refuses our credentials", ())
        self.lake_objects_corrupt = c("quiver_lake_objects_corrupt_total",
                                      "lake objects whose size or CRC-32C failed the lake "
                                      "scrub (quarantined)", ())
        self.lake_scrub_bytes = c("quiver_lake_scrub_bytes_total",
                                  "lake object bytes read back and checked by the scrub", ())
        # the Iceberg projection (actors/quiverd_actors/projector.py)
        self.lake_iceberg_lag_files = g("quiver_lake_iceberg_lag_files",
                                        "registered lake files not yet in their Iceberg "
                                        "table's current snapshot", ())
        self.lake_iceberg_lag_seconds = g("quiver_lake_iceberg_lag_seconds",
                                          "age of the oldest registered file not yet in its "
                                          "Iceberg table", ())
        self.lake_iceberg_commits = c("quiver_lake_iceberg_commits_total",
                                      "Iceberg snapshots committed, by kind (append, "
                                      "reconcile, replace)", ("kind",))
        self.lake_iceberg_files = c("quiver_lake_iceberg_files_total",
                                    "data files added to or removed from Iceberg tables",
                                    ("change",))
        self.lake_iceberg_skipped = c("quiver_lake_iceberg_skipped_total",
                                      "registered files Iceberg cannot hold (not projected), "
                                      "by reason", ("reason",))
        # staging: transactional (Spark) writes held until their job is decided
        self.staged_jobs = g("quiver_staged_jobs",
                             "jobs with staged bundles in segments, by decision state",
                             ("state",))
        self.staged_bytes = g("quiver_staged_bytes", "segment bytes of undecided jobs' "
                              "bundles (pro rata per segment)", ())
        self.jobs_decided = c("quiver_jobs_decided_total", "job decisions this daemon "
                              "learned (its own or another node's), by state", ("state",))
        self.staged_discarded = c("quiver_staged_bundles_discarded_total",
                                  "staged bundles never delivered (losing attempt, aborted "
                                  "or expired job, end marker), per subscriber",
                                  ("subscriber",))
        self.staged_invalid = c("quiver_staged_attempts_invalid_total",
                                "winning attempts discarded: end marker missing or "
                                "different from the commit's rows/checksum", ())
        self.lake_upload_latency = Histogram(
            "quiver_lake_upload_seconds", "upload + verify of one Parquet file", (),
            buckets=LATENCY_BUCKETS + (30.0, 60.0), registry=self.registry)
        self.lake_append_latency = Histogram(
            "quiver_lake_append_seconds", "one row-group append (conform + Parquet encode)", (),
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.lake_iceberg_commit_latency = Histogram(
            "quiver_lake_iceberg_commit_seconds", "one Iceberg commit (one snapshot, "
            "compare-and-swap retries included)", (),
            buckets=LATENCY_BUCKETS + (30.0, 60.0), registry=self.registry)
        self.build_info = g("quiver_build_info", "1, labelled with the versions this daemon "
                            "runs", ("version", "python", "pyarrow"))
        self.build_info.labels(*build_versions().values()).set(1)
        self.registry.register(self)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...]) -> Series:
        return self._add(Series(name, doc, "counter", labels))

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...]) -> Series:
        return self._add(Series(name, doc, "gauge", labels))

    def _add(self, series: Series) -> Series:
        self._series.append(series)
        return series

    def derive(self, name: str, doc: str, labels: tuple[str, ...],
               read: Callable[[], dict[tuple[str, ...], float]]) -> None:
        """A gauge read from live state at collect time (lag, usage, segment counts)."""
        self._derived.append(Derived(name, doc, labels, read))

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol (histograms register themselves)."""
        for series in self._series:
            yield series.family()
        for d in self._derived:
            fam = GaugeMetricFamily(d.name, d.doc, labels=list(d.labels))
            for key, value in sorted(d.read().items()):
                fam.add_metric(list(key), value)
            yield fam


def build_versions() -> dict[str, str]:
    """quiverd's, Python's and pyarrow's versions (``quiver_build_info``, ``/livez``)."""
    try:
        pyarrow = metadata.version("pyarrow")
    except metadata.PackageNotFoundError:
        pyarrow = "none"
    return {"version": __version__, "python": platform.python_version(), "pyarrow": pyarrow}


class WalMetrics:
    """The WAL writer's values for one shard."""

    def __init__(self, m: Metrics, shard: int) -> None:
        self.appends = m.wal_appends.labels(shard)
        self.bytes_written = m.wal_written_bytes.labels(shard)
        self.fsyncs = m.wal_fsyncs.labels(shard)
        self.acks = m.bundles_acked.labels(shard)
        self.acked_bytes = m.bytes_acked.labels(shard)
        self.inflight = m.wal_inflight.labels(shard)
        self.last_sequence = m.wal_last_sequence.labels(shard)
        self.capacity_waits = m.wal_capacity_waits.labels(shard)
        self.rejected = m.ingest_rejected.labels(shard)
        self.resends = m.ingest_resends.labels(shard)
        self.throttled = m.ingest_throttle.labels(shard)
        self.disk_full = m.wal_disk_full.labels(shard)
        self.no_space = m.disk_full.labels(shard, "wal")
        self.sidecar_no_space = m.disk_full.labels(shard, "sidecar")
        self.ack_latency = m.ack_latency.labels(shard)
        self.fdatasync_latency = m.fdatasync_latency.labels(shard)


class SegmentMetrics:
    """The segment builder's and finalizer's values for one shard."""

    def __init__(self, m: Metrics, shard: int) -> None:
        self._m, self._shard = m, shard
        self.open_bundles = m.open_bundles.labels(shard)
        self.open_min_ts_ns = 0  # the open segment's oldest ingestion time (0: empty)
        self.open_bytes = m.open_bytes.labels(shard)
        self.open_streams = m.open_streams.labels(shard)
        self.finalized = m.segments_finalized.labels(shard)
        self.finalized_bytes = m.segment_finalized_bytes.labels(shard)
        self.write_failures = m.segment_write_failures.labels(shard)
        self.no_space = m.disk_full.labels(shard, "segment")

    def sealed(self, reason: str) -> Value:
        return self._m.segments_sealed.labels(self._shard, reason)


class AckLogMetrics:
    """The ack logger's values for one shard."""

    def __init__(self, m: Metrics, shard: int) -> None:
        self.records = m.ack_log_records.labels(shard)
        self.fsyncs = m.ack_log_fsyncs.labels(shard)
        self.compactions = m.ack_log_compactions.labels(shard)
        self.log_bytes = m.ack_log_bytes.labels(shard)
        self.no_space = m.disk_full.labels(shard, "acklog")


class DispatchMetrics:
    """The dispatcher's values for one shard (per subscriber where it says)."""

    def __init__(self, m: Metrics, shard: int) -> None:
        self._m, self._shard = m, shard
        self.sessions = m.sessions.labels(shard)

    def delivered(self, subscriber: str) -> Value:
        return self._m.delivered.labels(self._shard, subscriber)

    def redelivered(self, subscriber: str) -> Value:
        return self._m.redelivered.labels(self._shard, subscriber)

    def acks(self, subscriber: str) -> Value:
        return self._m.subscriber_acks.labels(self._shard, subscriber)

    def nacks(self, subscriber: str) -> Value:
        return self._m.subscriber_nacks.labels(self._shard, subscriber)

    def rejects(self, subscriber: str) -> Value:
        return self._m.subscriber_rejects.labels(self._shard, subscriber)

    def discarded(self, subscriber: str) -> Value:
        return self._m.staged_discarded.labels(subscriber)

    def dropped_count(self, subscriber: str) -> int:
        """Bundles retention dropped for ``subscriber`` here (the gc sweeper counts them);
        read by ranged reads' loss reports, without adding a series."""
        found = self._m.subscriber_dropped.values.get((str(self._shard), subscriber))
        return 0 if found is None else int(found.value)


class GcMetrics:
    """The gc sweeper's values for one shard."""

    def __init__(self, m: Metrics, shard: int) -> None:
        self._m, self._shard = m, shard
        self.segments_dropped = m.segments_dropped.labels(shard)
        self.sweeps = m.gc_sweeps.labels(shard)
        self.delete_batches = m.gc_delete_batches.labels(shard)
        for reason in ("acked", "max_age", "size_cap"):
            self.evictions(reason)  # exported as 0 from the start, not only once it happens
        self.lost_bytes = {"max_age": m.lost_bytes.labels(shard, "expired"),
                           "size_cap": m.lost_bytes.labels(shard, "drop_oldest")}

    def evictions(self, reason: str) -> Value:
        return self._m.gc_evictions.labels(self._shard, reason)

    def dropped_bundles(self, subscriber: str) -> Value:
        return self._m.subscriber_dropped.labels(self._shard, subscriber)


class ScrubMetrics:
    """The scrubber's values for one shard."""

    def __init__(self, m: Metrics, shard: int) -> None:
        self._m, self._shard = m, shard
        self.bytes = m.scrub_bytes.labels(shard)
        self.segments = m.scrub_segments.labels(shard)
        self.passes = m.scrub_passes.labels(shard)
        self.bundles_lost = m.bundles_lost.labels(shard)
        self.lost_bytes = m.lost_bytes.labels(shard, "corrupt")
        for found_by in ("read", "scrub"):
            self.corrupt(found_by)  # exported as 0 from the start

    def corrupt(self, found_by: str) -> Value:
        return self._m.segments_corrupt.labels(self._shard, found_by)


class IngestMetrics:
    """The ingest listener's values (one set for the daemon)."""

    def __init__(self, m: Metrics) -> None:
        self.connections = m.connections.labels()
        self.connections_total = m.connections_total.labels()
        self.bundles = m.ingest_bundles.labels()
        self.errors = m.ingest_errors.labels()
        self.unauthorized = m.ingest_unauthorized.labels()
        self.refused = m.ingest_refused.labels()
        self.timeouts = m.ingest_timeouts.labels()
        self.pending_bytes = m.pending_bytes.labels()
        self.budget_waits = m.budget_waits.labels()

    def as_dict(self) -> dict[str, int]:
        """For `status --json` (the same values /metrics exports)."""
        return {name: int(v.value) for name, v in vars(self).items()}
