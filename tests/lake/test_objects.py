"""ObjectStore on real stores: OpenDAL fs in tmp_path and moto's S3 server on loopback.

The first half runs every behaviour on both fs and s3: upload + stat + read + CRC in the
metadata, no overwrite, list/delete, a multi-part upload, download. The second half puts
a fault proxy (real sockets) between OpenDAL and moto: 500s, 503 throttling, 403, resets,
slow answers, corrupted reads and failures in the middle of a multipart upload.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import opendal
import pytest

from quiverd.kernel.config import MiB, StoreConfig
from quiverd.kernel.crc import crc32c
from quiverd.kernel.errors import (
    ConfigError,
    CorruptRecord,
    ObjectExists,
    StoreDenied,
    StoreUnavailable,
    VerifyFailed,
)
from quiverd.lake import store as store_options
from quiverd.lake.store import ObjectStore, local, objects, open_store

KEY = "client=c/slot=0/node/01J0000000000000000000000A.parquet"


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))

    warning = error = debug = info

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kw for name, kw in self.events if name == event]


def sealed(tmp_path: Path, size: int, name: str = "f.parquet") -> tuple[Path, int]:
    """A local file of random bytes and its CRC-32C, as the uploader would hand over."""
    path = tmp_path / name
    data = os.urandom(size)
    path.write_bytes(data)
    return path, crc32c(data)


@pytest.fixture(params=["fs", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., ObjectStore]:
    """ObjectStore factory over one backend; keyword args override StoreConfig fields."""

    def make(**overrides: Any) -> ObjectStore:
        if request.param == "s3":
            bucket = request.getfixturevalue("s3_bucket")
            cfg = StoreConfig(scheme="s3", root="/lake", options=bucket, **overrides)
        else:
            cfg = StoreConfig(**overrides)
        return open_store(cfg, data_dir=tmp_path / "data", log=Log())  # type: ignore[arg-type]

    return make


def fault_store(s3_faults: Any, tmp_path: Path, **overrides: Any) -> ObjectStore:
    fields: dict[str, Any] = {"max_attempts": 4, "retry_base_ms": 5, "retry_max_ms": 20,
                              "timeout_ms": 2_000, **overrides}
    cfg = StoreConfig(scheme="s3", options=s3_faults.options, **fields)
    return open_store(cfg, data_dir=tmp_path / "data", log=Log())  # type: ignore[arg-type]


def direct_store(s3_faults: Any, tmp_path: Path) -> ObjectStore:
    """The same bucket without the proxy, to check what really is there."""
    cfg = StoreConfig(scheme="s3", options=s3_faults.direct_options)
    return open_store(cfg, data_dir=tmp_path / "data", log=Log())  # type: ignore[arg-type]


# -- both backends --------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_objects_put_file_stat_read_and_crc_metadata(make_store: Callable[..., ObjectStore],
                                                           tmp_path: Path) -> None:
    store = make_store()
    path, crc = sealed(tmp_path, 1 * MiB + 3)
    await store.put_file(KEY, path, size=1 * MiB + 3, crc32c=crc)
    info = await store.stat(KEY)
    assert info is not None and info.key == KEY and info.size == 1 * MiB + 3
    assert info.last_modified_ns > 1_600_000_000 * 10**9
    assert await store.read(KEY) == path.read_bytes()
    meta = await store._op.stat(KEY)
    assert meta.user_metadata == {"crc32c": f"{crc:08x}"}
    assert store.bytes_uploaded_total == 1 * MiB + 3 and store.retries_total == 0
    assert await store.stat("client=c/absent") is None
    if store.cfg.scheme == "fs":
        assert store.uri(KEY) == f"file://{tmp_path}/data/objects/{KEY}"  # plain: client=c
    else:
        assert store.uri(KEY) == f"s3://{store.cfg.options['bucket']}/lake/{KEY}"


@pytest.mark.asyncio
async def test_objects_put_file_refuses_overwrite_and_keeps_original(
        make_store: Callable[..., ObjectStore], tmp_path: Path) -> None:
    store = make_store()
    first, crc1 = sealed(tmp_path, 4096, "a")
    second, crc2 = sealed(tmp_path, 4096, "b")
    await store.put_file(KEY, first, size=4096, crc32c=crc1)
    with pytest.raises(ObjectExists):
        await store.put_file(KEY, second, size=4096, crc32c=crc2)
    assert await store.read(KEY) == first.read_bytes()
    assert store.errors_total["exists"] == 1
    # The same bytes again: an earlier upload of this very file, which is success.
    await store.put_file(KEY, first, size=4096, crc32c=crc1)
    assert store.log.named("object_already_present")  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_objects_list_and_delete(make_store: Callable[..., ObjectStore],
                                       tmp_path: Path) -> None:
    store = make_store()
    path, crc = sealed(tmp_path, 100)
    keys = ["a/1.parquet", "a/2.parquet", "a/b/3.parquet", "ab/4.parquet", "z.parquet"]
    for key in keys:
        await store.put_file(key, path, size=100, crc32c=crc)
    listed = await store.list()
    assert sorted(o.key for o in listed) == keys  # no directories, no fs tmp dir
    assert all(o.size == 100 and o.last_modified_ns > 0 for o in listed)
    assert sorted(o.key for o in await store.list("a/")) == keys[:3]
    assert len(await store.list("", limit=2)) == 2
    await store.delete("a/2.parquet")
    await store.delete("a/2.parquet")  # absent: fine
    assert await store.stat("a/2.parquet") is None
    assert sorted(o.key for o in await store.list("a/")) == ["a/1.parquet", "a/b/3.parquet"]


@pytest.mark.asyncio
async def test_objects_multi_chunk_upload_verifies_and_downloads(
        make_store: Callable[..., ObjectStore], tmp_path: Path) -> None:
    store = make_store()
    size = 20 * MiB + 12345  # three 8 MiB chunks: an S3 multipart upload of three parts
    path, crc = sealed(tmp_path, size)
    await store.put_file(KEY, path, size=size, crc32c=crc)
    out = tmp_path / "back" / "f.parquet"
    out.parent.mkdir()
    await store.get_file(KEY, out)
    assert out.stat().st_size == size and crc32c(out.read_bytes()) == crc
    assert os.listdir(out.parent) == ["f.parquet"]  # no tmp file left
    with pytest.raises(FileNotFoundError):
        await store.get_file("client=c/absent", tmp_path / "back" / "g")
    with pytest.raises(FileNotFoundError):
        await store.read("client=c/absent")
    assert os.listdir(out.parent) == ["f.parquet"]


@pytest.mark.asyncio
async def test_objects_local_file_not_as_sealed_leaves_no_object(
        make_store: Callable[..., ObjectStore], tmp_path: Path) -> None:
    store = make_store()
    path, crc = sealed(tmp_path, 9 * MiB)  # more than one chunk: bytes did go out
    with pytest.raises(CorruptRecord, match="sealed as"):
        await store.put_file(KEY, path, size=9 * MiB, crc32c=crc ^ 1)
    with pytest.raises(CorruptRecord, match="longer than"):
        await store.put_file(KEY, path, size=9 * MiB - 1, crc32c=crc)
    assert await store.stat(KEY) is None
    assert await store.list() == []
    if store.cfg.scheme == "fs":
        assert os.listdir(tmp_path / "data" / "objects" / ".tmp") == []


@pytest.mark.asyncio
async def test_objects_upload_streams_in_chunks(tmp_path: Path) -> None:
    import tracemalloc

    store = open_store(StoreConfig(), data_dir=tmp_path, log=Log())  # type: ignore[arg-type]
    size = 32 * MiB
    path, crc = sealed(tmp_path, size)
    tracemalloc.start()
    try:
        await store.put_file(KEY, path, size=size, crc32c=crc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * objects.CHUNK_BYTES < size


@pytest.mark.asyncio
async def test_objects_verify_reads_back_without_user_metadata(tmp_path: Path) -> None:
    # OpenDAL's memory service keeps no user metadata: the CRC is checked by reading back.
    store = open_store(StoreConfig(scheme="memory"), data_dir=tmp_path,
                        log=Log())  # type: ignore[arg-type]
    assert not store.keeps_user_metadata and store.conditional_create
    path, crc = sealed(tmp_path, 3 * MiB)
    await store.put_file(KEY, path, size=3 * MiB, crc32c=crc)
    assert (await store._op.stat(KEY)).user_metadata is None
    assert await store.read(KEY) == path.read_bytes()
    assert store.uri(KEY) == f"memory://{KEY}"


@pytest.mark.asyncio
async def test_objects_fs_without_xattrs_verifies_by_reading_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "_has_user_xattrs", lambda _: False)  # e.g. NFS
    store = open_store(StoreConfig(), data_dir=tmp_path, log=Log())  # type: ignore[arg-type]
    assert not store.keeps_user_metadata
    path, crc = sealed(tmp_path, 9 * MiB)
    await store.put_file(KEY, path, size=9 * MiB, crc32c=crc)
    assert (await store._op.stat(KEY)).user_metadata is None
    assert await store.read(KEY) == path.read_bytes()


def test_objects_config_errors_name_the_key(tmp_path: Path) -> None:
    def make(**kw: Any) -> ObjectStore:
        return open_store(StoreConfig(**kw), data_dir=tmp_path, log=Log())  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match="bucket is missing") as err:
        make(scheme="s3", options={"region": "us-east-1"})
    assert err.value.path == "lake.store.options" and "bucket" in err.value.hint
    with pytest.raises(ConfigError, match="region is missing"):
        make(scheme="s3", options={"bucket": "b"})
    with pytest.raises(ConfigError, match="not an option") as err:
        make(scheme="s3", options={"bucket": "b", "region": "r", "acess_key_id": "k"})
    assert err.value.path == "lake.store.options.acess_key_id"
    assert "access_key_id" in err.value.hint
    with pytest.raises(ConfigError, match="lake.store.root"):
        make(scheme="s3", options={"bucket": "b", "region": "r", "root": "/x"})
    with pytest.raises(ConfigError, match="go together"):
        make(scheme="s3", options={"bucket": "b", "region": "r", "access_key_id": "k"})
    with pytest.raises(ConfigError, match="not an OpenDAL service") as err:
        make(scheme="nosuch")
    assert err.value.path == "lake.store.scheme"
    opts = store_options.service_options(StoreConfig(scheme="s3", options={
        "bucket": "b", "region": "r"}), "/p")
    assert opts["disable_config_load"] == "true" and opts["root"] == "/p"
    opts = store_options.service_options(StoreConfig(scheme="s3", options={
        "bucket": "b", "region": "r", "disable_config_load": "false"}), "")
    assert opts["disable_config_load"] == "false" and "root" not in opts


def test_objects_keys_are_plain_relative_paths(tmp_path: Path) -> None:
    store = open_store(StoreConfig(), data_dir=tmp_path, log=Log())  # type: ignore[arg-type]
    for bad in ["", "/a", "a/", "a//b", "a/../b", "./a", ".tmp/x"]:
        with pytest.raises(ValueError, match="bad object key"):
            objects._check_key(bad)
    assert store.uri("") == (tmp_path / "objects").as_uri()


# -- faults between OpenDAL and moto --------------------------------------------------------
@pytest.mark.asyncio
async def test_objects_retry_server_errors_then_succeed(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path)
    path, crc = sealed(tmp_path, 1000)
    s3_faults.fail(500, count=2)
    await store.put_file(KEY, path, size=1000, crc32c=crc)
    assert store.retries_total == 2 and store.errors_total["server"] == 2
    retries = store.log.named("object_store_retry")  # type: ignore[attr-defined]
    assert [r["attempt"] for r in retries] == [1, 2]
    assert {r["kind"] for r in retries} == {"server"} and all("delay_ms" in r for r in retries)
    assert await direct_store(s3_faults, tmp_path).read(KEY) == path.read_bytes()


@pytest.mark.asyncio
async def test_objects_retry_throttling_then_succeed(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path)
    path, crc = sealed(tmp_path, 1000)
    s3_faults.throttle(count=1, match="HEAD")  # a 503 on HEAD has no body to say SlowDown
    await store.put_file(KEY, path, size=1000, crc32c=crc)
    s3_faults.throttle(count=2, match="GET")
    assert await store.read(KEY) == path.read_bytes()
    assert store.errors_total["throttled"] == 3 and store.retries_total == 3


@pytest.mark.asyncio
async def test_objects_denied_fails_fast(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path, retry_base_ms=2_000, retry_max_ms=10_000)
    path, crc = sealed(tmp_path, 1000)
    s3_faults.deny()
    started = time.monotonic()
    with pytest.raises(StoreDenied, match="PermissionDenied"):
        await store.put_file(KEY, path, size=1000, crc32c=crc)
    assert time.monotonic() - started < 1.0  # well under one 2 s backoff
    assert store.retries_total == 0 and store.errors_total["denied"] == 1
    assert len(s3_faults.requests) == 1
    assert store.log.named("object_store_failed")[0]["kind"] == "denied"  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_objects_persistent_errors_give_up_after_max_attempts(s3_faults: Any,
                                                                    tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path, max_attempts=3)
    path, crc = sealed(tmp_path, 1000)
    s3_faults.fail(500)
    with pytest.raises(StoreUnavailable, match="failed 3 times; last: server.*HTTP 500"):
        await store.put_file(KEY, path, size=1000, crc32c=crc)
    assert len(s3_faults.requests) == 3 and store.retries_total == 2
    assert store.errors_total["server"] == 3


@pytest.mark.asyncio
async def test_objects_connection_reset_is_retried(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path)
    path, crc = sealed(tmp_path, 1000)
    s3_faults.reset(count=1, match="PUT")
    await store.put_file(KEY, path, size=1000, crc32c=crc)
    assert store.errors_total["connection"] == 1 and store.retries_total == 1
    assert await store.read(KEY) == path.read_bytes()


@pytest.mark.asyncio
async def test_objects_slow_answers_time_out_and_give_up(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path, timeout_ms=200, max_attempts=2)
    s3_faults.delay(1_500)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="timeout"):
        await store.stat(KEY)
    assert time.monotonic() - started < 1.0
    assert store.errors_total["timeout"] == 2 and store.retries_total == 1


@pytest.mark.asyncio
async def test_objects_commit_landing_after_its_timeout_counts(s3_faults: Any,
                                                                tmp_path: Path) -> None:
    # Attempt 1's PUT reaches S3 only after the attempt timed out and its cleanup ran;
    # attempt 2 then finds the key taken, by identical bytes: that is success.
    store = fault_store(s3_faults, tmp_path, timeout_ms=200, retry_base_ms=400,
                        retry_max_ms=400)
    store._rng = _MaxJitter()  # type: ignore[assignment]
    path, crc = sealed(tmp_path, 1000)
    s3_faults.delay(300, count=1, match="PUT")
    await store.put_file(KEY, path, size=1000, crc32c=crc)
    assert store.errors_total["timeout"] == 1 and store.errors_total["exists"] == 0
    # check, PUT (late), cleanup, PUT (412: taken), stat of what took it (identical)
    assert [r.split()[0] for r in s3_faults.requests] == ["HEAD", "PUT", "DELETE", "PUT",
                                                           "HEAD"]
    assert await store.read(KEY) == path.read_bytes()


@pytest.mark.asyncio
async def test_objects_failure_mid_upload_leaves_no_object(s3_faults: Any,
                                                           tmp_path: Path) -> None:
    # 20 MiB through the fault proxy: a loaded machine needs more than the default 2 s.
    store = fault_store(s3_faults, tmp_path, max_attempts=2, timeout_ms=60_000)
    size = 20 * MiB
    path, crc = sealed(tmp_path, size)
    s3_faults.fail(500, match="partNumber=2")  # every attempt dies after part 1 went in
    with pytest.raises(StoreUnavailable, match="server"):
        await store.put_file(KEY, path, size=size, crc32c=crc)
    assert sum("partNumber=1&" in r for r in s3_faults.requests) == 2  # bytes went out
    assert await direct_store(s3_faults, tmp_path).stat(KEY) is None
    s3_faults.fail(500, count=1, match="partNumber=2")  # once: the retry gets through
    await store.put_file(KEY, path, size=size, crc32c=crc)
    out = tmp_path / "out"
    await direct_store(s3_faults, tmp_path).get_file(KEY, out)
    assert crc32c(out.read_bytes()) == crc


@pytest.mark.asyncio
async def test_objects_read_back_mismatch_deletes_and_raises_verify_failed(
        s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path, max_attempts=2)
    store.keeps_user_metadata = False  # verify by reading back, through the proxy
    path, crc = sealed(tmp_path, 5000)
    s3_faults.corrupt(match="GET")
    with pytest.raises(VerifyFailed, match="CRC-32C"):
        await store.put_file(KEY, path, size=5000, crc32c=crc)
    assert store.errors_total["verify"] == 2
    assert await direct_store(s3_faults, tmp_path).stat(KEY) is None
    s3_faults.corrupt(count=1, match="GET")
    await store.put_file(KEY, path, size=5000, crc32c=crc)  # the retry verifies


@pytest.mark.asyncio
async def test_objects_download_retries_a_corrupted_read(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path)
    path, crc = sealed(tmp_path, 5000)
    await store.put_file(KEY, path, size=5000, crc32c=crc)
    s3_faults.corrupt(count=1, match="GET")
    out = tmp_path / "out"
    await store.get_file(KEY, out)  # CRC from the metadata catches the flipped byte
    assert out.read_bytes() == path.read_bytes() and store.errors_total["verify"] == 1


@pytest.mark.asyncio
async def test_objects_concurrency_is_bounded(s3_faults: Any, tmp_path: Path) -> None:
    store = fault_store(s3_faults, tmp_path, max_concurrency=2)
    s3_faults.delay(150)
    peak = 0

    async def one() -> None:
        await store.stat(KEY)

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, store.in_flight)
            await anyio.sleep(0.01)

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        async with anyio.create_task_group() as work:
            for _ in range(6):
                work.start_soon(one)
        tg.cancel_scope.cancel()
    assert peak == 2 and time.monotonic() - started >= 0.45  # 3 rounds of 2


class _MaxJitter:
    def uniform(self, low: float, high: float) -> float:
        return high


def test_objects_fault_proxy_sees_real_requests(s3_faults: Any, tmp_path: Path) -> None:
    op = opendal.Operator("s3", **s3_faults.options)
    op.write("x", b"abc")
    assert op.read("x") == b"abc"
    assert [r.split()[0] for r in s3_faults.requests] == ["PUT", "GET"]
