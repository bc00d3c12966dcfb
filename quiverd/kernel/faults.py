"""Fault hooks for crash and durability tests, set with $QUIVERD_FAULTS.

Only faults that cannot be made real on demand live here (a full disk and a power
cut are made real by the tests). The variable holds ``;``-separated rules,
``<point>=<action>``:

    wal.fdatasync=eio@3          the 3rd WAL fdatasync fails with EIO
    wal.write=enospc@2-4         the 2nd to 4th WAL writes find no space
    finalize.tmp_written=eio@1+  every segment temp-file write fails, from the 1st on
    finalize=eio:dir_fsynced     shorthand for finalize.dir_fsynced=eio@1
    wal.fdatasync=gate:/tmp/g    every WAL fdatasync waits while /tmp/g exists
    finalize=kill:renamed        the process dies (SIGKILL) right after that step
    finalize=raise:encode_sequence_7   encoding a segment holding bundle 7 raises
                                 RuntimeError (a bundle the encoder refuses)

Errors: ``eio``, ``enospc``, ``edquot``. A step fails *at* the hook, which runs
right after the real step, so a rule on step S stands for "S failed".

Points (component.step):

    wal        write, fdatasync, rotate_dir_fsync, sidecar_tmp_written,
               sidecar_tmp_fsynced, sidecar_renamed, sidecar_dir_fsynced,
               sidecar_written, unlink_dir_fsync
    finalize   tmp_written, tmp_fsynced, renamed, dir_fsynced (the segment file),
               encode_sequence_<n> (before encoding a segment that holds bundle n),
               floor_tmp_written ... floor_dir_fsynced, floor_written
    acklog     fdatasync
    gc         marker_tmp_written ... marker_dir_fsynced (the DELETED marker),
               unlinked_first, unlinked, dir_fsynced (a deletion batch's files)
    lake       received, appended, rotated, object_written, uploaded, registered, acked,
               indexed, evicted (after that lifecycle step of a lake file; e.g.
               ``lake=kill:registered``), dead_letter_written, dead_letter_committed
               (after a dead letter's object is in the store / in its Iceberg table)

Hooks run in worker threads, never on the event loop. The daemon logs a
warning at startup when any rule is active.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable

ENV = "QUIVERD_FAULTS"
GATE_POLL_S = 0.002
ERRORS = {"eio": errno.EIO, "enospc": errno.ENOSPC, "edquot": errno.EDQUOT}
# The steps of kernel.durable.atomic_write, in order; after "renamed" the new file is
# in place, so a later failure leaves the durable state unknown.
ATOMIC_STEPS = ("tmp_written", "tmp_fsynced", "renamed", "dir_fsynced")

Hook = Callable[[str], None]  # called with the step just reached, in a worker thread
Hooks = dict[str, Hook]  # by component: "wal", "finalize", "acklog"


def from_env(environ: dict[str, str] | None = None) -> Hooks:
    """Parse $QUIVERD_FAULTS into {"wal": hook, "finalize": hook, ...}."""
    spec = (environ if environ is not None else dict(os.environ)).get(ENV, "")
    rules: dict[str, list[Callable[[str], None]]] = {}
    for rule in filter(None, (r.strip() for r in spec.split(";"))):
        point, _, action = rule.partition("=")
        component, _, step = point.partition(".")
        rules.setdefault(component, []).append(_hook(step, action, rule))
    return {component: _chain(hooks) for component, hooks in rules.items()}


def _hook(step: str, action: str, rule: str) -> Callable[[str], None]:
    kind, _, arg = action.partition(":")
    name, _, when = kind.partition("@")
    if name in ERRORS:
        return _error_hook(arg or step, ERRORS[name], _calls(when or "1", rule), rule)
    if kind == "gate":
        def gate(at: str) -> None:
            if at == step:
                while os.path.exists(arg):
                    time.sleep(GATE_POLL_S)
        return gate
    if kind == "raise":
        def refuse(at: str) -> None:
            if at == arg:
                raise RuntimeError(f"injected by {ENV}: {rule}")
        return refuse
    if kind == "kill":
        def kill(at: str) -> None:
            if at == arg:
                os.kill(os.getpid(), signal.SIGKILL)
        return kill
    raise ValueError(f"{ENV}: cannot parse rule {rule!r}")


def _calls(when: str, rule: str) -> tuple[int, float]:
    """``3`` -> the 3rd call; ``2-4`` -> calls 2..4; ``2+`` -> the 2nd and every later one."""
    try:
        if when.endswith("+"):
            return int(when[:-1]), float("inf")
        first, _, last = when.partition("-")
        return int(first), int(last or first)
    except ValueError:
        raise ValueError(f"{ENV}: bad call number {when!r} in rule {rule!r}") from None


def _error_hook(step: str, code: int, calls: tuple[int, float], rule: str) -> Hook:
    first, last = calls
    count = {"n": 0}
    lock = threading.Lock()  # shards' worker threads share one hook

    def fail(at: str) -> None:
        if at != step:
            return
        with lock:
            count["n"] += 1
            n = count["n"]
        if first <= n <= last:
            raise OSError(code, f"{os.strerror(code)} (injected by {ENV}: {rule})")
    return fail


def _chain(hooks: list[Callable[[str], None]]) -> Callable[[str], None]:
    def run(at: str) -> None:
        for h in hooks:
            h(at)
    return run


def prefixed(hook: Hook | None, prefix: str) -> Hook | None:
    """The same hook with every step named ``<prefix><step>`` (``floor_tmp_written``)."""
    if hook is None:
        return None
    return lambda step: hook(prefix + step)


class StepTracker:
    """Wraps a Hook passed to ``atomic_write``: remembers the last step that completed.

    A step counts as completed only once the wrapped hook returned, so a fault rule
    on step S reads as "S failed". ``renamed`` tells whether the new file may already
    be in place: a failure before the rename touched only a temp file (a retry
    writes a fresh one), a failure after it leaves the durable state unknown.
    """

    def __init__(self, hook: Hook | None = None) -> None:
        self.hook = hook
        self.reached: str | None = None

    def __call__(self, step: str) -> None:
        if self.hook is not None:
            self.hook(step)
        self.reached = step

    @property
    def renamed(self) -> bool:
        return self.reached is not None and (
            ATOMIC_STEPS.index(self.reached) >= ATOMIC_STEPS.index("renamed"))


def describe(hooks: Hooks, environ: dict[str, str] | None = None) -> str:
    """The rules behind ``hooks``, as ``from_env`` read them from ``environ``."""
    spec = (environ if environ is not None else os.environ).get(ENV, "")
    return spec if hooks else ""
