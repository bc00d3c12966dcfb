"""quiverd's error types, named for what the caller must do.

Each error carries ``retryable`` (may the same request succeed later?) and a
``hint`` the CLI prints under the message. Branch on the type, never on text.
"""

from __future__ import annotations


class QuiverError(Exception):
    """Base of every error quiverd raises on purpose."""

    retryable: bool = False
    hint: str = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class ConfigError(QuiverError):
    """The configuration is wrong; ``path`` names the key (``wal.flush_policy``)."""

    hint = "fix the named key in the config file; `quiverd check-config PATH` re-checks it"

    def __init__(self, path: str, message: str, *, hint: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message, hint=hint)


class CorruptRecord(QuiverError):
    """Bytes on disk failed validation at ``path`` + ``offset``."""

    hint = ("run `quiverd fsck DATA_DIR` to see every damaged file; "
            "bytes cut are kept in quarantine/")

    def __init__(self, path: str, offset: int, message: str, *, hint: str | None = None) -> None:
        self.path = path
        self.offset = offset
        super().__init__(f"{path} at offset {offset}: {message}", hint=hint)


class FormatMismatch(CorruptRecord):
    """A file is well formed but not one this build may read (version, cfg hash)."""

    hint = (
        "drain this data directory with the quiverd build that wrote it, "
        "or move the file aside; quiverd will not guess"
    )


class AtCapacity(QuiverError):
    """A bound was reached (WAL size, retention cap); retry later."""

    retryable = True
    hint = "producers should retry with backoff; raise the cap or let consumers catch up"


class NoSpace(QuiverError):
    """A write found no space (ENOSPC, EDQUOT) and was cut back: nothing of it is in the
    file, so the same write may be tried again once space returns (an fsync failure is
    never this: it stays fatal)."""

    retryable = True
    hint = "free space on the data directory's filesystem; the write is retried"


class ShuttingDown(QuiverError):
    """The daemon is stopping; retry against the restarted daemon."""

    retryable = True
    hint = "retry once the daemon is back"


class ProtocolError(QuiverError):
    """A peer broke the wire protocol; ``code`` is the stable error code."""

    def __init__(self, code: int, message: str, *, hint: str | None = None) -> None:
        self.code = code
        super().__init__(message, hint=hint)


class Unauthorized(QuiverError):
    """The peer's uid/gid is not in the allowlist."""

    hint = "add the producer's uid or gid to ingest.allowed_uids / allowed_gids"


class AlreadyRunning(QuiverError):
    """Another quiverd holds the data directory's LOCK."""

    hint = "stop the other instance (systemctl stop quiverd) or use another data_dir"


class NotArrowData(QuiverError, ValueError):
    """A file given to send is neither Arrow IPC (file or stream) nor Parquet."""

    hint = "pass Arrow IPC (file or stream format) or Parquet files"


class DaemonUnreachable(QuiverError):
    """No quiverd answers on a socket path (missing, refused, not permitted)."""

    retryable = True
    hint = ("is quiverd running (`systemctl status quiverd`)? The producer socket is "
            "ingest.socket_path, by default <data_dir>/ingest.sock")

    @classmethod
    def from_os_error(cls, path: object, exc: OSError, *, what: str = "quiverd socket",
                      hint: str | None = None) -> DaemonUnreachable:
        if isinstance(exc, FileNotFoundError):
            return cls(f"no {what} at {path}", hint=hint)
        if isinstance(exc, ConnectionRefusedError):
            return cls(f"nothing listens on {path}: the socket file is left from a daemon "
                       "that is no longer running", hint=hint)
        if isinstance(exc, PermissionError):
            return cls(f"permission denied on {path}",
                       hint="the socket is mode ingest.socket_mode (0660): run as the daemon's "
                       "user or group, and list your uid/gid in ingest.allowed_uids/gids")
        return cls(f"cannot connect to {path}: {exc.strerror or exc}", hint=hint)


class DurabilityLost(QuiverError):
    """fsync/fdatasync failed: the shard stops; restart lets replay recover."""

    hint = "check the disk (dmesg); systemd restarts quiverd and replay recovers what was durable"


class LakeError(QuiverError):
    """Base of the storage tier's errors (object store, catalog)."""


class StoreUnavailable(LakeError):
    """The object store failed after every retry (throttling, 5xx, timeouts, resets)."""

    retryable = True
    hint = ("the uploader keeps the local files and retries; check the store's endpoint "
            "and health (lake.store)")


class StoreDenied(LakeError):
    """The object store refused our credentials or permissions: retrying cannot help."""

    hint = ("fix lake.store credentials / bucket policy; local Parquet files are kept and "
            "uploaded once access works")


class StoreMisconfigured(LakeError):
    """The object store rejects the configuration at run time (a missing bucket, an
    unsupported option): the lake is degraded and retries; the daemon never exits."""

    retryable = True
    hint = ("fix lake.store (bucket name, endpoint, region) or create the bucket; the "
            "uploader retries and the segments keep the data meanwhile; "
            "`quiverd check-config --probe` checks the store")

    def __init__(self, message: str, *, kind: str = "config", hint: str | None = None) -> None:
        self.kind = kind  # "missing" (no such bucket) or "config"
        super().__init__(message, hint=hint)


class ObjectExists(LakeError):
    """A conditional create found the key taken: an object is never overwritten."""


class VerifyFailed(LakeError):
    """An uploaded object's size or CRC-32C differs from the local file (it was deleted)."""

    retryable = True
    hint = "the upload is retried from the local file"


class CatalogUnavailable(LakeError):
    """The catalog database cannot be reached or failed a statement; retry later."""

    retryable = True
    hint = ("check catalog.dsn and that the database is up; the uploader retries and the "
            "WAL and segments keep the data meanwhile")


class JobConflict(QuiverError):
    """A commit or abort contradicts the decision already recorded for the job."""

    hint = ("a job is decided once (first writer wins): a committed job cannot be "
            "aborted, an aborted or expired one cannot be committed; write it again "
            "under a new job id")


class SchemaConflict(QuiverError):
    """lake.schema_mode = "strict": a bundle's column has a type its (client, slot)'s
    established schema cannot take; nothing of the bundle was stored."""

    hint = ("send the column with its established type (or rename it), or write the new "
            "shape under another client or slot; lake.schema_mode = \"evolve\" accepts it "
            "and starts a new lake file instead")


class LakeFileCorrupt(LakeError):
    """A lake file's bytes are not what was written: a Parquet page checksum, the
    file's structure, or its whole-object size or CRC-32C against the catalog."""

    hint = ("the lake scrub quarantines such a file (lake.scrub) and `quiverd fsck "
            "DATA_DIR --lake` lists every damaged object; `quiverd files restore FILE_ID "
            "--from PATH` puts a backup back (checked against the catalog's size and "
            "CRC-32C), or re-ingest its rows (segments may still hold them) and `quiverd "
            "files forget FILE_ID` records the file as lost")


class LakeFileMissing(LakeError):
    """The catalog names a lake file whose object the store does not have."""

    hint = ("put the object back with `quiverd files restore FILE_ID --from PATH` (a backup, "
            "checked against the catalog's size and CRC-32C); `quiverd fsck DATA_DIR --lake` "
            "and `quiverd files list` show every missing one; if a compaction replaced it "
            "while the query ran, run the query again")


class IcebergCommitFailed(LakeError):
    """An Iceberg commit lost the compare-and-swap to other writers after every retry
    (lake.iceberg.commit_retries), or the Iceberg catalog refused it: nothing of it landed."""

    retryable = True
    hint = ("quiverd's catalog still holds the files: the Iceberg reconciler adds them on its "
            "next pass (lake.iceberg.reconcile_interval_s); many daemons committing to one "
            "table at once may need a larger lake.iceberg.commit_retries")
