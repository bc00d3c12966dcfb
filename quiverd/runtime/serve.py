"""The process around the daemon: logging, the data directory and its LOCK, the event
loop, and the exit code systemd acts on.

    0   clean stop
    2   another quiverd holds the data directory or listens on a socket path (found
        before any recovery work: see ``claim``)
    70  a durability error (fdatasync/fsync/I/O): systemd restarts, replay recovers
    75  a stop outlasted shutdown_timeout_ms: what was left is in the WAL (logged as
        ``shutdown_timed_out``), the next start's replay recovers it; the unit lists 75
        in SuccessExitStatus, so a stop that timed out is not a failure
    78  a configuration error: not restarted until the config is fixed
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import faulthandler
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import anyio

from quiverd.kernel import faults, logs
from quiverd.kernel.config import Config
from quiverd.kernel.errors import AlreadyRunning, ConfigError, DurabilityLost, QuiverError
from quiverd.kernel.faults import Hooks
from quiverd.net.admin import ADMIN_SOCKET_MODE
from quiverd.net.rawsock import BoundSocket, bind_unix, unlink_if_ours
from quiverd.runtime.daemon import Daemon
from quiverd.runtime.lockfile import lock_data_dir

EXIT_FATAL = 70  # EX_SOFTWARE: systemd's Restart=on-failure restarts us
EXIT_STOP_TIMED_OUT = 75  # EX_TEMPFAIL: nothing acked is lost, the next start finishes
EXIT_CONFIG = 78  # EX_CONFIG: the unit's RestartPreventExitStatus=78 stops a restart loop


GIL_SWITCH_INTERVAL_S = 0.0005


def gil_switch_interval_s(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """0.5 ms, or ``QUIVERD_GIL_SWITCH_S`` (seconds, for measurements) if it is a number
    in (0, 1]; anything else keeps the default rather than failing the start."""
    try:
        value = float(env.get("QUIVERD_GIL_SWITCH_S", GIL_SWITCH_INTERVAL_S))
    except ValueError:
        return GIL_SWITCH_INTERVAL_S
    return value if 0 < value <= 1 else GIL_SWITCH_INTERVAL_S


def serve(cfg: Config, *, fault_hooks: Hooks | None = None,
          in_process: InProcess | None = None) -> int:
    """Run the daemon until shut down; return the process exit code.

    ``in_process``: run inside another program's thread instead of owning the process
    (the test suite's in-process daemons): no signal handlers, the stop comes from
    ``in_process.stop()``, the log goes to ``in_process.log_file``, and what is
    process-wide (the switch interval, structlog) is put back on return.
    """
    if in_process is None:
        # A fatal signal (SIGBUS from a mapped file, SIGSEGV, SIGFPE, SIGABRT, SIGILL)
        # kills the process before any Python handler runs: without this it leaves no
        # line at all, and systemd restarts it silently. faulthandler writes "Fatal
        # Python error" and every thread's stack to stderr (journald), then lets the
        # signal kill us.
        faulthandler.enable(file=sys.stderr, all_threads=True)
        # The WAL's writer and syncer threads hand the GIL back and forth with the
        # event loop on every commit; CPython's default 5 ms switch interval makes a
        # thread that returns from fdatasync wait up to 5 ms for a busy loop
        # (bench/choices.py).
        sys.setswitchinterval(gil_switch_interval_s())
        logs.configure(cfg.log.format, cfg.log.level)
        return _serve(cfg, fault_hooks, None)
    # Inside another program its faulthandler stays as it is (pytest has its own); the
    # daemon's switch interval and log hold only while it runs.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(gil_switch_interval_s())
    try:
        with logs.configured(cfg.log.format, cfg.log.level, file=in_process.log_file):
            return _serve(cfg, fault_hooks, in_process)
    finally:
        sys.setswitchinterval(previous)


class InProcess:
    """What ``serve`` needs to run in a thread of another program: where its log goes,
    its fault rules (``$QUIVERD_FAULTS`` syntax, the program's own environment is not
    read), and ``stop()``, callable from any thread, which begins the graceful stop
    SIGTERM begins in a daemon of its own."""

    def __init__(self, log_file: TextIO, *, faults: str = "") -> None:
        self.log_file = log_file
        self.faults = faults
        self._lock = threading.Lock()
        self._stop_requested = False
        self._wake: Callable[[], object] | None = None

    def stop(self) -> None:
        with self._lock:  # held while waking, so the loop cannot close in between
            self._stop_requested = True
            if self._wake is not None:
                self._wake()

    async def run(self, daemon: Daemon) -> None:
        """``daemon.run()`` with its stop event set by ``stop()`` (on this loop)."""
        event = daemon.stop = anyio.Event()
        loop = asyncio.get_running_loop()
        with self._lock:
            self._wake = partial(loop.call_soon_threadsafe, event.set)
            if self._stop_requested:
                event.set()
        try:
            await daemon.run()
        finally:
            with self._lock:
                self._wake = None


def _serve(cfg: Config, fault_hooks: Hooks | None, in_process: InProcess | None) -> int:
    log = logs.get("daemon")
    environ = None if in_process is None else {faults.ENV: in_process.faults}
    if fault_hooks is None:
        fault_hooks = faults.from_env(environ)
    if fault_hooks:
        log.warning("quiverd_fault_injection_active",
                    rules=faults.describe(fault_hooks, environ))
    if cfg.wal.flush_policy == "never":
        log.warning("wal_flush_policy_never", hint="acks do not mean durable: tests only")
    with contextlib.ExitStack() as held:
        try:
            if cfg.lake.enabled:  # imported only then: OpenDAL and Parquet cost ~30 MB of RSS
                from quiverd.lake.tier import check_config as check_lake_config

                check_lake_config(cfg)  # before anything starts: a typo exits 78, not after ready
            daemon = Daemon(cfg, faults=fault_hooks, bound=claim(cfg, held),
                            handle_signals=in_process is None)
            main = daemon.run if in_process is None else partial(in_process.run, daemon)
            anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
        except BaseExceptionGroup as group:
            return _report_fatal(group, log)
        except (QuiverError, OSError) as exc:  # raised outside any task group
            return _report_fatal(BaseExceptionGroup("quiverd", [exc]), log)
    if daemon.stopping and _timed_out(daemon):
        for shard in (s for s in daemon.shards if s.unfinished):
            log.warning("shutdown_timed_out", timeout_ms=cfg.shutdown_timeout_ms,
                        **shard.left_at_stop(), hint="every acknowledged bundle is in the "
                        "WAL: the next start replays it; raise shutdown_timeout_ms to drain")
        return EXIT_STOP_TIMED_OUT
    return 0


def claim(cfg: Config, held: contextlib.ExitStack) -> dict[Path, BoundSocket]:
    """Take what one daemon alone may hold, before any recovery work; ``held`` releases it.

    The data directory's LOCK (an existing directory first, so the same daemon started
    twice is told which pid holds it), the sockets outside the data directory, then a
    missing data directory is created and locked, then the sockets inside it (the
    default ones). Each socket listens from here on: connections wait in its backlog
    until the daemon is ready. A daemon refused here (exit 2) has recovered nothing,
    and one refused for a busy socket has not created a data directory.
    """
    data_dir = Path(cfg.data_dir)
    modes = {cfg.ingest_socket: (cfg.ingest.socket_mode, "ingest.socket_path"),
             cfg.admin_socket: (ADMIN_SOCKET_MODE, "admin.socket_path")}
    bound: dict[Path, BoundSocket] = {}

    def lock() -> None:
        open_data_dir(data_dir)
        held.callback(os.close, lock_data_dir(data_dir))

    def listen(inside_data_dir: bool) -> None:
        for path, (mode, key) in modes.items():
            if path.is_relative_to(data_dir) == inside_data_dir:
                bound[path] = held.enter_context(_listening(path, mode, key))

    existed = data_dir.is_dir()
    if existed:
        lock()
    listen(inside_data_dir=False)
    if not existed:
        lock()
    listen(inside_data_dir=True)
    return bound


@contextlib.contextmanager
def _listening(path: Path, mode: int, key: str) -> Iterator[BoundSocket]:
    """``bind_unix``, closed and unlinked (while still ours) on the way out. The servers
    do the same at a clean stop; this covers a daemon that never got that far."""
    bound = bind_unix(path, mode, key=key)
    try:
        yield bound
    finally:
        bound.sock.close()
        unlink_if_ours(path, bound.identity)


def open_data_dir(data_dir: Path) -> Path:
    """Create ``data_dir`` if its parent exists; refuse what would hide a typo.

    A missing parent is a config error, not something to create: a mistyped path
    would otherwise become a new, empty store while the real one waits elsewhere.
    """
    parent = data_dir.parent
    if not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist"
        raise ConfigError("data_dir", f"{data_dir}: its parent {parent} {what}",
                          hint="fix a typo in data_dir, or create the parent directory "
                          "(the systemd unit's StateDirectory= does it for /var/lib/quiverd)")
    try:
        data_dir.mkdir(exist_ok=True)
    except FileExistsError:
        raise ConfigError("data_dir", f"{data_dir} exists and is not a directory") from None
    except PermissionError as exc:
        raise ConfigError("data_dir", f"permission denied creating {data_dir}",
                          hint="run quiverd as the user that owns data_dir's parent, or create "
                          "data_dir for it (systemd: User=quiverd, StateDirectory=quiverd)") \
            from exc
    if not os.access(data_dir, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError("data_dir", f"permission denied on {data_dir}",
                          hint="run quiverd as the user that owns data_dir (systemd: User=quiverd)")
    return data_dir


def _timed_out(daemon: Daemon) -> bool:
    return any(s.unfinished for s in daemon.shards)


def _report_fatal(group: BaseExceptionGroup[BaseException], log: Any) -> int:
    """Log the first fatal error with its hint (one event); re-raise anything that is a bug.

    A durability loss, and any I/O error nothing handled (the state on disk is then
    unknown), is ``quiverd_fatal_durability`` and exit 70: systemd restarts quiverd
    and replay recovers what was durable. Never a bare traceback.
    """
    durability: BaseExceptionGroup[BaseException] | None
    durability, rest = group.split(DurabilityLost)
    if durability is None and rest is not None:
        durability, rest = rest.split(OSError)
    if durability is not None:
        exc: BaseException = _first(durability)
        log.critical("quiverd_fatal_durability", error=str(exc), **_io_fields(exc),
                     hint=getattr(exc, "hint", "") or DurabilityLost.hint)
        return EXIT_FATAL
    known, bugs = group.split(QuiverError)
    if known is None:
        raise group
    exc = _first(known)
    hint = getattr(exc, "hint", "")
    log.error("quiverd_failed", error=str(exc), hint=hint)
    print(f"quiverd: {exc}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    if isinstance(exc, AlreadyRunning):
        return 2
    return EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FATAL


def _io_fields(exc: BaseException) -> dict[str, Any]:
    """errno and file of the OSError behind ``exc`` (itself or its cause), if any."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    if not isinstance(cause, OSError):
        return {}
    fields: dict[str, Any] = {"errno": errno.errorcode.get(cause.errno or 0, cause.errno)}
    if cause.filename is not None:
        fields["path"] = str(cause.filename)
    if isinstance(exc, OSError):
        fields["unexpected"] = True  # no code path mapped it: a gap worth reporting
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:  # where, so the report can name the code path (no full traceback)
            last = frames[-1]
            fields["at"] = f"{Path(last.filename).name}:{last.lineno} in {last.name}"
            inner = [f for f in frames if "quiverd" in f.filename]
            if inner and inner[-1] is not last:
                fields["from"] = f"{Path(inner[-1].filename).name}:{inner[-1].lineno}"
    return fields


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
