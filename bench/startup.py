"""Startup time against retained segment bytes: exec of ``quiverd serve`` to ready.

    python bench/startup.py [--sizes-gb 0,1,10,100] [--sparse-above-gb 40] [--repeat 3]
                            [--v1-up-to-gb 10] [--shards 2] [--root DIR] [--json out.json]

For each size, a data directory holding that many GB (10^9 bytes) of finalized
segments, split evenly over the shards, with an empty WAL; each timed start follows
``sync`` and ``echo 3 > /proc/sys/vm/drop_caches`` (cold page cache: run as root) and
is timed from the spawn of ``python -m quiverd serve`` until the admin socket answers
(it is served last, right before READY; the sockets themselves listen from before
recovery: ``bench._common.Daemon``).

How the bytes are made (fast, and said so in the output):
- one template segment of ~32 MiB (the default ``segment.target_size_bytes``):
  128 logs-like bundles of ~256 KiB written with ``encode_segment`` + ``write_segment``;
- ``copy``: the template written again under new segment numbers, every byte real,
  up to ``--sparse-above-gb``;
- ``sparse``: above it (the disk here has ~70 GB free), each file has the template's
  size, but only its metadata (directory, manifest, footer, trailer) is written: the
  stream bytes are a hole. Startup reads only the metadata of a version 2 segment, so
  it sees the same bytes either way; the whole-file CRC of such a file fails, so the
  scrubber is off (``scrub.rate_mb_per_s = 0``) and the lake (whose uploader would
  read) too, in every run; no subscriber is registered, so nothing reads a segment.
- ``v1``: the same copies rewritten as format version 1 (34-byte footer, no metadata
  CRC): startup must CRC every byte, as every segment did before version 2.

Every copy holds the template's WAL sequence numbers (recovery accepts overlapping
ranges); no FLOOR, DELETED or ack.log is written: an untimed first start registers the
segments (ack.log SEGMENT records, FLOOR raised), then the timed starts run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Daemon, git_head, make_table  # noqa: E402
from quiverd.kernel.bundle import Bundle, make_slot  # noqa: E402
from quiverd.kernel.crc import crc32c  # noqa: E402
from quiverd.kernel.layout import DataDir  # noqa: E402
from quiverd.segments.files import write_segment  # noqa: E402
from quiverd.segments.format import SEGMENT_MODE, encode_segment  # noqa: E402
from quiverd.segments.open_segment import OpenSegment  # noqa: E402
from quiverd.segments.reader import SegmentReader  # noqa: E402

GB = 10**9
BUNDLES = 128
BUNDLE_BYTES = 256 * 1024
# No reader: the scrubber off, no uploader (the lake's subscriber would read, upload,
# ack, and the gc would delete the segments between runs).
SETTINGS = {"scrub.rate_mb_per_s": 0, "lake.enabled": False, "log.level": "info"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-gb", default="0,1,10,100")
    ap.add_argument("--sparse-above-gb", type=float, default=40.0)
    ap.add_argument("--v1-up-to-gb", type=float, default=10.0,
                    help="also time format version 1 copies up to this size (0: never)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: each start needs a cold page cache (drop_caches)")
    work = Path(tempfile.mkdtemp(prefix="qd-startup-", dir=args.root))
    results = []
    try:
        template = make_template(work / "template.qseg")
        size = template.stat().st_size
        print(f"template segment: {size} bytes, {BUNDLES} bundles; shards={args.shards}; "
              f"cold cache per start; quiverd {git_head()}")
        print(f"{'GB':>6} {'segments':>8} {'kind':>6} {'ready_s (each)':>24} {'median_s':>9}")
        for gb in [float(x) for x in args.sizes_gb.split(",")]:
            kinds = ["sparse" if gb > args.sparse_above_gb else "copy"]
            if 0 < gb <= args.v1_up_to_gb:
                kinds.append("v1")
            for kind in kinds:
                results.append(run_size(work, template, gb, kind, args))
                row = results[-1]
                each = " ".join(f"{t:.2f}" for t in row["ready_s"])
                print(f"{gb:>6g} {row['segments']:>8} {kind:>6} {each:>24} "
                      f"{row['median_s']:>9.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"git": git_head(), "runs": results}, indent=2))


def make_template(path: Path) -> Path:
    table, _ = make_table(BUNDLE_BYTES)
    segment = OpenSegment()
    for i in range(BUNDLES):
        segment.add(Bundle(client=f"app{i % 4}", slots=(make_slot(0, table),),
                           ingestion_ts_ns=time.time_ns(), sequence=i + 1))
    write_segment(path, encode_segment(segment, max_dictionary_cardinality=1 << 20))
    return path


def run_size(work: Path, template: Path, gb: float, kind: str,
             args: argparse.Namespace) -> dict[str, object]:
    directory = work / f"{kind}-{gb:g}"
    count = int(gb * GB // template.stat().st_size)
    generate(directory / "data", template, count, kind, args.shards)
    first = Daemon(args.root, policy=None, shards=args.shards, settings=SETTINGS,
                   directory=directory, tag="register")
    assert first.stop() == 0, first.log_tail()
    times = []
    for i in range(args.repeat):
        drop_caches()
        d = Daemon(args.root, policy=None, shards=args.shards, settings=SETTINGS,
                   directory=directory, tag=f"run{i}")
        times.append(d.ready - d.spawned)
        assert d.stop() == 0, d.log_tail()
    quarantined = list((directory / "data").glob("shard-*/quarantine/*.qseg"))
    assert not quarantined, f"{len(quarantined)} segments quarantined: the bench is broken"
    left = len(list((directory / "data").glob("shard-*/segments/*.qseg")))
    assert left == count, f"{count} segments generated, {left} left: the bench is broken"
    shutil.rmtree(directory)
    return {"gb": gb, "kind": kind, "segments": count, "segment_bytes": template.stat().st_size,
            "ready_s": times, "median_s": statistics.median(times)}


def generate(data_dir: Path, template: Path, count: int, kind: str, shards: int) -> None:
    """``count`` segments numbered 1..count, dealt round-robin over the shards."""
    raw = template.read_bytes()
    with SegmentReader.open(template) as reader:
        meta_start = reader.footer.directory_offset
    if kind == "v1":
        raw = as_version_1(raw)
    layout = DataDir(data_dir)
    for s in range(shards):
        for d in layout.shard(s).directories():
            d.mkdir(parents=True, exist_ok=True)
    for seq in range(1, count + 1):
        path = layout.shard(seq % shards).segment(seq)
        with open(path, "wb") as f:
            if kind == "sparse":
                f.truncate(len(raw))
                f.seek(meta_start)
                f.write(raw[meta_start:])
            else:
                f.write(raw)
        os.chmod(path, SEGMENT_MODE)
    subprocess.run(["sync"], check=True)


def as_version_1(raw: bytes) -> bytes:
    """Format version 1's tail: a 34-byte footer without metadata CRC."""
    fields = struct.unpack("<HIIQIQII", raw[-16 - 38:-16])
    body = (raw[:-16 - 38] + struct.pack("<HIIQIQI", 1, *fields[1:7])
            + struct.pack("<I8s", 34, b"QUIVER\0S"))
    return body + struct.pack("<I", crc32c(body))


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


if __name__ == "__main__":
    main()
