"""A seeded workload on a real in-process daemon whose durable writes go to a ModelFS.

    seed ─▶ rounds of: send 1..5 tagged bundles (each ACK's sequence noted),
                       let segments finalize, deliver to subscriber "s" and ack or
                       nack each (a random choice), let the gc delete what is acked
    every file-system op ─▶ ModelFS.ops, in order, with the daemon's own marks
                            ("acked": the sequences an ack is about to leave for) and
                            the test's ("sub_ack": an ACK_BUNDLE sent for a bundle)

One shard, no lake, small segments and a small WAL (rotation and release every few
bundles): the steps whose crash states matter come often. One seed in five (``drops_in``)
runs under drop_oldest retention capped at one segment's size. ``run_workload`` returns the
ops log and what the producer and the subscriber were told (``Facts``).
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa

from quiverd.client import Client, subscribe
from quiverd.kernel import fs
from quiverd.kernel.errors import AtCapacity
from quiverd.net.admin import request
from tests.inprocess import InProcessDaemon
from tests.sim.modelfs import ModelFS, Op

SUBSCRIBER = "s"
SETTINGS: dict[str, Any] = {
    "shards": 1,
    "lake.enabled": False,
    "segment.max_open_duration_ms": 30,
    "segment.target_size_bytes": 64 * 1024,
    "ingest.max_bundle_bytes": 64 * 1024,
    "wal.max_entry_bytes": 128 * 1024,
    "wal.max_size_bytes": 128 * 1024,
    "wal.max_chunks": 4,
    "wal.flush_interval_ms": 1,
    "scrub.rate_mb_per_s": 0.0,
}


PRODUCER = "w"  # the workload's producer id


def tagged(tag: int, rows: int) -> pa.Table:
    """A bundle whose rows all carry ``tag`` (how a recovered bundle is recognized)."""
    return pa.table({"tag": pa.array([tag] * rows, pa.int64()),
                     "i": pa.array(range(rows), pa.int64())})


@dataclass
class Facts:
    """What clients were told: the ground truth the invariants check recovery against."""

    seq_of_tag: dict[int, int] = field(default_factory=dict)  # producer ACK: tag -> sequence
    # A named producer's bundles: tag -> ((producer, incarnation, client), producer_seq).
    number_of_tag: dict[int, tuple[tuple[str, int, str], int]] = field(default_factory=dict)
    tag_of_id: dict[tuple[int, int], int] = field(default_factory=dict)  # delivered bundle


@contextmanager
def model_daemon(root: Path, *, settings: dict[str, Any] | None = None,
                 record: bool = True, model: ModelFS | None = None
                 ) -> Iterator[tuple[InProcessDaemon, ModelFS]]:
    """An in-process daemon under ``root`` whose data directory is a ModelFS."""
    d = InProcessDaemon(root, {**SETTINGS, **(settings or {})})
    d.data_dir.mkdir(exist_ok=True)
    model = model or ModelFS(d.data_dir, record=record)
    previous = fs.install(model)
    try:
        yield d, model
    finally:
        try:
            d.end()
        finally:
            fs.install(previous)


def short_root() -> Path:
    """A directory short enough for Unix socket paths."""
    return Path(tempfile.mkdtemp(prefix="qsim", dir="/tmp"))


def add_subscriber(d: InProcessDaemon, name: str = SUBSCRIBER) -> None:
    request(d.admin_socket, "subscribers.add", {"name": name, "start": "earliest"})


def produce(d: InProcessDaemon, facts: Facts, tags: list[int], rows: int, *,
            refusable: bool = False) -> int:
    """Send the tagged bundles; how many were acked. ``refusable``: an AT_CAPACITY
    refusal (retention's backpressure under ``wal.at_capacity = "reject"``) ends the
    send early instead of failing."""
    acked = 0
    # A named producer (its numbers must survive every crash state: producers.json and
    # the WAL's metadata slot); the k-th ack answers producer_seq k.
    with Client.connect(d.socket, producer_id=PRODUCER) as c:
        assert c._producer is not None
        stream = (PRODUCER, c._producer[1], "p")
        try:
            for tag, ack in zip(tags, c.iter_send([tagged(t, rows) for t in tags],
                                                  client="p"), strict=True):
                facts.seq_of_tag[tag] = ack.sequence
                acked += 1
                facts.number_of_tag[tag] = (stream, acked)
        except AtCapacity:
            if not refusable:
                raise
    return acked


def consume(d: InProcessDaemon, model: ModelFS, facts: Facts, rng: random.Random, *,
            idle_s: float = 0.15, ack_p: float = 0.7, reject_p: float = 0.0) -> int:
    """Take what is delivered until idle; ack (noted as a mark) or nack each; with
    ``reject_p``, reject some of those it would ack (a final answer, noted the same)."""
    got = 0

    async def run() -> None:
        nonlocal got
        async with subscribe(d.socket, SUBSCRIBER, window=64) as deliveries:
            while True:
                with anyio.move_on_after(idle_s) as scope:
                    b = await anext(deliveries)
                if scope.cancelled_caught:
                    return
                got += 1
                tag = int(b.tables[0].column("tag")[0].as_py())
                facts.tag_of_id[b.id[1:]] = tag
                if rng.random() < ack_p:
                    model.mark("sub_ack", id=b.id[1:], tag=tag)
                    if reject_p and rng.random() < reject_p:
                        await b.reject()
                    else:
                        await b.ack()
                else:
                    await b.nack()

    anyio.run(run)
    return got


# One seed in five runs under drop_oldest retention with a cap of one segment: the
# oldest segments are deleted whether acked or not (their ``dropped`` outcomes first).
RETAINED: dict[str, Any] = {"retention.size_cap_bytes": 64 * 1024,
                            "retention.size_cap_policy": "drop_oldest"}


def drops_in(seed: int) -> bool:
    """Does workload ``seed`` run under drop_oldest retention?"""
    return seed % 5 == 3


def run_workload(seed: int, *, rounds: int = 3,
                 between: Callable[[int], None] | None = None) -> tuple[list[Op], Facts]:
    """The seeded workload on a fresh daemon; returns its ops log and facts."""
    rng = random.Random(seed)
    facts = Facts()
    root = short_root()
    with model_daemon(root, settings=RETAINED if drops_in(seed) else None) as (d, model):
        d.start()
        add_subscriber(d)
        tag = 0
        for r in range(rounds):
            n = rng.randint(1, 5)
            produce(d, facts, list(range(tag, tag + n)), rows=rng.choice((10, 200, 1500)))
            tag += n
            if rng.random() < 0.7:
                time.sleep(0.06)  # past max_open_duration_ms: the segment finalizes
                consume(d, model, facts, rng)
            if between is not None:
                between(r)
        time.sleep(0.1)
        assert d.stop() == 0
        problems = model.check_mirror(ignore=("LOCK", "catalog.sqlite", "objects/", "lake/"))
        assert not problems, f"changes that bypassed the seam: {problems}"
    return model.ops, facts
