"""``quiverd send``: stream Arrow IPC or Parquet files to the daemon, one bundle per batch.

Prints a summary (and each ack with ``--json``); on a TTY a progress line on
stderr shows files, bundles, rows and MB/s. A bundle the daemon refused stops
the command with its error and a non-zero exit; everything acked before it is
durable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TextIO

from quiverd.client.files import FileSplit, check_arrow_file
from quiverd.client.producer import FileProgress, send_files
from quiverd.kernel.errors import QuiverError
from quiverd.kernel.names import client_name_problem, reserved_column_problem


class _ProgressLine:
    def __init__(self, total_bytes: int, out: TextIO) -> None:
        self.total_bytes, self.out = total_bytes, out
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.bundles = self.rows = 0
        self.files: set[str] = set()

    def update(self, p: FileProgress) -> None:
        self.bundles += 1
        self.rows += p.rows
        self.files.add(p.path)
        now = time.monotonic()
        if now - self.last_draw >= 0.1:
            self.last_draw = now
            self.draw(p.path)

    def draw(self, current: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.out.write(f"\r{len(self.files)} files  {self.bundles} bundles  {self.rows} rows  "
                       f"{self.rows / elapsed:,.0f} rows/s  {os.path.basename(current)[:40]:<40}")
        self.out.flush()

    def finish(self) -> None:
        self.out.write("\n")
        self.out.flush()


def send_files_cli(args: argparse.Namespace) -> int:
    problem = client_name_problem(args.client)
    if problem is not None:
        raise QuiverError(f"--client: {problem}",
                          hint="the client name is the lake's client= prefix: letters, digits, "
                          "'.', '_' and '-', at most 255")
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        raise QuiverError(f"no such file: {', '.join(missing)}",
                          hint="pass Arrow IPC (file or stream) or Parquet files")
    empty = [f for f in args.files if os.path.getsize(f) == 0]
    if empty:
        raise QuiverError(f"empty file: {', '.join(empty)}",
                          hint="pass Arrow IPC (file or stream) or Parquet files")
    for f in args.files:
        # Before connecting: a bad file changes nothing on the daemon.
        problem = reserved_column_problem(check_arrow_file(f).names)
        if problem is not None:
            raise QuiverError(f"{f}: {problem}", hint="quiverd adds these columns itself; "
                              "rename the file's column (nothing was sent)")
    total = sum(os.path.getsize(f) for f in args.files)
    bar = _ProgressLine(total, sys.stderr) if sys.stderr.isatty() and not args.json else None
    acks = 0
    started = time.monotonic()

    def progress(p: FileProgress) -> None:
        if bar is not None:
            bar.update(p)
        if args.json:
            print(json.dumps({"file": p.path, "batch": p.batch_index, "rows": p.rows,
                              "shard": p.ack.shard, "sequence": p.ack.sequence}))

    splits: list[FileSplit] = []
    try:
        for _ in send_files(args.socket, args.files, client=args.client, progress=progress,
                            splits=splits, producer_id=args.producer_id):
            acks += 1
    finally:
        if bar is not None:
            bar.finish()
    if not args.json:
        elapsed = time.monotonic() - started
        for split in splits:
            print(split.describe())
        print(f"sent {acks} bundles from {len(args.files)} files in {elapsed:.2f}s; "
              "every one acknowledged durable")
    return 0
