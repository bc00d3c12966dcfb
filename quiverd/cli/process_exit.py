"""How a ``quiverd`` process ends: ``console()`` runs ``main()`` and exits with its code.

Why not a plain ``sys.exit``: OpenDAL's Python binding runs its I/O on a process-wide
tokio runtime (pyo3-async-runtimes). A worker thread of that runtime finishes every
awaited operation by calling ``loop.call_soon_threadsafe(...)``, which queues the
result and then wakes the loop by writing to its self-pipe *with the GIL released*.
The loop can take the result, the command can return and the interpreter can start
finalizing before that worker takes the GIL back. CPython 3.11 then ends the worker
with ``pthread_exit``; the forced unwind cannot cross the runtime's Rust frames and
glibc calls ``abort()``: exit status -6 after complete output, nothing on stderr.
Native stack of such a worker (core of ``quiverd fsck DIR --lake --no-crc``):

    abort <- __pthread_unwind <- pthread_exit <- PyThread_exit_thread <- take_gil
    <- PyEval_RestoreThread <- sock_send (self-pipe) <- ... <- _opendal.abi3.so

while the main thread was in ``Py_FinalizeEx``. The runtime has no shutdown call, and
an operation abandoned by a cancel scope still completes on it later, so no await can
prove the workers are out of Python.

So once OpenDAL is loaded the process does what finalization would, minus the race:
join non-daemon Python threads, run atexit handlers (logging flushes there), flush
stdout and stderr, then ``os._exit``. Nothing else is pending: each command closes
its catalog (SQLite / asyncpg) and store before ``main()`` returns, every durable
write was fsynced before it was reported, and the kernel closes files and sockets.
Without OpenDAL loaded the exit is the ordinary one.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from concurrent.futures import thread as cf_thread
from typing import NoReturn

from quiverd.cli.main import main


def console() -> NoReturn:
    """The ``quiverd`` executable and ``python -m quiverd``."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    if "opendal" not in sys.modules:
        sys.exit(code)
    # Thread pools' workers (pyiceberg keeps one) end only when told, which a normal
    # exit does first (threading._shutdown); tell them, or the joins below never return.
    cf_thread._python_exit()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()  # what finalization does first; no worker of ours is left
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # reader gone: exit 120, as CPython's own exit
            code = code or 120
    os._exit(code)


__all__ = ["console", "exit_process"]
