"""Where a bundle's CPU goes: each step of quiverd's ingest hot path, timed alone.

    python bench/hotpath.py [--sizes 64,1024] [--n 2000] [--loop N]

bench/ingest.py measures the whole daemon (CPU µs per bundle, bundles/s against the
reference server); this bench splits that figure into the steps a bundle takes, each
run in a tight loop in this process on the bundle bench/ingest.py sends, with the
production code:

    decode        FrameDecoder.feed of one BUNDLE frame (copy out of the receive
                  buffer, CRC-32C of the body, header fields, slot table)
    validate      SchemaCache.inspect, schema known (framing walk, compression flag,
                  zero-copy open, validate(full=True))
    validate-new  the same for a schema seen for the first time (names, fingerprint)
    route         Bundle + AppendRequest, shard_of, the inbox put
    wal-encode    META slot (cached), entry_size, encode_entry (CRC-32C of the payload)
    stamp         the sequence-stamped Bundle the syncer hands back
    ack           Ack + reply queue + ACK frame encode (per bundle share)
    segment       OpenSegment.add of a durable bundle (schema known, no payload)
    write         os.write of the entry into a fresh file (kernel time: page cache)

The sum is what one bundle costs in Python and the kernel without the event loop,
threads and the socket; the gap to bench/ingest.py's "cpu µs/bundle" is scheduling
(loop passes, thread hand-offs, the GIL) and the socket's copies. Prints one table,
µs per bundle, best of 5 rounds.

``--loop N`` also times the event loop's side alone, as the daemon runs it: a real
``IngestServer`` on a Unix socket (uvloop), every bundle answered the moment its
shard's inbox takes it (no WAL, no threads), N bundles of 64 KiB from one producer
process; prints the server's user and system CPU per bundle (getrusage).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import KiB, make_table  # noqa: E402

from quiverd.kernel.bundle import Bundle, MetaCodec  # noqa: E402
from quiverd.kernel.schema_cache import SchemaCache  # noqa: E402
from quiverd.net.connection import shard_of  # noqa: E402
from quiverd.protocol import codec as protocol  # noqa: E402
from quiverd.segments.open_segment import OpenSegment  # noqa: E402
from quiverd.wal import format as walformat  # noqa: E402
from quiverd_actors.inbox import Batches  # noqa: E402
from quiverd_actors.messages import AppendRequest  # noqa: E402


def steps(size: int) -> dict[str, Callable[[], object]]:
    table, ipc = make_table(size)
    frame = b"".join(bytes(p) for p in protocol.encode_bundle(
        7, "bench-client", {0: ipc}, {0: table.num_rows}))
    decoder = protocol.FrameDecoder(protocol.max_frame_bytes(size * 2))
    decoder.feed(protocol.encode_hello(protocol.Role.PRODUCER))
    [msg] = decoder.feed(frame)
    assert isinstance(msg, protocol.BundleFrame)
    cache = SchemaCache()
    slots = protocol.validate_bundle(msg, schemas=cache)
    replies: Batches[protocol.Ack] = Batches()
    inbox: Batches[AppendRequest] = Batches()
    meta = MetaCodec()
    bundle = Bundle(client="bench-client", slots=slots)
    wal_slots = (*slots, meta.encode("bench-client", None))
    segment = OpenSegment()
    counter = iter(range(1, 1 << 40))
    fd = os.open(tempfile.mktemp(dir=os.environ.get("TMPDIR", "/var/tmp")),
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    entry = b"".join(bytes(p) for p in walformat.encode_entry(ts_ns=1, sequence=1,
                                                              slots=wal_slots))

    def validate_new() -> object:
        return SchemaCache().inspect(ipc)

    def route() -> None:
        b = Bundle(client=msg.client, slots=slots, txn=msg.txn)
        inbox.put_nowait([AppendRequest(request_id=msg.request_id, bundle=b, reply=replies)])
        shard_of(msg.client, 2)
        inbox._items.clear()

    def wal_encode() -> object:
        s = (*bundle.slots, meta.encode(bundle.client, bundle.txn))
        return walformat.entry_size(s), walformat.encode_entry(ts_ns=1, sequence=1, slots=s)

    def stamp() -> Bundle:
        return Bundle(client=bundle.client, slots=bundle.slots, txn=bundle.txn,
                      ingestion_ts_ns=1, sequence=next(counter))

    def ack() -> bytes:
        replies.send_nowait(protocol.Ack(request_id=7, shard=0, sequence=1))
        replies._items.clear()
        return protocol.encode_ack(7, 0, 1)

    def add_segment() -> None:
        segment.add(Bundle(client="c", slots=slots, sequence=next(counter),
                           ingestion_ts_ns=1), from_wal=True)

    def write() -> None:
        if os.lseek(fd, 0, os.SEEK_CUR) > 256 * 1024 * 1024:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, entry)

    return {"decode": lambda: decoder.feed(frame), "validate": lambda: cache.inspect(ipc),
            "validate-new": validate_new, "route": route, "wal-encode": wal_encode,
            "stamp": stamp, "ack": ack, "segment": add_segment, "write": write}


def _loop_producer(sock: str, ipc: bytes, n: int, barrier: object, out: object) -> None:
    import pyarrow as pa

    from quiverd.client.producer import Client

    table = pa.ipc.open_stream(ipc).read_all()
    with Client.connect(sock) as c:
        for _ in c.iter_send(itertools.repeat(table, 50), client="loop-bench"):
            pass
        barrier.wait()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        sent = sum(1 for _ in c.iter_send(itertools.repeat(table, n), client="loop-bench"))
        out.put((sent, time.perf_counter() - t0))  # type: ignore[attr-defined]


async def _loop_alone(n: int, size: int) -> tuple[float, float, float]:
    """(bundles/s, user µs, system µs per bundle) of the ingest loop with instant acks."""
    import anyio

    from quiverd.kernel import logs
    from quiverd.kernel.config import IngestConfig
    from quiverd.net.ingest import IngestServer
    from quiverd_actors.inbox import ShardInbox

    path = Path(tempfile.mkdtemp()) / "in.sock"
    inboxes = [ShardInbox(), ShardInbox()]
    server = IngestServer(IngestConfig(socket_path=str(path)), path, inboxes,
                          limiter=anyio.CapacityLimiter(2), log=logs.get("bench"))
    numbers = itertools.count(1)

    async def answer(inbox: ShardInbox) -> None:
        while (batch := await inbox.take()) is not None:
            for r in batch:
                r.reply.send_nowait(protocol.Ack(request_id=r.request_id, shard=0,
                                                 sequence=next(numbers)))

    _, ipc = make_table(size)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    async with anyio.create_task_group() as tg:
        for inbox in inboxes:
            tg.start_soon(answer, inbox)
        await tg.start(server.serve)
        proc = ctx.Process(target=_loop_producer, args=(str(path), ipc, n, barrier, out))
        proc.start()
        await anyio.to_thread.run_sync(barrier.wait)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        sent, seconds = await anyio.to_thread.run_sync(out.get)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        server.stop()
        tg.cancel_scope.cancel()
    proc.join(10)
    return (sent / seconds, (r1.ru_utime - r0.ru_utime) / sent * 1e6,
            (r1.ru_stime - r0.ru_stime) / sent * 1e6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,1024", help="bundle sizes in KiB (default 64,1024)")
    p.add_argument("--n", type=int, default=2000, help="calls per round (default 2000)")
    p.add_argument("--loop", type=int, default=0, metavar="N",
                   help="also time the ingest loop alone over N bundles of 64 KiB")
    args = p.parse_args(argv)
    sizes = [int(s) * KiB for s in args.sizes.split(",")]
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        n = max(args.n * 64 * KiB // size, 50)
        results[size] = {name: min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
                         for name, fn in steps(size).items()}
    names = list(next(iter(results.values())))
    print("| step | " + " | ".join(f"{s // KiB} KiB µs" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[s][name]:.1f}" for s in sizes) + " |")
    per_bundle = [n for n in names if n != "validate-new"]
    print("| **sum (schema known)** | " + " | ".join(
        f"**{sum(results[s][n] for n in per_bundle):.1f}**" for s in sizes) + " |")
    if args.loop:
        import anyio

        rate, user, system = anyio.run(_loop_alone, args.loop, 64 * KiB, backend="asyncio",
                                       backend_options={"use_uvloop": True})
        print(f"\ningest loop alone (instant acks, 1 producer, 64 KiB): {rate:.0f} bundles/s, "
              f"server CPU {user:.0f} µs user + {system:.0f} µs system per bundle")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
