"""The object store: any OpenDAL service, with bounded concurrency, timeouts and retries.

What an upload leaves in the store (``put_file``):

    <root>/<key>                 the sealed local file's bytes, never overwritten
        user metadata            crc32c = "%08x"  (whole-file CRC-32C, when the service
                                 keeps user metadata: s3 does, fs does in user.* xattrs
                                 where the filesystem has them, memory does not)
    <root>/.tmp/<name>.<rand>    fs only: OpenDAL's atomic_write_dir, renamed into place
                                 on commit, so a reader never sees half an object

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
import glob
import os
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import anyio
import opendal
import opendal.exceptions as oe
from opendal.layers import TimeoutLayer

from quiverd.kernel.config import MiB, StoreConfig
from quiverd.kernel.crc import crc32c
from quiverd.kernel.durable import fsync_dir, write_all
from quiverd.kernel.errors import (
    ConfigError,
    CorruptRecord,
    ObjectExists,
    StoreDenied,
    StoreMisconfigured,
    StoreUnavailable,
    VerifyFailed,
)
from quiverd.kernel.layout import DataDir, tmp_path
from quiverd.kernel.logs import Logger
from quiverd.lake.model import ObjectInfo
from quiverd.lake.store_options import FS_TMP_DIR, brief, classify, service_options

T = TypeVar("T")

CHUNK_BYTES = 8 * MiB  # one file read, one writer.write, one S3 part (>= the 5 MiB minimum)
LIST_LIMIT = 100_000
CRC_KEY = "crc32c"  # user metadata key of the whole-file CRC-32C, 8 lowercase hex digits
PARQUET_TYPE = "application/vnd.apache.parquet"
RETRIED = frozenset({"throttled", "server", "timeout", "connection", "verify"})
KINDS = ("throttled", "server", "timeout", "connection", "denied", "verify", "exists", "missing",
         "other")


class ObjectStore:
    """One OpenDAL operator behind quiverd's rules; share one per process and store."""

    def __init__(self, cfg: StoreConfig, *, data_dir: Path, log: Logger) -> None:
        self.cfg = cfg
        self.log = log
        self.root = cfg.root or (str(DataDir(data_dir).objects) if cfg.scheme == "fs" else "")
        if cfg.scheme == "fs":
            self.root = str(Path(self.root).absolute())
            Path(self.root, FS_TMP_DIR).mkdir(parents=True, exist_ok=True)
        options = service_options(cfg, self.root)
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
        # fs keeps user metadata in xattrs, which not every filesystem has (NFS, old tmpfs).
        self.keeps_user_metadata = cap.write_with_user_metadata and (
            cfg.scheme != "fs" or _has_user_xattrs(Path(self.root, FS_TMP_DIR)))
        self._content_type = cap.write_with_content_type
        self._limiter = anyio.CapacityLimiter(cfg.max_concurrency)
        self._file_limiter = anyio.CapacityLimiter(cfg.max_concurrency)
        self._rng = random.Random()
        self.in_flight = 0  # attempts holding a concurrency slot
        self.retries_total = 0
        self.errors_total: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.bytes_uploaded_total = 0  # bytes of verified uploads
        bucket = options.get("bucket") or options.get("container") or ""
        self._uri_prefix = "/".join(p for p in (bucket, self.root.strip("/")) if p)

    def uri(self, key: str) -> str:
        """file:///abs/objects/<key> (percent-encoded), s3://<bucket>/<root>/<key>,
        <scheme>://<root>/<key> (with the bucket or container first when there is one)."""
        if self.cfg.scheme == "fs":
            return (Path(self.root) / key).as_uri()
        return f"{self.cfg.scheme}://" + "/".join(p for p in (self._uri_prefix, key) if p)

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
            if self.cfg.scheme == "fs":
                await anyio.to_thread.run_sync(_fsync_parents, Path(self.root), target,
                                               limiter=self._file_limiter)

        await self._retrying("copy", target, attempt)

    async def stat(self, key: str) -> ObjectInfo | None:
        _check_key(key)
        meta = await self._retrying("stat", key, lambda _: self._stat(key))
        if meta is None:
            return None
        return ObjectInfo(key=key, size=meta.content_length,
                          last_modified_ns=_ns(meta.last_modified))

    async def delete(self, key: str) -> None:
        """Delete ``key``; an absent key is fine."""
        _check_key(key)
        await self._retrying("delete", key, lambda _: self._op.delete(key))

    async def list(self, prefix: str = "", *, limit: int = LIST_LIMIT) -> builtins.list[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (recursive), at most ``limit`` of them."""

        async def attempt(_: int) -> builtins.list[ObjectInfo]:
            out: builtins.list[ObjectInfo] = []
            async for entry in await self._op.list(prefix, recursive=True):
                path = entry.path
                if path.endswith("/") or (self.cfg.scheme == "fs" and _is_fs_tmp(path)):
                    continue
                meta = entry.metadata
                out.append(ObjectInfo(key=path, size=meta.content_length,
                                      last_modified_ns=_ns(meta.last_modified)))
                if len(out) >= limit:
                    break
            return out

        return await self._retrying("list", prefix, attempt)

    async def stale_temp_files(self, older_than_ns: int, *, remove: bool) -> builtins.list[str]:
        """fs only: upload temp files (OpenDAL's atomic_write_dir) a crash left behind,
        last written before ``older_than_ns``; removed when ``remove``. Paths returned."""
        if self.cfg.scheme != "fs":
            return []
        return await anyio.to_thread.run_sync(_stale_temps, Path(self.root, FS_TMP_DIR),
                                              older_than_ns, remove,
                                              limiter=self._file_limiter)

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
        kwargs: dict[str, Any] = {}
        if self.conditional_create:
            kwargs["if_not_exists"] = True
        if self.keeps_user_metadata:
            kwargs["user_metadata"] = {CRC_KEY: f"{expected_crc:08x}"}
        if self._content_type and key.endswith(".parquet"):
            kwargs["content_type"] = PARQUET_TYPE
        fd = await anyio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC,
                                            limiter=self._file_limiter)
        try:
            # Not `async with`: leaving that block on an exception would commit a partial
            # object. A writer dropped without close() commits nothing.
            writer = await self._op.open(key, "wb", **kwargs)
            sent, crc = 0, 0
            while True:
                # Read at most one byte past ``size``: a longer file is caught, not uploaded.
                want = min(CHUNK_BYTES, size + 1 - sent)
                chunk, crc = await anyio.to_thread.run_sync(
                    _read_chunk, fd, sent, want, crc, limiter=self._file_limiter)
                if not chunk:
                    break
                if sent + len(chunk) > size:
                    raise CorruptRecord(str(path), size, f"longer than the {size} bytes sealed")
                await writer.write(chunk)
                sent += len(chunk)
            if sent != size or crc != expected_crc:
                raise CorruptRecord(str(path), sent, f"local file has {sent} bytes, CRC-32C "
                                    f"{crc:08x}; sealed as {size} bytes, {expected_crc:08x}")
            await writer.close()
        finally:
            os.close(fd)  # closing a regular file does not block
        if self.cfg.scheme == "fs":
            # OpenDAL's fs backend renames the tmp file into place but never fsyncs the
            # directory: without this a power cut could lose an object already registered.
            await anyio.to_thread.run_sync(_fsync_parents, Path(self.root), key,
                                           limiter=self._file_limiter)

    async def _verify(self, key: str, size: int, expected_crc: int) -> None:
        meta = await self._stat(key)
        if meta is None:
            raise VerifyFailed(f"{key!r}: missing right after its upload")
        if meta.content_length != size:
            raise VerifyFailed(f"{key!r}: {meta.content_length} bytes stored, {size} sent")
        stored = (meta.user_metadata or {}).get(CRC_KEY)
        actual = stored if stored is not None else f"{await self._crc_of(key):08x}"
        if actual != f"{expected_crc:08x}":
            raise VerifyFailed(f"{key!r}: CRC-32C {actual} stored, {expected_crc:08x} sent")

    async def _same(self, key: str, size: int, expected_crc: int) -> bool:
        """Does ``key`` hold exactly these bytes (by size and CRC-32C)?"""
        try:
            await self._verify(key, size, expected_crc)
        except VerifyFailed:
            return False
        return True

    async def _crc_of(self, key: str) -> int:
        crc = 0
        reader = await self._op.open(key, "rb")
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                crc = crc32c(chunk, crc)  # ~0.3 ms per chunk: not worth a thread hop
        finally:
            await reader.close()
        return crc

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
        stored = (meta.user_metadata or {}).get(CRC_KEY)
        tmp = tmp_path(path)
        fd = await anyio.to_thread.run_sync(_create, tmp, limiter=self._file_limiter)
        owned = True
        try:
            got, crc = 0, 0
            reader = await self._op.open(key, "rb")
            try:
                while chunk := await reader.read(CHUNK_BYTES):
                    crc = await anyio.to_thread.run_sync(_write_chunk, fd, chunk, crc,
                                                         limiter=self._file_limiter)
                    got += len(chunk)
            finally:
                await reader.close()
            if got != meta.content_length or (stored is not None and stored != f"{crc:08x}"):
                raise VerifyFailed(f"{key!r}: read {got} bytes, CRC-32C {crc:08x}; the store "
                                   f"says {meta.content_length} bytes, {stored}")
            owned = False  # _commit_download closes it
            await anyio.to_thread.run_sync(_commit_download, fd, tmp, path,
                                           limiter=self._file_limiter)
        except BaseException:
            # Inline, not in a thread: this must run even when we are being cancelled,
            # and close + unlink of one local file do not wait on anything.
            if owned:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise

    async def _discard(self, key: str) -> None:
        """After a failed upload attempt: delete what may have been committed (bounded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(self._timeout_s):
            try:
                async with self._limiter:
                    await self._op.delete(key)
                if self.cfg.scheme == "fs":
                    await anyio.to_thread.run_sync(_sweep_fs_tmp, Path(self.root), key,
                                                   limiter=self._file_limiter)
            except Exception as exc:
                self.log.warning("object_cleanup_failed", key=key, error=brief(exc))


def _check_key(key: str) -> None:
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts) or parts[0] == FS_TMP_DIR:
        raise ValueError(f"bad object key {key!r}: relative, '/'-separated, no empty, '.' "
                         f"or '..' parts, not under {FS_TMP_DIR}/")


def _is_fs_tmp(path: str) -> bool:
    return path == FS_TMP_DIR or path.startswith(FS_TMP_DIR + "/")


def _absent(uri: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "no such object", uri)


def _ns(when: datetime | None) -> int:
    if when is None:
        return 0
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    delta = when - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000


# -- worker-thread helpers (blocking) ---------------------------------------------------------
def _read_chunk(fd: int, offset: int, n: int, crc: int) -> tuple[bytes, int]:
    chunk = os.pread(fd, n, offset)
    return chunk, crc32c(chunk, crc)


def _create(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)  # FileNotFoundError means: no object
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)


def _write_chunk(fd: int, chunk: bytes, crc: int) -> int:
    write_all(fd, [chunk])
    return crc32c(chunk, crc)


def _commit_download(fd: int, tmp: Path, path: Path) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def _fsync_parents(root: Path, key: str) -> None:
    """fsync every directory from the object's parent up to the root (new ones included)."""
    parent = PurePosixPath(key).parent
    while True:
        fsync_dir(root / parent)
        if parent == PurePosixPath("."):
            return
        parent = parent.parent


def _has_user_xattrs(directory: Path) -> bool:
    probe = directory / f"xattr-probe-{os.getpid()}"
    try:
        probe.touch()
        os.setxattr(probe, "user.quiverd-probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _sweep_fs_tmp(root: Path, key: str) -> None:
    """Remove the tmp files a dropped fs writer left (OpenDAL names them <name>.<random>)."""
    name = PurePosixPath(key).name
    for entry in (root / FS_TMP_DIR).glob(f"{glob.escape(name)}.*"):
        entry.unlink(missing_ok=True)


def _stale_temps(directory: Path, older_than_ns: int, remove: bool) -> list[str]:
    found: list[str] = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return found
    for path in entries:
        try:
            if path.is_file() and path.stat().st_mtime_ns < older_than_ns:
                if remove:
                    path.unlink()
                found.append(str(path))
        except FileNotFoundError:
            continue  # an upload finished (renamed it) meanwhile
    return found
