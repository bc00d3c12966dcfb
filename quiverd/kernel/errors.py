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


class DurabilityLost(QuiverError):
    """fsync/fdatasync failed: the shard stops; restart lets replay recover."""

    hint = "check the disk (dmesg); systemd restarts quiverd and replay recovers what was durable"
