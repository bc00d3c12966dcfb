"""Run by the interpreter of a plain install (scripts/install), not by the suite's: every
module the daemon can import must import there, and the daemon must start, ack, put the
rows in the lake and stop on the installed default config.

    /opt/quiverd/bin/python installed_smoke.py CONFIG WORK_DIR

Only the standard library, pyarrow and the installed quiverd are used, so a dependency
that only the test extras bring (numpy came with the bench extra once) fails here.
Prints ``ok`` and exits 0, or exits 1 naming what failed.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROWS = 1000
TIMEOUT_S = 60.0
# quiverd.spark needs the spark extra (pyspark, pandas), which a service install lacks.
OPTIONAL = ("quiverd.spark",)


def main(config: Path, work: Path) -> int:
    import_everything()
    bin_dir = Path(sys.executable).parent
    quiverd = [str(bin_dir / "quiverd")]
    data_dir = Path(_data_dir(config))
    arrow = work / "rows.arrow"
    _write_rows(arrow)
    log = (work / "daemon.log").open("wb")
    daemon = subprocess.Popen([*quiverd, "serve", "--config", str(config)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: (data_dir / "admin.sock").exists() or daemon.poll() is not None,
              "the daemon's admin socket")
        if daemon.poll() is not None:
            return _fail(f"the daemon exited {daemon.returncode} at start", work)
        subprocess.run([*quiverd, "send", "--socket", str(data_dir / "ingest.sock"),
                        "--client", "smoke", str(arrow)], check=True, timeout=TIMEOUT_S)
        _wait(lambda: _lake_rows(quiverd, config) >= ROWS, f"{ROWS} rows in the lake")
        if (got := _lake_rows(quiverd, config)) != ROWS:
            return _fail(f"the lake holds {got} rows, {ROWS} sent", work)
        _wait(lambda: _iceberg_rows(data_dir) >= ROWS, f"{ROWS} rows in the Iceberg table")
        if (got := _iceberg_rows(data_dir)) != ROWS:
            return _fail(f"the Iceberg table holds {got} rows, {ROWS} sent", work)
        subprocess.run([*quiverd, "status", "--config", str(config)], check=True,
                       timeout=TIMEOUT_S, stdout=subprocess.DEVNULL)
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=TIMEOUT_S)
    if rc != 0:
        return _fail(f"the daemon exited {rc} after SIGTERM", work)
    print("ok")
    return 0


def import_everything() -> None:
    import quiverd
    import quiverd_actors

    for package in (quiverd, quiverd_actors):
        for mod in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not mod.name.startswith(OPTIONAL):
                importlib.import_module(mod.name)


def _data_dir(config: Path) -> str:
    import tomllib

    return str(tomllib.loads(config.read_text())["data_dir"])


def _write_rows(path: Path) -> None:
    import pyarrow as pa

    table = pa.table({"id": pa.array(range(ROWS), pa.int64()),
                      "msg": pa.array([f"row {i}" for i in range(ROWS)])})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)


def _lake_rows(quiverd: list[str], config: Path) -> int:
    out = subprocess.run([*quiverd, "files", "list", "--config", str(config), "--client",
                          "smoke", "--json"], capture_output=True, text=True, check=True,
                         timeout=TIMEOUT_S).stdout
    return sum(int(f["row_count"]) for f in json.loads(out))


def _iceberg_rows(data_dir: Path) -> int:
    """Rows in the projection's table quiver.smoke, read as an outside engine would
    (docs/iceberg.md); 0 while the table does not exist yet."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import NoSuchTableError
    from sqlalchemy.exc import OperationalError

    # A reader does not create the catalog's tables (docs/iceberg.md): racing the
    # daemon's projection creating them, pyiceberg's own CREATE TABLE failed with
    # "table iceberg_tables already exists" in a parallel run.
    catalog = SqlCatalog("quiverd", uri=f"sqlite:///{data_dir / 'catalog.sqlite'}",
                         warehouse=f"file://{data_dir / 'objects'}",
                         init_catalog_tables="false")
    try:
        return int(catalog.load_table(("quiver", "smoke")).scan().to_arrow().num_rows)
    except NoSuchTableError:
        return 0
    except OperationalError as exc:
        if "no such table" in str(exc):
            return 0  # the projection has not created the catalog's tables yet
        raise


def _wait(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"installed_smoke: no {what} after {TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def _fail(why: str, work: Path) -> int:
    print(f"installed_smoke: {why}; daemon log:", file=sys.stderr)
    sys.stderr.write((work / "daemon.log").read_text(errors="replace")[-4000:])
    return 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
