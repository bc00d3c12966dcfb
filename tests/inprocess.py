"""A real daemon in the test process: ``serve`` on a thread of its own, no interpreter start.

The subprocess daemon (``tests.conftest.DaemonProcess``) costs about a CPU-second per
start in imports alone; most daemon tests never kill or signal theirs. This one runs the
same entry, ``quiverd.runtime.serve.serve``, with its config file, sockets, data
directory, LOCK, uvloop event loop and exit code, on a thread (``serve``'s
``in_process``): its log lines go to the same ``daemon.log`` (so ``log()`` and
``events()`` read the same JSON lines), ``stop()`` begins the graceful stop SIGTERM
begins and returns serve's exit code.

What it cannot do, and says so when asked: be killed or signalled (a test process
cannot lose one thread), fault rules that kill (``kill:``, they would SIGKILL pytest),
an environment of its own. structlog's configuration is process-wide, so one runs at a
time per test process (a second start is an error naming the way out:
``in_process=False``). After each stop (and a garbage collection: a subprocess's exit
closes everything, here only what is freed is) no file or socket under its root and no
child process of its event loop may be left; the fixture's teardown then checks that
every thread started meanwhile has ended (``check_threads``). Event loop descriptors are
not counted: OpenDAL's runtime (epoll, eventfd) is the process's, made once and shared
by every daemon after the first, as a library's state is meant to be; each daemon's own
loop is closed by ``anyio.run`` on a thread that must have ended.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any, NoReturn

from quiverd.kernel import config as config_mod
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.layout import DataDir
from quiverd.runtime.serve import EXIT_CONFIG, EXIT_FATAL, InProcess, serve
from tests.conftest import DaemonProcess

# The catalog database (catalog.sqlite, -wal, -shm): tests read it themselves, and
# pyiceberg's SQLAlchemy pool keeps its connections, so its descriptors are not the
# daemon's to answer for (its own connection is closed by Catalog.close at the stop).
CATALOG_DB = DataDir(Path("/")).catalog_db.name
THREADS_GRACE_S = 5.0  # anyio's idle workers end just after their loop: not a leak
_slot = threading.Lock()  # held by the one in-process daemon running in this process


class InProcessDaemon(DaemonProcess):
    """``DaemonProcess``'s interface over ``serve`` on a thread of the test process."""

    in_process = True

    def __init__(self, root: Path, settings: dict[str, Any]) -> None:
        super().__init__(root, settings, {})
        self.thread: threading.Thread | None = None
        self.code: int | None = None
        self.error: BaseException | None = None
        self._control: InProcess | None = None
        self._log_file: IO[str] | None = None
        self._fds_at_start: dict[int, tuple[int, int]] = {}
        self._children_left: list[int] = []

    @property
    def proc(self) -> NoReturn:
        _refuse("has no process (pid, signals, returncode)")

    @proc.setter
    def proc(self, value: subprocess.Popen[bytes] | None) -> None:
        assert value is None  # DaemonProcess.__init__'s "not started"

    def start(self, *, faults: str = "", wait: bool = True) -> InProcessDaemon:
        if self.running:
            raise RuntimeError("this in-process daemon is already running")
        if "kill:" in faults:
            _refuse(f"cannot run the fault rule {faults!r}: a kill: rule would SIGKILL pytest")
        if not _slot.acquire(blocking=False):
            raise RuntimeError(
                "another in-process daemon runs in this test process (structlog is configured "
                "process-wide, so one at a time): make this one with in_process=False")
        self._fds_at_start = {fd: identity for fd, (_, identity) in _open_fds().items()}
        self.socket.unlink(missing_ok=True)
        self._log_file = open(self.log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._control = InProcess(self._log_file, faults=faults)
        self.code = self.error = None
        self.thread = threading.Thread(target=self._serve, args=(self._control,),
                                       name=f"quiverd-serve-{self.root.name}", daemon=True)
        self.thread.start()
        if wait:
            self.wait_ready()
        return self

    def _serve(self, control: InProcess) -> None:
        """The CLI's ``_serve``: load the config (exit 78 when it is bad), then serve."""
        try:
            try:
                cfg = config_mod.load(self.config_path)
            except ConfigError as exc:
                print(f"quiverd: {exc}", file=control.log_file)
                self.code = EXIT_CONFIG
                return
            self.code = serve(cfg, in_process=control)
        except BaseException as exc:  # noqa: BLE001 - a bug in serve: stop() raises it
            self.error = exc
        # The event loop ran on this thread, so its child processes (the Iceberg
        # worker) are this thread's: none may outlive serve.
        with open("/proc/thread-self/children") as f:
            self._children_left = [int(pid) for pid in f.read().split()]

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def exited(self) -> int | None:
        if self.thread is not None and not self.thread.is_alive():
            return self._finish()
        return None

    def stop(self, timeout: float = 30) -> int:
        """A graceful stop (what SIGTERM begins); serve's exit code."""
        assert self.thread is not None and self._control is not None, "never started"
        self._control.stop()
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        """serve's exit code once it returned by itself (a fatal error) or was stopped."""
        assert self.thread is not None, "never started"
        self.thread.join(timeout)
        if self.thread.is_alive():
            # Where it is stuck (a task that ignores its cancellation at asyncio.run's end,
            # the default executor's join, a blocking call): seen once, not reproduced.
            frame = sys._current_frames().get(self.thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            raise AssertionError(f"in-process daemon still running after {timeout} s "
                                 f"(a thread cannot be killed):\n{self.log()[-3000:]}\n"
                                 f"its thread's stack:\n{stack[-4000:]}")
        return self._finish()

    def kill(self) -> None:
        _refuse("cannot be killed")

    def end(self) -> None:
        """At the test's end: stop it if it still runs (a thread cannot be killed)."""
        if self.running:
            self.stop()
        elif self._log_file is not None:
            self._finish()

    def _finish(self) -> int:
        """After serve returned: release the slot and the log, check for leaks, the code."""
        if self._log_file is None:
            assert self.code is not None
            return self.code  # finished before (wait_ready saw it exit)
        self._log_file.close()
        self._log_file = None
        self._control = None
        _slot.release()
        if self.error is not None:
            raise AssertionError(f"in-process serve raised:\n{self.log()[-3000:]}") \
                from self.error
        self._check_closed()
        assert self.code is not None
        return self.code

    def _check_closed(self) -> None:
        """Nothing of this daemon may stay open once serve returned and its objects were
        collected: a subprocess's exit closes everything, here only what is freed is."""
        gc.collect()  # its segment readers' maps, held in reference cycles, close now
        root = str(self.root)
        bound = _unix_socket_paths()
        with open("/proc/self/maps") as f:
            mapped = {fields[5].strip() for fields in (line.split(None, 5) for line in f)
                      if len(fields) == 6}
        left = []
        for fd, (target, identity) in _open_fds().items():
            if self._fds_at_start.get(fd) == identity:
                continue  # the test's own, open before the start (perhaps renamed since)
            if Path(target).name.startswith(CATALOG_DB):
                continue  # the test's own catalog readers (pyiceberg's SQLAlchemy pool)
            if self.code == EXIT_FATAL and target in mapped and "/wal/quiver.wal" in target:
                # Known, not mended: after a fatal durability error (every test of it
                # runs on the model file system) a read-only map of a WAL file that the
                # finalizer read back outlives serve in a test process, held at C level
                # (no Python object refers to it). A subprocess's exit frees it.
                continue
            if target.startswith(root + "/") or bound.get(target, "").startswith(root + "/"):
                left.append(f"fd {fd} -> {target} {bound.get(target, '')}".rstrip())
        if left or self._children_left:
            raise AssertionError(f"the in-process daemon in {root} left open: {left}; "
                                 f"child processes left: {self._children_left}")


def check_threads(before: set[threading.Thread], grace_s: float = THREADS_GRACE_S
                  ) -> None:
    """Every thread started since ``before`` has ended (a short grace for anyio's idle
    workers, which end just after their loop); fail naming those that did not.

    pyiceberg's pool is not counted: the test's own Iceberg reads start it, and it is the
    process's for good (``ExecutorFactory``), whoever started it.
    """
    shared = before | _pyiceberg_pool()
    deadline = time.monotonic() + grace_s
    for thread in threading.enumerate():
        if thread not in shared:
            thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in threading.enumerate() if t not in shared]
    if left:
        raise AssertionError(f"threads left running after the in-process daemons stopped: {left}")


def _pyiceberg_pool() -> set[threading.Thread]:
    concurrent = sys.modules.get("pyiceberg.utils.concurrent")
    pool = concurrent.ExecutorFactory._instance if concurrent is not None else None
    return set(getattr(pool, "_threads", ()))


def _refuse(what: str) -> NoReturn:
    raise TypeError(f"an in-process daemon {what}: make it with in_process=False "
                    "(a subprocess) in a test that kills, signals or needs its own process")


def _open_fds() -> dict[int, tuple[str, tuple[int, int]]]:
    """fd -> (what it points to, its (device, inode))."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
            out[int(name)] = (os.readlink(f"/proc/self/fd/{name}"), (st.st_dev, st.st_ino))
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor among them)
    return out


def _unix_socket_paths() -> dict[str, str]:
    """``socket:[inode]`` -> the path it is bound to (accepted sockets show the listener's)."""
    out = {}
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8:
                out[f"socket:[{fields[6]}]"] = fields[7]
    return out
