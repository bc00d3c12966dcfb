"""quiverd's configuration: one msgspec Struct tree decoded from TOML.

Unknown keys are rejected and every error names its key path
(``wal.flush_policy``), so a typo never silently falls back to a default.
Names carry their unit (``flush_interval_ms``, ``max_size_bytes``).
``config.toml`` at the repository root is the reference: every key, its unit,
its default and why.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from quiverd.kernel.errors import ConfigError
from quiverd.kernel.layout import DataDir
from quiverd.kernel.names import node_id_problem, subscriber_name_problem

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class IngestConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    socket_path: str = ""  # "" → <data_dir>/ingest.sock
    socket_mode: int = 0o660
    allowed_uids: list[int] = msgspec.field(default_factory=list)  # [] and [] → own uid only
    allowed_gids: list[int] = msgspec.field(default_factory=list)
    max_bundle_bytes: int = 64 * MiB
    max_inflight_per_connection: int = 16
    max_connections: int = 256
    max_connections_per_uid: int = 64  # one peer cannot take every slot
    handshake_timeout_ms: int = 5_000  # HELLO must arrive within this
    idle_timeout_ms: int = 300_000  # nothing received, nothing in flight: closed (0 = never)
    # Bytes received (or announced by a frame header) but not yet durable, across all
    # connections: a connection waits for budget before its frame buffer is allocated.
    max_pending_bytes: int = 512 * MiB
    # The most of it one peer uid may hold (0 = half of max_pending_bytes), so a peer that
    # stalls its frames cannot keep the others' bundles waiting (quiverd/net/budget.py).
    max_pending_bytes_per_uid: int = 0
    # A named producer's stream (protocol v3) idle this long is forgotten: a bundle of it
    # resent later is stored again (quiverd/kernel/producers.py).
    producer_retain_s: int = 7 * 86_400


class AdminConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    socket_path: str = ""  # "" → <data_dir>/admin.sock (always mode 0600)
    request_timeout_ms: int = 5_000  # the request line must arrive within this
    max_connections: int = 16  # beyond: refused with an error line


class WalConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    flush_policy: Literal["interval", "always", "never"] = "interval"
    flush_interval_ms: int = 25
    flush_bytes: int = 1 * MiB
    max_size_bytes: int = 1 * GiB
    max_chunks: int = 10
    max_entry_bytes: int = 72 * MiB
    at_capacity: Literal["wait", "reject"] = "wait"


class SegmentConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    target_size_bytes: int = 32 * MiB
    max_open_duration_ms: int = 1000
    max_streams: int = 256
    max_dictionary_cardinality: int = 1 << 20


class RetentionConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    size_cap_bytes: int = 0  # 0 = no cap
    size_cap_policy: Literal["backpressure", "drop_oldest"] = "backpressure"
    max_age_s: int = 0  # 0 = keep until acked
    # Retiring abandoned subscribers (quiverd.runtime.retirement): one with no live
    # consumer (no SUBSCRIBE session, no ranged reader's lease) for retire_grace_s is
    # removed, loudly, once its lag in a shard reaches retire_after_lag_bytes / shards, or
    # once it has had no consumer for retire_idle_s while lagging. None = half of
    # size_cap_bytes under backpressure, so it comes before the cap holds ingest back
    # (under drop_oldest: never, the cap drops instead; without a cap: half of what the
    # data directory's filesystem could hold at start, before the disk is full); 0 = never.
    retire_after_lag_bytes: int | None = None
    retire_grace_s: float = 60.0
    retire_idle_s: int = 7 * 86_400  # Kafka forgets an empty group's offsets after 7 days


class ScrubConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    # Background whole-file CRC checks of segments, split evenly over shards; 0 = no
    # passes (a segment recovery trusted on its metadata is still checked in full
    # before its first delivery). MB = 10**6 bytes.
    rate_mb_per_s: float = 50.0
    pass_interval_s: int = 86_400  # a pass starts this long after the previous one did


class SubscriberEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    name: str
    start: Literal["earliest", "latest"] = "earliest"


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    listen: str = ""  # "host:port" of the Prometheus /metrics endpoint; "" = off


class LogConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """[lake.store]: any OpenDAL service; ``fs`` under <data_dir>/objects by default."""

    scheme: str = "fs"  # OpenDAL service name: "fs", "s3", "gcs", "azblob", "memory", ...
    root: str = ""  # fs: "" = <data_dir>/objects; s3: prefix inside the bucket
    # Service options, all strings (bucket, region, endpoint, access_key_id, ...).
    options: dict[str, str] = msgspec.field(default_factory=dict)
    max_concurrency: int = 4  # uploads (and deletes) in flight
    max_attempts: int = 8  # per operation, first try included
    retry_base_ms: int = 100  # backoff: base * 2**n, full jitter, capped below
    retry_max_ms: int = 10_000
    timeout_ms: int = 120_000  # one attempt of one operation


class IndexConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """[lake.index]: what the built-in indexer records per file."""

    zone_map_columns: list[str] = msgspec.field(default_factory=list)  # + the time column
    bloom_filter_columns: list[str] = msgspec.field(default_factory=list)
    bloom_filter_fpp: float = 0.05


class JanitorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    interval_s: int = 3600  # 0 = only `quiverd janitor`
    grace_s: int = 86_400  # an object without a row is an orphan only when older than this


class LakeScrubConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    # Background passes reading this node's registered lake objects back through the store
    # and checking size and whole-file CRC-32C against the catalog; a damaged object is
    # quarantined (quiverd.lake.scrub) and leaves the Iceberg tables, whose readers do not
    # check page checksums: every object is read once every max(pass_interval_s, lake
    # bytes / rate), which bounds how long they can be served a damaged one (docs/iceberg.md).
    # 0 = no passes. MB = 10**6 bytes. 20 MB/s costs ~4 % of a core (fs store, measured).
    rate_mb_per_s: float = 20.0
    pass_interval_s: int = 3_600  # a pass starts this long after the previous one did


class CompactionConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    interval_s: int = 60  # 0 = only `quiverd compact`
    min_files: int = 4  # fewer small files than this: nothing to do
    max_files: int = 256  # per task (1 s files: 32 merged ~6 MiB at 1 MB/s)
    small_file_bytes: int = 32 * MiB  # files below this are candidates
    parallelism: int = 1  # tasks at once
    memory_limit_bytes: int = 512 * MiB  # Arrow bytes one task may hold
    delete_grace_s: int = 600  # replaced objects stay this long for readers in flight


class IcebergConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """[lake.iceberg]: every (client, slot) an Iceberg table (quiverd.lake.iceberg)."""

    enabled: bool = True
    # Kept this long after they stopped being current. 600 (was 3600): at one commit a
    # second a table keeps ~600 snapshots; at 3600 a commit rewrote ~3600 entries.
    keep_snapshots_s: float = 600.0
    reconcile_interval_s: float = 60.0  # the reconciler's timer
    commit_retries: int = 10  # compare-and-swap retries of one commit
    linger_ms: int = 200  # how long the projector gathers registrations into one snapshot


class LakeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """[lake]: the uploader (finalized bundles -> Parquet -> object store -> catalog)."""

    enabled: bool = True
    node_id: str = ""  # "" = the host name; part of every object key
    time_column: str = ""  # "" = _quiver_ingested_at (the bundle's ingestion time)
    # What an incompatible schema change of a (client, slot) does (lake.drift.unify
    # decides what is compatible): "evolve" accepts it and starts a new lake file;
    # "strict" refuses the bundle at ingest (SCHEMA_CONFLICT), see quiverd/net/established.py.
    schema_mode: Literal["evolve", "strict"] = "evolve"
    compression_level: int = 3  # zstd
    row_group_bytes: int = 64 * MiB  # Arrow bytes buffered per file before a row group
    file_size_bytes: int = 128 * MiB  # rotate Active -> Stable at this Parquet size
    # ... or this long after the file's first bundle: 1 s keeps every acked bundle within
    # seconds of a committed snapshot (issue 29); compaction merges the small files.
    file_duration_ms: int = 1_000
    max_buffer_bytes: int = 256 * MiB  # Arrow bytes buffered across all files
    window_bundles: int = 4096  # bundles held unacked; reaching it rotates the oldest file
    parallelism: int = 2  # Parquet encoders at once (threads; zstd releases the GIL)
    delete_after_upload: bool = True  # evict the local copy once registered and indexed
    local_retention_s: int = 0  # when not deleting right away: keep local copies this long
    # A bundle no Parquet file can take is set aside (quiverd/lake/dead_letters.py) and
    # rejected after this many failed attempts (0 = never: it is retried for ever).
    dead_letter_after: int = 3
    # A Spark job's rows become Parquet while its tasks still write (files per attempt,
    # published only once the job commits them): save() then waits for the last file.
    convert_staged: bool = True
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    janitor: JanitorConfig = msgspec.field(default_factory=JanitorConfig)
    compaction: CompactionConfig = msgspec.field(default_factory=CompactionConfig)
    scrub: LakeScrubConfig = msgspec.field(default_factory=LakeScrubConfig)
    iceberg: IcebergConfig = msgspec.field(default_factory=IcebergConfig)


class CatalogConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """[catalog]: PostgreSQL when ``dsn`` is set, else SQLite in <data_dir>/catalog.sqlite."""

    dsn: str = ""  # postgresql://user@host:port/db (libpq URI); "" = embedded
    connect_timeout_ms: int = 5_000
    pool_size: int = 4


MAX_WRITER_TIMEOUT_S = 900  # a dead writer's job holds its shard's streams at most this long


class StagingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """[staging]: transactional writes (Spark) held until their job is decided (SPEC §7)."""

    ttl_s: int = 86_400  # a job neither committed nor aborted this long after its writer's
    #                      last bundle or keepalive is discarded ("expired") and counted,
    #                      even with a connection open (a writer stuck for a day)
    # A job with no live writer connection on any daemon is expired this long after the
    # last one closed (or after the daemon started); a connected writer never expires.
    writer_timeout_s: int = 120
    poll_interval_ms: int = 1_000  # how often undecided jobs are looked up in the catalog
    decision_retention_s: int = 7 * 86_400  # decisions older than this are pruned


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    data_dir: str = "/var/lib/quiverd"
    shards: int = 0  # 0 → number of cores
    shutdown_timeout_ms: int = 10_000
    ingest: IngestConfig = msgspec.field(default_factory=IngestConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    wal: WalConfig = msgspec.field(default_factory=WalConfig)
    segment: SegmentConfig = msgspec.field(default_factory=SegmentConfig)
    retention: RetentionConfig = msgspec.field(default_factory=RetentionConfig)
    scrub: ScrubConfig = msgspec.field(default_factory=ScrubConfig)
    subscribers: list[SubscriberEntry] = msgspec.field(default_factory=list)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    lake: LakeConfig = msgspec.field(default_factory=LakeConfig)
    catalog: CatalogConfig = msgspec.field(default_factory=CatalogConfig)
    staging: StagingConfig = msgspec.field(default_factory=StagingConfig)

    @property
    def retire_lag_bytes(self) -> int | None:
        """The daemon-wide lag that retires a subscriber without a consumer (0: never;
        None: no cap and none set, half of what the filesystem could hold)."""
        r = self.retention
        if r.retire_after_lag_bytes is not None:
            return r.retire_after_lag_bytes
        if not r.size_cap_bytes:
            return None
        return r.size_cap_bytes // 2 if r.size_cap_policy == "backpressure" else 0

    @property
    def shard_count(self) -> int:
        return self.shards or (os.cpu_count() or 1)

    @property
    def ingest_socket(self) -> Path:
        return Path(self.ingest.socket_path or DataDir(Path(self.data_dir)).ingest_socket)

    @property
    def admin_socket(self) -> Path:
        return Path(self.admin.socket_path or DataDir(Path(self.data_dir)).admin_socket)


def load(path: str | os.PathLike[str]) -> Config:
    """Read, decode and validate a TOML config file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError("", f"cannot read config {path}: {exc.strerror}",
                          hint="pass --config with the path of a readable config file; the "
                          "config.toml in the source tree documents every key") from exc
    return loads(raw.decode("utf-8", errors="replace"), source=str(path))


def loads(text: str, *, source: str = "<string>") -> Config:
    """Decode and validate TOML text; errors name the key path."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{source} is not valid TOML: {exc}") from exc
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise _from_validation(exc) from exc
    validate(cfg)
    return cfg


def _from_validation(exc: msgspec.ValidationError) -> ConfigError:
    # msgspec says "... - at `$.wal.flush_policy`"; turn that into a key path.
    text = str(exc)
    match = re.search(r" - at `\$\.?(.*)`$", text)
    path = match.group(1) if match else ""
    message = text[: match.start()] if match else text
    unknown = re.match(r"Object contains unknown field `(.+)`", message)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        section = _struct_at(path.rsplit(".", 1)[0]) if "." in path else Config
        keys = sorted(section.__struct_fields__) if section is not None else []
        message = f"unknown key (allowed here: {', '.join(keys)})"
    elif (allowed := _allowed_values(path)) is not None:
        message = f"{message}; allowed values: {', '.join(repr(v) for v in allowed)}"
    return ConfigError(path, message)


def _struct_at(path: str) -> type[msgspec.Struct] | None:
    """The config Struct type at a dotted key path (``wal``), or None."""
    node: Any = Config
    for part in filter(None, path.split(".")):
        hints = typing.get_type_hints(node) if isinstance(node, type) else {}
        node = hints.get(part)
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return None
    return node


def _allowed_values(path: str) -> tuple[object, ...] | None:
    """The values a Literal-typed key accepts (``wal.flush_policy``), or None."""
    if "." not in path and path not in Config.__struct_fields__:
        return None
    parent, _, key = path.rpartition(".")
    struct = _struct_at(parent)
    if struct is None:
        return None
    hint = typing.get_type_hints(struct).get(key)
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return None


def validate(cfg: Config) -> None:
    """Check the relations no type can express; raise ConfigError naming the key."""
    checks: list[tuple[bool, str, str]] = [
        (cfg.data_dir != "", "data_dir", "must not be empty"),
        (os.path.isabs(cfg.data_dir), "data_dir",
         f"must be an absolute path, not {cfg.data_dir!r} (a relative path would depend on "
         "the directory quiverd happens to start in)"),
        (0 <= cfg.shards <= 256, "shards", "must be between 0 (= cores) and 256"),
        (cfg.shutdown_timeout_ms > 0, "shutdown_timeout_ms", "must be > 0"),
        (cfg.admin.request_timeout_ms >= 1, "admin.request_timeout_ms", "must be >= 1"),
        (cfg.admin.max_connections >= 1, "admin.max_connections", "must be >= 1"),
        (0 <= cfg.ingest.socket_mode <= 0o777, "ingest.socket_mode", "must be a file mode"),
        (cfg.ingest.max_bundle_bytes >= 1 * KiB, "ingest.max_bundle_bytes", "must be >= 1024"),
        (1 <= cfg.ingest.max_inflight_per_connection <= 4096,
         "ingest.max_inflight_per_connection", "must be between 1 and 4096"),
        (cfg.ingest.max_connections >= 1, "ingest.max_connections", "must be >= 1"),
        (cfg.ingest.producer_retain_s >= 60, "ingest.producer_retain_s",
         "must be >= 60 (seconds a named producer's idle stream is remembered)"),
        (1 <= cfg.ingest.max_connections_per_uid <= cfg.ingest.max_connections,
         "ingest.max_connections_per_uid", "must be between 1 and ingest.max_connections"),
        (cfg.ingest.handshake_timeout_ms >= 1, "ingest.handshake_timeout_ms", "must be >= 1"),
        (cfg.ingest.idle_timeout_ms >= 0, "ingest.idle_timeout_ms", "must be >= 0 (0 = never)"),
        (cfg.ingest.max_pending_bytes >= cfg.ingest.max_bundle_bytes,
         "ingest.max_pending_bytes", "must be >= ingest.max_bundle_bytes"),
        (cfg.ingest.max_pending_bytes_per_uid == 0 or cfg.ingest.max_bundle_bytes
         <= cfg.ingest.max_pending_bytes_per_uid <= cfg.ingest.max_pending_bytes,
         "ingest.max_pending_bytes_per_uid", "must be 0 (half of max_pending_bytes) or "
         "between ingest.max_bundle_bytes and ingest.max_pending_bytes"),
        (1 <= cfg.wal.flush_interval_ms <= 10_000, "wal.flush_interval_ms",
         "must be between 1 and 10000"),
        (cfg.wal.flush_bytes >= 0, "wal.flush_bytes", "must be >= 0 (0 = timer only)"),
        (2 <= cfg.wal.max_chunks <= 1000, "wal.max_chunks", "must be between 2 and 1000"),
        (cfg.wal.max_entry_bytes >= cfg.ingest.max_bundle_bytes + 64 * KiB,
         "wal.max_entry_bytes", "must exceed ingest.max_bundle_bytes by at least 64 KiB"),
        (cfg.wal.max_size_bytes >= cfg.wal.max_chunks * cfg.wal.max_entry_bytes // 4,
         "wal.max_size_bytes", "too small: must hold max_chunks/4 entries of max_entry_bytes"),
        (cfg.segment.target_size_bytes >= 64 * KiB, "segment.target_size_bytes",
         "must be >= 65536"),
        (cfg.segment.max_open_duration_ms >= 1, "segment.max_open_duration_ms", "must be >= 1"),
        (cfg.segment.max_streams >= 1, "segment.max_streams", "must be >= 1"),
        (cfg.segment.max_dictionary_cardinality >= 1, "segment.max_dictionary_cardinality",
         "must be >= 1"),
        (cfg.retention.size_cap_bytes >= 0, "retention.size_cap_bytes", "must be >= 0"),
        (cfg.retention.max_age_s >= 0, "retention.max_age_s", "must be >= 0"),
        ((cfg.retention.retire_after_lag_bytes or 0) >= 0, "retention.retire_after_lag_bytes",
         "must be >= 0 (0 = never retire for lag)"),
        (cfg.retention.retire_grace_s >= 0, "retention.retire_grace_s", "must be >= 0"),
        (cfg.retention.retire_idle_s >= 0, "retention.retire_idle_s",
         "must be >= 0 (0 = never retire for idleness)"),
        (0 <= cfg.scrub.rate_mb_per_s <= 100_000, "scrub.rate_mb_per_s",
         "must be between 0 (no background passes) and 100000"),
        (cfg.scrub.pass_interval_s >= 0, "scrub.pass_interval_s", "must be >= 0"),
        (cfg.staging.ttl_s >= 1, "staging.ttl_s", "must be >= 1"),
        (1 <= cfg.staging.writer_timeout_s <= MAX_WRITER_TIMEOUT_S, "staging.writer_timeout_s",
         f"must be 1..{MAX_WRITER_TIMEOUT_S} (seconds; Kafka's transactions allow 15 minutes)"),
        (cfg.staging.poll_interval_ms >= 10, "staging.poll_interval_ms", "must be >= 10"),
        (cfg.staging.decision_retention_s >= cfg.staging.ttl_s,
         "staging.decision_retention_s", "must be >= staging.ttl_s"),
    ]
    checks += _lake_checks(cfg)
    if cfg.metrics.listen:
        parse_listen(cfg.metrics.listen)
    for ok, path, message in checks:
        if not ok:
            raise ConfigError(path, message)
    for sock_key, sock in (("ingest.socket_path", cfg.ingest_socket),
                           ("admin.socket_path", cfg.admin_socket)):
        if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
            raise ConfigError(sock_key, f"{sock} is longer than {MAX_SOCKET_PATH} bytes "
                              "(the Unix socket limit); choose a shorter path")
    if cfg.ingest_socket == cfg.admin_socket:
        raise ConfigError("admin.socket_path", "must differ from ingest.socket_path")
    seen: set[str] = set()
    for i, sub in enumerate(cfg.subscribers):
        if (problem := subscriber_name_problem(sub.name)) is not None:
            raise ConfigError(f"subscribers[{i}].name", problem)
        if sub.name in seen:
            raise ConfigError(f"subscribers[{i}].name", f"{sub.name!r} is listed twice")
        seen.add(sub.name)


def _lake_checks(cfg: Config) -> list[tuple[bool, str, str]]:
    lake, store, comp = cfg.lake, cfg.lake.store, cfg.lake.compaction
    dsn = cfg.catalog.dsn
    return [
        (not lake.node_id or node_id_problem(lake.node_id) is None, "lake.node_id",
         node_id_problem(lake.node_id) or ""),
        (1 <= lake.compression_level <= 22, "lake.compression_level", "must be 1..22 (zstd)"),
        (lake.row_group_bytes >= 64 * KiB, "lake.row_group_bytes", "must be >= 65536"),
        (lake.file_size_bytes >= 64 * KiB, "lake.file_size_bytes", "must be >= 65536"),
        (lake.file_duration_ms >= 10, "lake.file_duration_ms", "must be >= 10"),
        (lake.max_buffer_bytes >= lake.row_group_bytes, "lake.max_buffer_bytes",
         "must be >= lake.row_group_bytes"),
        (16 <= lake.window_bundles <= 65536, "lake.window_bundles", "must be 16..65536"),
        (1 <= lake.parallelism <= 64, "lake.parallelism", "must be 1..64"),
        (lake.local_retention_s >= 0, "lake.local_retention_s", "must be >= 0"),
        (store.scheme.isidentifier(), "lake.store.scheme",
         f"{store.scheme!r} is not an OpenDAL service name (fs, s3, gcs, azblob, ...)"),
        (1 <= store.max_concurrency <= 256, "lake.store.max_concurrency", "must be 1..256"),
        (1 <= store.max_attempts <= 100, "lake.store.max_attempts", "must be 1..100"),
        (1 <= store.retry_base_ms <= store.retry_max_ms, "lake.store.retry_base_ms",
         "must be >= 1 and <= lake.store.retry_max_ms"),
        (store.timeout_ms >= 100, "lake.store.timeout_ms", "must be >= 100"),
        (0 < lake.index.bloom_filter_fpp < 1, "lake.index.bloom_filter_fpp",
         "must be between 0 and 1"),
        (lake.janitor.interval_s >= 0, "lake.janitor.interval_s", "must be >= 0 (0 = off)"),
        (lake.janitor.grace_s >= 0, "lake.janitor.grace_s", "must be >= 0"),
        (0 <= lake.scrub.rate_mb_per_s <= 100_000, "lake.scrub.rate_mb_per_s",
         "must be 0..100000 (0 = off)"),
        (lake.scrub.pass_interval_s >= 0, "lake.scrub.pass_interval_s", "must be >= 0"),
        (comp.interval_s >= 0, "lake.compaction.interval_s", "must be >= 0 (0 = off)"),
        (lake.dead_letter_after >= 0, "lake.dead_letter_after", "must be >= 0 (0 = never)"),
        (2 <= comp.min_files <= comp.max_files, "lake.compaction.min_files",
         "must be >= 2 and <= lake.compaction.max_files"),
        (1 <= comp.parallelism <= 64, "lake.compaction.parallelism", "must be 1..64"),
        (comp.memory_limit_bytes >= 1 * MiB, "lake.compaction.memory_limit_bytes",
         "must be >= 1048576"),
        (comp.delete_grace_s >= 0, "lake.compaction.delete_grace_s", "must be >= 0"),
        (lake.iceberg.keep_snapshots_s > 0, "lake.iceberg.keep_snapshots_s", "must be > 0"),
        (lake.iceberg.reconcile_interval_s > 0, "lake.iceberg.reconcile_interval_s",
         "must be > 0"),
        (0 <= lake.iceberg.commit_retries <= 1000, "lake.iceberg.commit_retries",
         "must be 0..1000"),
        (0 <= lake.iceberg.linger_ms <= 60_000, "lake.iceberg.linger_ms", "must be 0..60000"),
        (not dsn or dsn.startswith(("postgresql://", "postgres://")), "catalog.dsn",
         "must be a PostgreSQL URI (postgresql://user@host:5432/db) or \"\" (embedded)"),
        (cfg.catalog.connect_timeout_ms >= 1, "catalog.connect_timeout_ms", "must be >= 1"),
        (1 <= cfg.catalog.pool_size <= 100, "catalog.pool_size", "must be 1..100"),
    ]


def parse_listen(listen: str) -> tuple[str, int]:
    """``[metrics] listen``: ``"127.0.0.1:9464"`` -> (host, port); ``"[::1]:9464"`` for IPv6."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError("metrics.listen", f"{listen!r} is not host:port, e.g. "
                          "\"127.0.0.1:9464\" (\"\" turns the endpoint off)")
    return host.strip("[]"), int(port)
