"""``quiverd subscribe``: a console consumer for one registered subscriber.

    quiverd subscribe NAME --out DIR      write every bundle's slots, ack once durable
    quiverd subscribe NAME --count N      print N bundles, ack each, stop

With ``--out`` each delivered bundle becomes one Arrow IPC file per slot,
``DIR/<shard>-<segment_seq>-<bundle_index>.slot<k>.arrow``, written with
``durable.atomic_write`` (tmp, fsync, rename, fsync dir); the bundle is acked only
after its last file is durable. A redelivered bundle rewrites the same names, so
at-least-once delivery leaves exactly one copy of each bundle on disk.

One line per bundle goes to stdout (JSON lines with ``--json``); the summary goes
to stderr. ``--timeout`` stops after that many seconds without a delivery (default:
never with ``--out``, 10 s with ``--count``, where stopping short is an error).
Ctrl-C or SIGTERM stop at once: a bundle not yet acked is delivered again on the
next subscribe, and its files (if any) are rewritten then.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pyarrow as pa

from quiverd.client.consumer import ReceivedBundle, subscribe
from quiverd.kernel import config as config_mod
from quiverd.kernel.durable import atomic_write
from quiverd.kernel.errors import ProtocolError, QuiverError, ShuttingDown
from quiverd.kernel.names import validate_subscriber_name
from quiverd.protocol.frames import ErrorCode

MAX_WINDOW = 4096  # the daemon clamps larger windows to this (quiverd.net.consumers.MAX_WINDOW)
DEFAULT_COUNT_TIMEOUT_S = 10.0
EXIT_SIGINT = 130


@dataclass
class _Run:
    """What one ``quiverd subscribe`` invocation has done so far."""

    acked: int = 0
    rows: int = 0
    stopped_by: str = ""  # "count", "timeout", "signal <n>", "eof"
    signum: int = 0


def subscribe_cli(args: argparse.Namespace, default_config: str) -> int:
    """Entry point for ``quiverd subscribe``; returns the exit code."""
    validate_subscriber_name(args.name)
    socket_path = Path(args.socket) if args.socket else \
        config_mod.load(args.config or default_config).ingest_socket
    if args.window > MAX_WINDOW:
        raise QuiverError(f"--window {args.window} is above the daemon's limit {MAX_WINDOW}",
                          hint="a window of 64-1024 bundles keeps a consumer busy")
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise QuiverError(f"--out {out_dir}: {exc.strerror}",
                              hint="--out names a directory to write the bundles' files into "
                              "(created when missing)") from exc
    timeout_s = args.timeout
    if timeout_s is None:
        timeout_s = DEFAULT_COUNT_TIMEOUT_S if args.count is not None else math.inf
    run = _Run()
    try:
        anyio.run(_consume, args, socket_path, out_dir, timeout_s, run, backend="asyncio")
    except BaseExceptionGroup as group:
        raise _sole(group) from None
    return _finish(args, run, timeout_s)


async def _consume(args: argparse.Namespace, socket_path: Path, out_dir: Path | None,
                   timeout_s: float, run: _Run) -> None:
    window = args.window if args.count is None else min(args.window, args.count)
    limiter = anyio.CapacityLimiter(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_on_signal, tg.cancel_scope, run)
        async with _attached(socket_path, args.name, window) as deliveries:
            # The deadline restarts with every delivery: "seconds without a delivery".
            with anyio.CancelScope(deadline=anyio.current_time() + timeout_s) as idle:
                async for bundle in deliveries:
                    idle.deadline = math.inf  # writing slowly is not being idle
                    await _handle(bundle, args, out_dir, limiter, run)
                    if args.count is not None and run.acked >= args.count:
                        run.stopped_by = "count"
                        break
                    idle.deadline = anyio.current_time() + timeout_s
                else:
                    run.stopped_by = "eof"
            if idle.cancelled_caught:
                run.stopped_by = "timeout"
        tg.cancel_scope.cancel()


@asynccontextmanager
async def _attached(socket_path: Path, name: str, window: int
                    ) -> AsyncIterator[AsyncIterator[ReceivedBundle]]:
    """``subscribe()``, with the errors a console user sees worded for a subscriber."""
    attached = False
    try:
        async with subscribe(socket_path, name, window=window) as deliveries:
            attached = True
            yield deliveries
    except ProtocolError as exc:
        if attached or exc.code != ErrorCode.UNKNOWN_SUBSCRIBER:
            raise
        raise QuiverError(str(exc), hint="see the registered names with "
                          "`quiverd subscribers list`") from exc
    except ShuttingDown as exc:
        # The daemon's message is worded for producers; say what it means for us.
        raise ShuttingDown("quiverd is shutting down; the subscription ended",
                           hint="bundles not acked are delivered again when you subscribe "
                           "to the restarted daemon") from exc


async def _handle(bundle: ReceivedBundle, args: argparse.Namespace, out_dir: Path | None,
                  limiter: anyio.CapacityLimiter, run: _Run) -> None:
    """Decode (and write) one bundle in a worker thread, report it, then ack it."""
    tables, files = await anyio.to_thread.run_sync(_decode_and_write, bundle, out_dir,
                                                   limiter=limiter)
    await bundle.ack()  # only now: the files above are durable
    rows = sum(t.num_rows for t in tables.values())
    run.acked += 1
    run.rows += rows
    shard, seg, idx = bundle.id
    if args.json:
        txn = bundle.txn
        print(json.dumps({
            "shard": shard, "segment_seq": seg, "bundle_index": idx, "client": bundle.client,
            "rows": rows, "slots": {str(k): t.num_rows for k, t in sorted(tables.items())},
            "ingestion_ts_ns": bundle.ingestion_ts_ns,
            "txn": None if txn is None else {"job_id": txn.job_id, "partition": txn.partition,
                                             "attempt": txn.attempt,
                                             "row_offset": txn.row_offset},
            **({"files": [str(f) for f in files]} if out_dir is not None else {}),
        }), flush=True)
    else:
        where = f"  files={len(files)}" if out_dir is not None else ""
        print(f"{shard}-{seg}-{idx}  client={bundle.client}  rows={rows}{where}", flush=True)


def _decode_and_write(bundle: ReceivedBundle, out_dir: Path | None
                      ) -> tuple[dict[int, pa.Table], list[Path]]:
    """Blocking: decode the slots and, with ``--out``, write each one durably."""
    tables = bundle.tables
    files: list[Path] = []
    if out_dir is None:
        return tables, files
    stem = "-".join(str(n) for n in bundle.id)
    for slot, table in sorted(tables.items()):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        path = out_dir / f"{stem}.slot{slot}.arrow"
        try:
            atomic_write(path, memoryview(sink.getvalue()))
        except OSError as exc:
            raise QuiverError(f"cannot write {path}: {exc.strerror}",
                              hint=f"bundle {stem} was not acked and is delivered again on the "
                              "next subscribe; fix the output directory and rerun") from exc
        files.append(path)
    return tables, files


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error a task group wrapped (the signal task never fails), for the CLI."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _stop_on_signal(scope: anyio.CancelScope, run: _Run) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            run.stopped_by, run.signum = f"signal {signum}", signum
            scope.cancel()
            return


def _finish(args: argparse.Namespace, run: _Run, timeout_s: float) -> int:
    summary = f"quiverd subscribe: acked {run.acked} bundles ({run.rows} rows) as {args.name!r}"
    if run.stopped_by == "eof":
        raise QuiverError(f"quiverd closed the subscriber connection after {run.acked} bundles",
                          hint="the daemon may be stopping; bundles not acked are "
                          "delivered again on the next subscribe")
    if run.stopped_by == "timeout" and args.count is not None:
        raise QuiverError(f"only {run.acked} of {args.count} bundles arrived; none for "
                          f"{timeout_s:g} s", hint="produce more data, or raise --timeout")
    reason = {"count": "", "timeout": f"; no delivery for {timeout_s:g} s"}.get(
        run.stopped_by, "; interrupted, bundles not acked are delivered again next time")
    print(summary + reason, file=sys.stderr)
    if run.signum == signal.SIGINT:
        return EXIT_SIGINT
    return 0
