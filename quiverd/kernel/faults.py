"""Fault hooks for crash and durability tests, set with $QUIVERD_FAULTS.

Only faults that cannot be made real on demand live here. The variable holds
``;``-separated rules, ``<point>=<action>``:

    wal.fdatasync=eio@3          the 3rd WAL fdatasync fails with EIO
    wal.fdatasync=gate:/tmp/g    every WAL fdatasync waits while /tmp/g exists
    finalize=kill:renamed        the process dies (SIGKILL) right after that
                                 atomic-write step of a segment (tmp_written,
                                 tmp_fsynced, renamed, dir_fsynced)

Hooks run in worker threads, never on the event loop. The daemon logs a
warning at startup when any rule is active.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

ENV = "QUIVERD_FAULTS"
GATE_POLL_S = 0.002

Hook = Callable[[str], None]  # called with the step just reached, in a worker thread
Hooks = dict[str, Hook]  # by component: "wal", "finalize"


def from_env(environ: dict[str, str] | None = None) -> Hooks:
    """Parse $QUIVERD_FAULTS into {"wal": hook, "finalize": hook}."""
    spec = (environ if environ is not None else dict(os.environ)).get(ENV, "")
    rules: dict[str, list[Callable[[str], None]]] = {}
    for rule in filter(None, (r.strip() for r in spec.split(";"))):
        point, _, action = rule.partition("=")
        component, _, step = point.partition(".")
        rules.setdefault(component, []).append(_hook(step, action, rule))
    return {component: _chain(hooks) for component, hooks in rules.items()}


def _hook(step: str, action: str, rule: str) -> Callable[[str], None]:
    kind, _, arg = action.partition(":")
    if kind.startswith("eio@"):
        nth = int(kind[4:])
        calls = {"n": 0}

        def eio(at: str) -> None:
            if at == step:
                calls["n"] += 1
                if calls["n"] == nth:
                    raise OSError(errno.EIO, f"injected by {ENV} ({rule})")
        return eio
    if kind == "gate":
        def gate(at: str) -> None:
            if at == step:
                while os.path.exists(arg):
                    time.sleep(GATE_POLL_S)
        return gate
    if kind == "kill":
        def kill(at: str) -> None:
            if at == arg:
                os.kill(os.getpid(), signal.SIGKILL)
        return kill
    raise ValueError(f"{ENV}: cannot parse rule {rule!r}")


def _chain(hooks: list[Callable[[str], None]]) -> Callable[[str], None]:
    def run(at: str) -> None:
        for h in hooks:
            h(at)
    return run


def describe(hooks: Hooks) -> str:
    return os.environ.get(ENV, "") if hooks else ""
