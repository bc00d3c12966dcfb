"""The object store: any OpenDAL service, with bounded concurrency, timeouts and retries.

``ObjectStore`` is the generic store (any scheme the table in ``quiverd.lake.store``
does not name); a subclass says what one service does differently through the hooks
below (``LocalStore`` for fs, ``S3Store`` for s3); ``open_store`` builds the class the
table names for ``cfg.scheme``. The store owns its
root: only it (or, for code holding just a StoreConfig, its class) relates a root, a
key, a URI and a location.

What an upload leaves in the store (``put_file``):

    <root>/<key>                 the sealed local file's bytes, never overwritten
        user metadata            crc32c = "%08x"  (whole-file CRC-32C, when the service
                                 keeps user metadata: s3 does, fs does in user.* xattrs
                                 where the filesystem has them, memory does not)
    <root>/.tmp/<name>.<rand>    fs only (LocalStore): OpenDAL's atomic_write_dir, renamed
                                 into place on commit, so a reader never sees half an object

Upload protocol, per attempt: open a conditional writer (``if_not_exists``), stream the
file in 8 MiB chunks read in a worker thread while computing its CRC-32C, check the local
bytes against the caller's size and CRC, commit (close), then verify: stat size, and the
CRC from the user metadata (or by reading the object back when the service keeps none).

OpenDAL has no abort: leaving ``async with op.open(key, "wb")`` on an exception commits
what was written. So the writer is closed only after every byte was sent and checked; on
failure it is dropped (S3: an incomplete multipart upload remains until a lifecycle rule
aborts it) and the key is deleted in case a commit got through (a timed-out close).
A key found taken (before the first attempt, or by a retry) is compared with the local
file: identical bytes mean an earlier commit of this file landed after all, which is
success; anything else is ObjectExists, and that object is left alone.

Failures are classified (throttled, server, timeout, connection: retried with full-jitter
backoff; denied: ``StoreDenied`` at once) and counted in ``errors_total`` for metrics.
"""

from __future__ import annotations

import builtins
import errno
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import anyio
import opendal
import opendal.exceptions as oe
from opendal.layers import TimeoutLayer

from quiverd.kernel.config import StoreConfig
from quiverd.kernel.errors import (
    ConfigError,
    ObjectExists,
    StoreDenied,
    StoreMisconfigured,
    StoreUnavailable,
    VerifyFailed,
)
from quiverd.kernel.logs import Logger
from quiverd.lake.model import ObjectInfo
from quiverd.lake.store.names import FS_TMP_DIR, StoreNames
from quiverd.lake.store.names import check_key as _check_key
from quiverd.lake.store.options import brief, classify
from quiverd.lake.store.transfer import CHUNK_BYTES, crc_of, receive, send

__all__ = ["CHUNK_BYTES", "CRC_KEY", "FS_TMP_DIR", "ObjectStore"]

T = TypeVar("T")

LIST_LIMIT = 100_000
CRC_KEY = "crc32c"  # user metadata key of the whole-file CRC-32C, 8 lowercase hex digits
PARQUET_TYPE = "application/vnd.apache.parquet"
RETRIED = frozenset({"throttled", "server", "timeout", "connection", "verify"})
KINDS = ("throttled", "server", "timeout", "connection", "denied", "verify", "exists", "missing",
         "other")


class ObjectStore(StoreNames):
    """One OpenDAL operator behind quiverd's rules; share one per process and store.
    Its names (root, uri, location, local_path, ...) are StoreNames'."""

    def __init__(self, cfg: StoreConfig, *, data_dir: Path, log: Logger) -> None:
        self.cfg = cfg
        self.log = log
        self.root = self.resolve_root(cfg, data_dir)
        self._prepare()
        options = self.service_options(cfg, self.root)
        try:
            operator = opendal.AsyncOperator(cfg.scheme, **options)
        except oe.Unsupported as exc:  # a scheme this OpenDAL build does not have
            raise ConfigError("lake.store.scheme", f"{cfg.scheme!r}: {brief(exc)}") from exc
        except oe.ConfigInvalid as exc:
            raise ConfigError("lake.store.options", brief(exc)) from exc
        self._timeout_s = cfg.timeout_ms / 1000
        # Our own timeout cancels the Python side only: the Rust future behind an OpenDAL
        # call keeps running. TimeoutLayer makes that abandoned work end too.
        self._op = operator.layer(TimeoutLayer(timeout=self._timeout_s,
                                               io_timeout=self._timeout_s))
        cap = self._op.capability()
        self.conditional_create = cap.write_with_if_not_exists
        self.keeps_user_metadata = cap.write_with_user_metadata and self._metadata_kept()
        self._content_type = cap.write_with_content_type
        self._limiter = anyio.CapacityLimiter(cfg.max_concurrency)
        self._file_limiter = anyio.CapacityLimiter(cfg.max_concurrency)
        self._rng = random.Random()
        self.in_flight = 0  # attempts holding a concurrency slot
        self.retries_total = 0
        self.errors_total: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes_uploaded_total = 0  # bytes of verified uploads
        self._options = options

    async def put_file(self, key: str, path: Path, *, size: int, crc32c: int) -> None:
        """Upload a sealed local file as a new object, then verify it (see the module doc).

        Raises ObjectExists if the key holds a different object (it is left alone),
        CorruptRecord if the local file does not match ``size``/``crc32c``, VerifyFailed
        or StoreUnavailable after the last attempt, StoreDenied at once.
        """
        _check_key(key)
        if await self._retrying("stat", key, lambda _: self._stat(key)) is not None:
            if await self._retrying("verify", key, lambda _: self._same(key, size, crc32c)):
                self.log.info("object_already_present", key=key, bytes=size)
                return
            raise self._failed("put", key, 1, "exists", None)
        started = anyio.current_time()

        async def attempt(n: int) -> None:
            try:
                await self._upload(key, path, size, crc32c)
            except oe.ConditionNotMatch:
                # Taken since the check above: by an earlier attempt whose commit landed
                # after its timeout (then it is ours), or by someone else.
                if n == 1 or not await self._same(key, size, crc32c):
                    raise
                return
            await self._verify(key, size, crc32c)

        await self._retrying("put", key, attempt, cleanup=self._discard)
        self.bytes_uploaded_total += size
        self.log.info("object_uploaded", key=key, bytes=size,
                      ms=round((anyio.current_time() - started) * 1000))

    async def get_file(self, key: str, path: Path) -> None:
        """Download to ``path`` (tmp, fsync, rename, fsync dir); FileNotFoundError if absent."""
        _check_key(key)
        await self._retrying("get", key, lambda _: self._download(key, path))

    async def read(self, key: str) -> bytes:
        """The whole object (small objects, tests); FileNotFoundError if absent."""
        _check_key(key)

        async def attempt(_: int) -> bytes:
            try:
                return await self._op.read(key)
            except oe.NotFound:
                raise _absent(self.uri(key)) from None

        return await self._retrying("read", key, attempt)

    async def read_range(self, key: str, offset: int, size: int) -> bytes:
        """``size`` bytes of the object from ``offset`` (fewer at its end); FileNotFoundError
        if absent. For the lake scrub, which reads objects at a bounded rate."""
        _check_key(key)

        async def attempt(_: int) -> bytes:
            try:
                return bytes(await self._op.read(key, offset=offset, size=size))
            except oe.NotFound:
                raise _absent(self.uri(key)) from None

        return await self._retrying("read", key, attempt)

    async def copy(self, source: str, target: str) -> None:
        """Server-side copy of ``source`` to ``target`` (overwritten if present); for the
        lake scrub's quarantine. FileNotFoundError if ``source`` is absent."""
        _check_key(source)
        _check_key(target)

        async def attempt(_: int) -> None:
            try:
                await self._op.copy(source, target)
            except oe.NotFound:
                raise _absent(self.uri(source)) from None
            await self._committed(target)

        await self._retrying("copy", target, attempt)

    async def stat(self, key: str) -> ObjectInfo | None:
        _check_key(key)
        meta = await self._retrying("stat", key, lambda _: self._stat(key))
        if meta is None:
            return None
        return ObjectInfo(key=key, size=meta.content_length,
                          last_modified_ns=_ns(meta.last_modified))

    async def delete(self, key: str, *,
                     still: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Delete ``key``; an absent key is fine. ``still``: asked before each attempt,
        False ends the delete without deleting (the reason for it is gone)."""
        _check_key(key)

        async def attempt(_: int) -> None:
            if still is None or await still():
                await self._op.delete(key)

        await self._retrying("delete", key, attempt)

    async def list(self, prefix: str = "", *, limit: int = LIST_LIMIT) -> builtins.list[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (recursive), at most ``limit`` of them."""

        async def attempt(_: int) -> builtins.list[ObjectInfo]:
            out: builtins.list[ObjectInfo] = []
            async for entry in await self._op.list(prefix, recursive=True):
                path = entry.path
                if path.endswith("/") or self._hidden(path):
                    continue
                meta = entry.metadata
                out.append(ObjectInfo(key=path, size=meta.content_length,
                                      last_modified_ns=_ns(meta.last_modified)))
                if len(out) >= limit:
                    break
            return out

        return await self._retrying("list", prefix, attempt)

    async def stale_temp_files(self, older_than_ns: int, *, remove: bool) -> builtins.list[str]:
        """Upload temp files a crash left behind, last written before ``older_than_ns``;
        removed when ``remove``. Paths returned. Only fs has any (LocalStore)."""
        return []

    async def probe(self, key: str) -> None:
        """Write, stat and delete a small object at ``key`` (``check-config --probe``):
        raises what an upload would (StoreMisconfigured for a missing bucket, StoreDenied,
        StoreUnavailable), so a bad store is found before the daemon runs."""
        _check_key(key)
        body = b"quiverd check-config --probe\n"

        async def write(_: int) -> None:
            await self._op.write(key, body)

        await self._retrying("probe", key, write)
        if await self._retrying("stat", key, lambda _: self._stat(key)) is None:
            raise StoreUnavailable(f"probe {key!r}: written, then not found")
        await self.delete(key)

    async def close(self) -> None:
        """Nothing is held between operations: OpenDAL pools connections per operator."""

    # -- hooks: what a service does differently (LocalStore) -------------------------------
    def _prepare(self) -> None:
        """Before the operator is built (LocalStore: its temp directory)."""

    def _metadata_kept(self) -> bool:
        """Does the service keep user metadata where OpenDAL says it can?"""
        return True

    def _hidden(self, key: str) -> bool:
        """Is a listed path the store's own, not an object?"""
        return False

    async def _committed(self, key: str) -> None:
        """After an object was committed (upload, copy): make it durable where needed."""

    async def _discarded(self, key: str) -> None:
        """After a failed upload's object was deleted: sweep what the writer left."""

    # -- one operation, retried -------------------------------------------------------------
    async def _retrying(self, op: str, key: str, attempt: Callable[[int], Awaitable[T]], *,
                        cleanup: Callable[[str], Awaitable[None]] | None = None) -> T:
        """Run ``attempt(n)`` until it succeeds, fails for good, or attempts run out."""
        last: Exception | None = None
        kind = "other"
        for n in range(1, self.cfg.max_attempts + 1):
            try:
                async with self._limiter:
                    self.in_flight += 1
                    try:
                        with anyio.fail_after(self._timeout_s):
                            return await attempt(n)
                    finally:
                        self.in_flight -= 1
            except Exception as exc:
                kind = classify(exc) or "local"
                if cleanup is not None and kind not in ("exists", "denied", "missing"):
                    await cleanup(key)
                if kind == "local":
                    raise  # the local file or our own error: retrying the store cannot help
                if kind not in RETRIED:
                    raise self._failed(op, key, n, kind, exc) from exc
                last = exc
            if n < self.cfg.max_attempts:
                self.errors_total[kind] += 1  # the last failure is counted by _failed
                ceiling_ms = min(self.cfg.retry_max_ms, self.cfg.retry_base_ms * 2 ** (n - 1))
                delay_ms = self._rng.uniform(0, ceiling_ms)  # full jitter
                self.retries_total += 1
                self.log.info("object_store_retry", op=op, key=key, attempt=n, kind=kind,
                              delay_ms=round(delay_ms), error=brief(last))
                await anyio.sleep(delay_ms / 1000)
        raise self._failed(op, key, self.cfg.max_attempts, kind, last) from last

    def _failed(self, op: str, key: str, attempt: int, kind: str,
                exc: Exception | None) -> Exception:
        """Count and log a final failure; the error to raise for it."""
        self.errors_total[kind] += 1
        self.log.warning("object_store_failed", op=op, key=key, attempt=attempt, kind=kind,
                         error=brief(exc) if exc else "key holds a different object")
        where = f"{op} {key!r}"
        if kind == "exists":
            return ObjectExists(f"{self.uri(key)} already holds a different object",
                                hint="object keys are never reused: check the catalog row "
                                     "that names this key")
        if kind == "denied":
            return StoreDenied(f"{where}: {brief(exc)}")
        if kind == "missing":
            return StoreMisconfigured(f"{where}: the bucket does not exist: {brief(exc)}",
                                      kind="missing")
        if isinstance(exc, oe.ConfigInvalid | oe.Unsupported):
            # Found at run time (the config was valid on paper): the lake is degraded and
            # retries; exiting would stop ingest for every producer.
            return StoreMisconfigured(f"lake.store: {where}: {brief(exc)}")
        if isinstance(exc, VerifyFailed):
            return exc
        if kind in RETRIED:
            return StoreUnavailable(f"{where} failed {attempt} times; last: {kind}: "
                                    f"{brief(exc)}")
        return StoreUnavailable(f"{where}: {brief(exc)}")

    # -- attempts ----------------------------------------------------------------------------
    async def _upload(self, key: str, path: Path, size: int, expected_crc: int) -> None:
        write_args: dict[str, Any] = {}
        if self.conditional_create:
            write_args["if_not_exists"] = True
        if self.keeps_user_metadata:
            write_args["user_metadata"] = {CRC_KEY: f"{expected_crc:08x}"}
        if self._content_type and key.endswith(".parquet"):
            write_args["content_type"] = PARQUET_TYPE
        await send(self._op, key, path, size=size, expected_crc=expected_crc,
                   write_args=write_args, limiter=self._file_limiter)
        await self._committed(key)

    async def _verify(self, key: str, size: int, expected_crc: int) -> None:
        meta = await self._stat(key)
        if meta is None:
            raise VerifyFailed(f"{key!r}: missing right after its upload")
        if meta.content_length != size:
            raise VerifyFailed(f"{key!r}: {meta.content_length} bytes stored, {size} sent")
        stored = (meta.user_metadata or {}).get(CRC_KEY)
        actual = stored if stored is not None else f"{await crc_of(self._op, key):08x}"
        if actual != f"{expected_crc:08x}":
            raise VerifyFailed(f"{key!r}: CRC-32C {actual} stored, {expected_crc:08x} sent")

    async def _same(self, key: str, size: int, expected_crc: int) -> bool:
        """Does ``key`` hold exactly these bytes (by size and CRC-32C)?"""
        try:
            await self._verify(key, size, expected_crc)
        except VerifyFailed:
            return False
        return True

    async def _stat(self, key: str) -> Any:
        try:
            meta = await self._op.stat(key)
        except oe.NotFound:
            return None
        return None if meta.is_dir else meta  # fs: "a" is a directory when "a/b" exists

    async def _download(self, key: str, path: Path) -> None:
        meta = await self._stat(key)
        if meta is None:
            raise _absent(self.uri(key))
        await receive(self._op, key, path, size=meta.content_length,
                      stored_crc=(meta.user_metadata or {}).get(CRC_KEY),
                      limiter=self._file_limiter)

    async def _discard(self, key: str) -> None:
        """After a failed upload attempt: delete what may have been committed (bounded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._timeout_s):
            try:
                async with self._limiter:
                    await self._op.delete(key)
                await self._discarded(key)
            except Exception as exc:
                self.log.warning("object_cleanup_failed", key=key, error=brief(exc))


def _absent(uri: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "no such object", uri)


def _ns(when: datetime | None) -> int:
    if when is None:
        return 0
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    delta = when - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000
