"""A ``quiverd`` command that used OpenDAL ends with its own exit status, never -6.

OpenDAL's tokio workers can still be on their way back into Python (the self-pipe
write that wakes the event loop) when the command returns; if the interpreter is
finalizing by then CPython 3.11 ends such a thread with ``pthread_exit`` and glibc
aborts (quiverd/cli/process_exit.py). Before the fix ``fsck --lake`` and ``files list``
died with SIGABRT in about 1 run of 20 with three commands side by side on two busy
cores; the test runs them up to 60 times (15 s at most), three at once (the load
makes the race likely).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.lake_damage import send_files
from tests.daemon.lake_helpers import FAST_LAKE

pytestmark = pytest.mark.timeout(120)

RUNS = 60
SIDE_BY_SIDE = 3
BUDGET_S = 15.0


def test_lake_commands_never_abort_at_exit(daemon_factory: Any) -> None:
    d = daemon_factory({**FAST_LAKE, "shards": 1}, in_process=True).start()
    (row,) = send_files(d, 1)
    assert d.stop() == 0
    cli = [sys.executable, "-m", "quiverd"]
    # fsck takes the data directory's lock: one at a time, `files list` beside it.
    fsck = [*cli, "fsck", str(d.data_dir), "--lake", "--no-crc"]
    files = [*cli, "files", "list", "--config", str(d.config_path)]
    codes: list[int] = []
    deadline = time.monotonic() + BUDGET_S
    while len(codes) < RUNS and time.monotonic() < deadline:
        runs = [(fsck, "lake healthy")] + [(files, row.file_id)] * (SIDE_BY_SIDE - 1)
        procs = [(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True), shows) for argv, shows in runs]
        for p, shows in procs:
            out, err = p.communicate(timeout=60)
            codes.append(p.returncode)
            assert p.returncode == 0, (p.returncode, out, err)  # -6 was SIGABRT at exit
            assert shows in out, out  # the whole output came before the exit
    assert len(codes) >= 2 * SIDE_BY_SIDE, codes  # the budget allowed a real loop


def test_exit_process_runs_atexit_and_flushes_before_os_exit(tmp_path: Path) -> None:
    """The OpenDAL path skips finalization: atexit handlers and buffered output must
    still happen, and the code is the command's."""
    script = ("import atexit, sys, opendal\n"
              "from quiverd.cli.process_exit import exit_process\n"
              "atexit.register(lambda: print('atexit ran'))\n"
              "sys.stdout.write('buffered, no newline')\n"
              "exit_process(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newlineatexit ran\n"
