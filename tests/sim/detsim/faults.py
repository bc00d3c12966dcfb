"""Faults drawn from the run's seed: the object store (under quiverd's ObjectStore, at
OpenDAL's operator), quiverd's catalog and the Iceberg projection.

    per call, while faults are on (virtual t < FaultPlan.until):
      unavailable   the call fails before it is done (store: OpenDAL "temporary" error,
                    retried by ObjectStore; catalog: CatalogUnavailable)
      lost          the call is done, then its reply is lost (same errors), for calls
                    that change something: upload commit, delete, copy, catalog writes,
                    Iceberg commits and expiry
      timeout       store only: no answer within lake.store.timeout_ms (before or after
                    doing the call), ObjectStore's own fail_after fires
      crash         catalog only: the calling actor dies there (SimCrash, an Exception no
                    actor expects: the lake's supervisor restarts every lake actor)
      zombie        Iceberg sync only: the daemon's lake is killed while its worker
                    holds the sync, which the worker lands 0-60 s later
    outages: windows in which every store (or catalog) call is unavailable

The store's operator here is OpenDAL's blocking one, called inline: the async one
completes from Rust threads, which no seeded loop can order. Objects' last-modified
times are the virtual times of their commits (the janitor judges orphans by age).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
import opendal
import opendal.exceptions as oe

from quiverd.kernel.errors import CatalogUnavailable
from tests.sim.detsim.loop import NS, SimLoop

CATALOG_WRITES = frozenset({"insert_file", "set_state", "set_state_if", "register",
                            "record_index", "replace", "restore", "forget", "delete_rows"})
CATALOG_QUIET = frozenset({"start", "close"})  # opened and closed by the harness's retries
ICEBERG_WRITES = frozenset({"sync", "commit", "expire"})


class SimCrash(Exception):  # noqa: N818 - it is what happens, not an error kind
    """An actor died in the middle of a call (the lake's supervisor restarts the lake)."""


@dataclass
class Rates:
    store: float = 0.08  # chance per store call
    catalog: float = 0.05  # chance per catalog call
    iceberg: float = 0.08  # chance per Iceberg call
    lost: float = 0.4  # of the faults of calls that change something: done, reply lost
    timeout: float = 0.25  # of the store's faults: no answer
    crash: float = 0.004  # per catalog call: the caller dies
    zombie: float = 0.02  # per Iceberg sync: the daemon dies while its worker holds it


@dataclass
class FaultPlan:
    rng: random.Random
    loop: SimLoop
    until: float  # virtual seconds: no fault after this
    rates: Rates = field(default_factory=Rates)
    outages: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    note: Callable[[str], None] = lambda _: None

    @classmethod
    def draw_plan(cls, seed: int, loop: SimLoop, until: float, *, on: bool = True,
                  scale: float = 1.0) -> FaultPlan:
        rng = random.Random(f"faults-{seed}")
        base = Rates()
        rates = Rates(store=base.store * scale, catalog=base.catalog * scale,
                      iceberg=base.iceberg * scale, crash=base.crash * scale,
                      zombie=base.zombie * scale)
        plan = cls(rng=rng, loop=loop, until=until if on else 0.0, rates=rates)
        for part in ("store", "catalog"):
            windows = []
            for _ in range(rng.randint(0, 2)):
                start = rng.uniform(0, until)
                windows.append((start, start + rng.uniform(5, 60)))
            plan.outages[part] = sorted(windows)
        return plan

    def draw(self, part: str, op: str, *, mutating: bool) -> str | None:
        now = self.loop.vtime
        if now >= self.until:
            return None
        fault: str | None = None
        down = "catalog" if part == "iceberg" else part  # one database holds both catalogs
        if any(a <= now < b for a, b in self.outages.get(down, ())):
            fault = "unavailable"
        elif part == "catalog" and self.rng.random() < self.rates.crash:
            fault = "crash"
        elif self.rng.random() < getattr(self.rates, part):
            fault = "unavailable"
            if mutating and self.rng.random() < self.rates.lost:
                fault = "lost"
            elif part == "store" and self.rng.random() < self.rates.timeout:
                fault = "timeout"
        if fault is not None:
            key = f"{part}.{fault}"
            self.counts[key] = self.counts.get(key, 0) + 1
            self.note(f"fault {part}.{op} {fault}")
        return fault


# ---- the object store: OpenDAL's operator, blocking, inline -------------------------------

class Meta:
    """OpenDAL metadata with a virtual last-modified time."""

    def __init__(self, meta: Any, born_ns: int | None) -> None:
        self.content_length = meta.content_length
        self.user_metadata = meta.user_metadata
        self.is_dir = meta.is_dir
        self.last_modified = meta.last_modified if born_ns is None else \
            datetime.fromtimestamp(born_ns / NS, UTC)


class Entry:
    def __init__(self, path: str, metadata: Meta) -> None:
        self.path, self.metadata = path, metadata


class FaultyOperator:
    """``opendal.AsyncOperator``'s calls that ObjectStore makes, on a blocking Operator."""

    def __init__(self, op: opendal.Operator, plan: FaultPlan, timeout_s: float,
                 born: dict[str, int], changed: Callable[[str], None]) -> None:
        self._op, self._plan, self._timeout_s = op, plan, timeout_s
        self._born, self._changed = born, changed

    async def _call(self, name: str, mutating: bool, fn: Callable[[], Any],
                    key: str = "") -> Any:
        await anyio.lowlevel.checkpoint()
        fault = self._plan.draw("store", name, mutating=mutating)
        if fault == "timeout" and self._plan.rng.random() < 0.5:
            await anyio.sleep(self._timeout_s * 2)  # never answered: fail_after fires
        if fault == "unavailable":
            raise oe.Unexpected(f"Unexpected (temporary) at send http request => sim: "
                                f"{name} {key} reset")
        result = fn()
        if mutating:
            self._changed(f"store.{name} {key}")
        if fault == "timeout":
            await anyio.sleep(self._timeout_s * 2)  # done, the answer never comes
        if fault == "lost":
            raise oe.Unexpected(f"Unexpected (temporary) at send http request => sim: "
                                f"{name} {key} done, reply lost")
        await anyio.lowlevel.checkpoint()
        return result

    def _meta(self, key: str, meta: Any) -> Meta:
        return Meta(meta, self._born.get(key.rstrip("/")))

    def capability(self) -> Any:
        return self._op.capability()

    def layer(self, _layer: Any) -> FaultyOperator:
        return self

    async def stat(self, key: str) -> Meta:
        return self._meta(key, await self._call("stat", False, lambda: self._op.stat(key), key))

    async def read(self, key: str, **kw: Any) -> bytes:
        return bytes(await self._call("read", False, lambda: self._op.read(key, **kw), key))

    async def write(self, key: str, body: bytes, **kw: Any) -> None:
        def write() -> None:
            self._op.write(key, body, **kw)
            self._born[key] = self._plan.loop.wall_ns()

        await self._call("write", True, write, key)

    async def copy(self, source: str, target: str) -> None:
        def copy() -> None:
            self._op.copy(source, target)
            self._born[target] = self._plan.loop.wall_ns()

        await self._call("copy", True, copy, target)

    async def delete(self, key: str) -> None:
        def delete() -> None:
            self._op.delete(key)
            self._born.pop(key, None)

        await self._call("delete", True, delete, key)

    async def list(self, prefix: str, recursive: bool = False) -> AsyncIterator[Entry]:
        entries = await self._call("list", False, lambda: [
            Entry(e.path, self._meta(e.path, e.metadata))
            for e in self._op.list(prefix, recursive=recursive)], prefix)

        async def each() -> AsyncIterator[Entry]:
            for entry in entries:
                yield entry

        return each()

    async def open(self, key: str, mode: str, **kw: Any) -> Writer | Reader:
        if mode == "wb":
            return Writer(self, key, kw)
        return Reader(await self._call("open", False, lambda: self._op.open(key, mode), key))


class Writer:
    """The bytes are sent at ``close`` (the commit), the one call that can fail here."""

    def __init__(self, op: FaultyOperator, key: str, kw: dict[str, Any]) -> None:
        self._op, self._key, self._kw = op, key, kw
        self._chunks: list[bytes] = []

    async def write(self, chunk: bytes) -> None:
        self._chunks.append(bytes(chunk))

    async def close(self) -> None:
        inner = self._op._op
        key, kw, body = self._key, self._kw, b"".join(self._chunks)

        def commit() -> None:
            inner.write(key, body, **kw)
            self._op._born[key] = self._op._plan.loop.wall_ns()

        try:
            await self._op._call("commit", True, commit, key)
        finally:
            self._chunks = []


class Reader:
    def __init__(self, file: Any) -> None:
        self._file = file

    async def read(self, n: int) -> bytes:
        return bytes(self._file.read(n))

    async def close(self) -> None:
        self._file.close()


# ---- quiverd's catalog -----------------------------------------------------------------

class FaultyCatalog:
    """A Catalog whose async calls fail as the plan draws; ``on_list(kwargs, rows)`` sees
    every list_files answer (the projector's reads, for the invariants)."""

    def __init__(self, inner: Any, plan: FaultPlan, changed: Callable[[str], None],
                 on_list: Callable[[dict[str, Any], list[Any]], None] | None = None) -> None:
        self._inner, self._plan, self._changed, self._on_list = inner, plan, changed, on_list

    def with_reads_to(self, on_list: Callable[[dict[str, Any], list[Any]], None]
                      ) -> FaultyCatalog:
        return FaultyCatalog(self._inner, self._plan, self._changed, on_list)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in CATALOG_QUIET or not callable(attr) or not _is_async(attr):
            return attr
        mutating = name in CATALOG_WRITES

        async def call(*args: Any, **kwargs: Any) -> Any:
            fault = self._plan.draw("catalog", name, mutating=mutating)
            if fault == "crash":
                raise SimCrash(f"sim: the caller of catalog.{name} died")
            if fault == "unavailable":
                await anyio.lowlevel.checkpoint()
                raise CatalogUnavailable(f"sim: catalog {name}: unavailable")
            result = await attr(*args, **kwargs)
            if mutating:
                self._changed(f"catalog.{name} {_subject(args)}")
            if fault == "lost":
                raise CatalogUnavailable(f"sim: catalog {name}: done, reply lost")
            if name == "list_files" and self._on_list is not None:
                self._on_list(kwargs, result)
            return result

        return call


def _subject(args: tuple[Any, ...]) -> str:
    """What a catalog write is about, for the trace: a file id (or a row's)."""
    if not args:
        return ""
    first = args[0]
    if isinstance(first, str):
        return first
    if isinstance(first, list):
        return ",".join(map(str, first[:4]))
    return str(getattr(first, "file_id", ""))


def _is_async(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


# ---- the Iceberg projection (in this process, inline) -----------------------------------

class FaultyProjection:
    """``RemoteProjection``'s interface on a ``Projection`` of this process: every call
    inline (atomic), failing as the plan draws (the catalog's part: the Iceberg catalog
    lives in the same database). ``plant`` names a planted bug (``tests.sim.detsim``)."""

    def __init__(self, projection: Any, plan: FaultPlan, changed: Callable[[str], None],
                 plant: str = "", zombie: Callable[[Callable[[], Any]], None] | None = None
                 ) -> None:
        self.projection, self._plan, self._changed, self._plant = (projection, plan, changed,
                                                                   plant)
        # ``zombie(call)``: kill this daemon's lake and land ``call`` later, as the worker
        # process a killed daemon leaves behind would (the fence must make it harmless).
        self._zombie = zombie

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.projection, name)
        mutating = name in ICEBERG_WRITES

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self._plant == "no_removals" and name == "sync":
                args = (args[0], args[1], (), *args[3:])
            if self._plant == "expire_now" and name == "expire":
                kwargs["older_than_s"] = 0.0
            if (name == "sync" and self._zombie is not None
                    and self._plan.loop.vtime < self._plan.until
                    and self._plan.rng.random() < self._plan.rates.zombie):
                self._plan.counts["iceberg.zombie"] = self._plan.counts.get(
                    "iceberg.zombie", 0) + 1
                self._zombie(lambda: method(*args, **kwargs))
                await anyio.sleep_forever()  # the kill cancels it
            fault = self._plan.draw("iceberg", name, mutating=mutating)
            if fault == "unavailable":
                await anyio.lowlevel.checkpoint()
                raise CatalogUnavailable(f"sim: Iceberg catalog {name}: unavailable")
            result = await anyio.to_thread.run_sync(lambda: method(*args, **kwargs))
            if mutating:
                self._changed(f"iceberg.{name}")
            if fault == "lost":
                raise CatalogUnavailable(f"sim: Iceberg {name}: done, reply lost")
            return result

        return call
