"""A real PostgreSQL server for the test run (pytest plugin, listed in tests/conftest.py).

Fixtures:
    postgres_dsn     session: a ``PostgresServer`` started once for the run (database
                     "quiver" created), stopped and deleted at its end. ``.dsn(dbname)`` is a
                     DSN asyncpg accepts; ``.stop()`` / ``.start()`` take the server down and
                     up again for outage tests (restore it in a ``finally``).
    postgres_server  the same object, under a name that says what it is.
    pg_catalog_dsn   function: the DSN of a fresh, empty database for one test.

Debian's server binaries live in /usr/lib/postgresql/<version>/bin (not on PATH); the
highest version installed is used. initdb and pg_ctl refuse to run as root, so as root they
run as the ``postgres`` user (runuser) on a directory owned by it. The server listens on a
private Unix socket directory only (``listen_addresses=''``): no TCP port to collide with
another run. fsync stays on, as in production.
"""

from __future__ import annotations

import itertools
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_ROOT = Path("/usr/lib/postgresql")
PORT = 5432  # only names the socket file (.s.PGSQL.5432) inside our private directory
START_TIMEOUT_S = 120


def find_bindir() -> Path | None:
    """The bin directory of the highest PostgreSQL version installed, or None."""
    found = []
    for path in PG_ROOT.glob("*/bin/initdb") if PG_ROOT.is_dir() else []:
        version = path.parent.parent.name
        if re.fullmatch(r"\d+(\.\d+)?", version):
            found.append((tuple(int(p) for p in version.split(".")), path.parent))
    return max(found)[1] if found else None


class PostgresServer:
    """One initdb'd cluster under a temp directory, controlled with pg_ctl."""

    def __init__(self, bindir: Path, root: Path) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sock"
        self.logfile = root / "server.log"
        self.running = False
        self._names = itertools.count(1)
        # As root, run the server binaries as the postgres user (they refuse root).
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def init(self) -> None:
        self.sockets.mkdir()
        if self._as:
            pw = pwd.getpwnam("postgres")
            for path in (self.root, self.sockets):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--locale=C", "--no-sync")

    def start(self) -> None:
        """Start the server (no-op when it runs) and wait until it accepts connections."""
        if self.running:
            return
        options = (f"-c listen_addresses='' -c unix_socket_directories={self.sockets} "
                   f"-p {PORT} -c fsync=on -c max_connections=200"
                   # After an immediate stop (a test's crash) a start syncs the data
                   # directory: one syncfs, not an fsync per file, which took over 30 s
                   # on a loaded machine once the suite's databases had piled up.
                   " -c recovery_init_sync_method=syncfs")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-o", options,
                  "-w", "-t", str(START_TIMEOUT_S), "start")
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends sessions cleanly, ``immediate`` is like a crash."""
        if not self.running:
            return
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
        self.running = False

    def dsn(self, dbname: str = "quiver") -> str:
        return f"postgresql://postgres@/{dbname}?host={self.sockets}&port={PORT}"

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database with a unique name; returns its DSN."""
        self.start()
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        self.psql(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def psql(self, command: str, dbname: str = "postgres") -> str:
        out = subprocess.run(
            [str(self.bindir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-h", str(self.sockets), "-p", str(PORT), "-U", "postgres", "-d", dbname,
             "-c", command], capture_output=True, text=True, check=False)
        if out.returncode:
            raise AssertionError(f"psql {command!r} failed: {out.stderr}")
        return out.stdout

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self._as, str(self.bindir / tool), *args],
                             capture_output=True, text=True, cwd=self.root, check=False)
        if out.returncode:
            log = self.logfile.read_text(errors="replace")[-3000:] if self.logfile.exists() else ""
            raise AssertionError(f"{tool} {' '.join(args)} failed ({out.returncode}):\n"
                                 f"{out.stdout}{out.stderr}\n{log}")


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[PostgresServer]:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server not installed: run scripts/setup")
    # A short path: the socket path (…/sock/.s.PGSQL.5432) must stay under 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="qpg", dir="/tmp"))
    server = PostgresServer(bindir, root)
    try:
        server.init()
        server.start()
        server.psql("CREATE DATABASE quiver")
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server(postgres_dsn: PostgresServer) -> PostgresServer:
    return postgres_dsn


@pytest.fixture
def pg_catalog_dsn(postgres_dsn: PostgresServer) -> str:
    return postgres_dsn.create_database()
