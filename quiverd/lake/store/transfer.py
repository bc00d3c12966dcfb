"""Bytes between a local file and one OpenDAL object, streamed in bounded chunks.

    send     local file ──8 MiB pread (thread)──▶ writer.write ... ──▶ close (commit)
    receive  reader.read ──8 MiB──▶ <path>.tmp (thread) ──▶ fsync, rename, fsync dir
    crc_of   reader.read ──8 MiB──▶ CRC-32C

Guarantees: at most one chunk (``CHUNK_BYTES``) of an object is in memory at a time;
``send`` commits only after every byte was sent and the local bytes matched the size
and CRC-32C the caller sealed (OpenDAL has no abort: a writer dropped without close()
commits nothing, while leaving ``async with`` on an exception would commit a partial
object); ``receive`` leaves either the whole checked object at ``path`` or nothing.
Retries, timeouts and verification of what the store kept are the caller's
(``quiverd.lake.store.objects``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import opendal

from quiverd.kernel import fs
from quiverd.kernel.config import MiB
from quiverd.kernel.crc import crc32c
from quiverd.kernel.durable import fsync_dir, write_all
from quiverd.kernel.errors import CorruptRecord, VerifyFailed
from quiverd.kernel.layout import tmp_path

CHUNK_BYTES = 8 * MiB  # one file read, one writer.write, one S3 part (>= the 5 MiB minimum)


async def send(op: opendal.AsyncOperator, key: str, path: Path, *, size: int,
               expected_crc: int, write_args: dict[str, Any],
               limiter: anyio.CapacityLimiter) -> None:
    """Stream ``path`` into a new object ``key`` (OpenDAL ``open(key, "wb", **write_args)``)
    and commit it; CorruptRecord, with nothing committed, when the file is not
    ``size`` bytes with CRC-32C ``expected_crc``."""
    fd = await anyio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC,
                                        limiter=limiter)
    try:
        # Not `async with`: leaving that block on an exception would commit a partial
        # object. A writer dropped without close() commits nothing.
        writer = await op.open(key, "wb", **write_args)
        sent, crc = 0, 0
        while True:
            # Read at most one byte past ``size``: a longer file is caught, not uploaded.
            want = min(CHUNK_BYTES, size + 1 - sent)
            chunk, crc = await anyio.to_thread.run_sync(_read_chunk, fd, sent, want, crc,
                                                        limiter=limiter)
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


async def receive(op: opendal.AsyncOperator, key: str, path: Path, *, size: int,
                  stored_crc: str | None, limiter: anyio.CapacityLimiter) -> None:
    """Download ``key`` to ``path`` (tmp, fsync, rename, fsync dir); VerifyFailed, with
    nothing left behind, when the bytes read are not ``size`` long or their CRC-32C is
    not ``stored_crc`` (8 hex digits; None: not checked)."""
    tmp = tmp_path(path)
    fd = await anyio.to_thread.run_sync(_create, tmp, limiter=limiter)
    owned = True
    try:
        got, crc = 0, 0
        reader = await op.open(key, "rb")
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                crc = await anyio.to_thread.run_sync(_write_chunk, fd, chunk, crc,
                                                     limiter=limiter)
                got += len(chunk)
        finally:
            await reader.close()
        if got != size or (stored_crc is not None and stored_crc != f"{crc:08x}"):
            raise VerifyFailed(f"{key!r}: read {got} bytes, CRC-32C {crc:08x}; the store "
                               f"says {size} bytes, {stored_crc}")
        owned = False  # _commit_download closes it
        await anyio.to_thread.run_sync(_commit_download, fd, tmp, path, limiter=limiter)
    except BaseException:
        # Inline, not in a thread: this must run even when we are being cancelled,
        # and close + unlink of one local file do not wait on anything.
        if owned:
            fs.active().close(fd)
        fs.active().unlink(tmp, missing_ok=True)
        raise


async def crc_of(op: opendal.AsyncOperator, key: str) -> int:
    """The whole-file CRC-32C of object ``key``, read back in chunks."""
    crc = 0
    reader = await op.open(key, "rb")
    try:
        while chunk := await reader.read(CHUNK_BYTES):
            crc = crc32c(chunk, crc)  # ~0.3 ms per chunk: not worth a thread hop
    finally:
        await reader.close()
    return crc


# -- worker-thread helpers (blocking) ---------------------------------------------------------
def _read_chunk(fd: int, offset: int, n: int, crc: int) -> tuple[bytes, int]:
    chunk = os.pread(fd, n, offset)
    return chunk, crc32c(chunk, crc)


def _create(path: Path) -> int:
    seam = fs.active()  # a download lands in staging/: the lake's local steps are the seam's
    seam.mkdir(path.parent)  # FileNotFoundError means: no object
    return seam.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)


def _write_chunk(fd: int, chunk: bytes, crc: int) -> int:
    write_all(fd, [chunk])
    return crc32c(chunk, crc)


def _commit_download(fd: int, tmp: Path, path: Path) -> None:
    seam = fs.active()
    try:
        seam.fsync(fd)
    finally:
        seam.close(fd)
    seam.rename(tmp, path)
    fsync_dir(path.parent)
