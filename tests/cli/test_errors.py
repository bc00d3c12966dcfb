"""What an operator sees when something is wrong: one message, one ``hint:`` line, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from quiverd.kernel.errors import ConfigError
from quiverd.runtime.serve import open_data_dir

EX_CONFIG = 78


def quiverd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quiverd", *args], capture_output=True,
                          text=True, timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Non-zero exit, a ``quiverd:`` line naming the problem, a hint, no traceback.

    (``serve`` also logs the failure as a JSON line for the journal first.)
    """
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("{")]
    assert lines[0].startswith("quiverd: "), proc.stderr
    assert lines[1].startswith("hint: "), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_errors_send_to_missing_socket_names_the_path(tmp_path: Path) -> None:
    ipc = tmp_path / "t.arrow"
    with pa.ipc.new_file(ipc, pa.schema([("a", pa.int64())])) as w:
        w.write_table(pa.table({"a": [1]}))
    proc = quiverd("send", "--socket", str(tmp_path / "nope.sock"), "--client", "c", str(ipc))
    assert_clean_error(proc, f"no quiverd socket at {tmp_path / 'nope.sock'}", "is quiverd running")


def test_errors_send_to_dead_socket_says_nothing_listens(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # a socket file nobody listens on: what a killed daemon leaves
    ipc = tmp_path / "t.arrow"
    with pa.ipc.new_file(ipc, pa.schema([("a", pa.int64())])) as w:
        w.write_table(pa.table({"a": [1]}))
    proc = quiverd("send", "--socket", str(path), "--client", "c", str(ipc))
    assert_clean_error(proc, f"nothing listens on {path}")


@pytest.mark.parametrize("content", [b"", b"hello, not arrow\n" * 10])
def test_errors_send_of_non_arrow_or_empty_file(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_bytes(content)
    proc = quiverd("send", "--socket", str(tmp_path / "x.sock"), "--client", "c", str(bad))
    assert_clean_error(proc, str(bad))
    assert ("empty file" if not content else "not a readable Arrow IPC or Parquet") \
        in proc.stderr


def test_errors_status_without_daemon_names_admin_socket(tmp_path: Path) -> None:
    proc = quiverd("status", "--socket", str(tmp_path / "adm.sock"))
    assert_clean_error(proc, "no quiverd admin socket at", "admin.socket_path")


def test_errors_missing_config_file(tmp_path: Path) -> None:
    proc = quiverd("serve", "--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == EX_CONFIG
    assert_clean_error(proc, "cannot read config", "--config")
    assert "fix the named key" not in proc.stderr


def test_errors_config_lists_allowed_values_and_keys(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", '[wal]\nflush_policy = "sometimes"\n')
    proc = quiverd("check-config", str(cfg))
    assert_clean_error(proc, "wal.flush_policy", "'interval', 'always', 'never'")
    cfg = write_config(tmp_path / "c.toml", "[wal]\nflushpolicy = 1\n")
    assert_clean_error(quiverd("check-config", str(cfg)), "wal.flushpolicy", "flush_policy")


@pytest.mark.parametrize(("store", "expected"), [
    ('scheme = "s3"\noptions = { bucket = "b" }', "region is missing"),
    ('scheme = "s3"\noptions = { bucket = "b", region = "r", bukket = "x" }',
     "lake.store.options.bukket"),
    ('scheme = "nosuchservice"', "lake.store.scheme"),
])
def test_errors_lake_store_options_refused_before_start(tmp_path: Path, store: str,
                                                       expected: str) -> None:
    cfg = write_config(tmp_path / "c.toml", f"[lake.store]\n{store}\n")
    assert_clean_error(quiverd("check-config", str(cfg)), expected)
    proc = quiverd("serve", "--config", str(cfg))
    assert proc.returncode == EX_CONFIG, proc.stderr  # never "ready", then failing
    assert_clean_error(proc, expected)


def test_errors_relative_data_dir_is_a_config_error(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.toml", 'data_dir = "var/quiverd"\n')
    proc = quiverd("serve", "--config", str(cfg))
    assert proc.returncode == EX_CONFIG
    assert_clean_error(proc, "data_dir: must be an absolute path")


@pytest.mark.parametrize("case", ["missing_parent", "under_a_file"])
def test_errors_data_dir_parent_must_exist(tmp_path: Path, case: str) -> None:
    if case == "under_a_file":
        (tmp_path / "file").write_text("x")
        data_dir = tmp_path / "file" / "data"
    else:
        data_dir = tmp_path / "typo" / "data"
    cfg = write_config(tmp_path / "c.toml", f'data_dir = "{data_dir}"\n[log]\nformat = "json"\n')
    proc = quiverd("serve", "--config", str(cfg))
    assert proc.returncode == EX_CONFIG, proc.stderr
    assert_clean_error(proc, f"data_dir: {data_dir}: its parent")
    assert not data_dir.exists()  # nothing created on a typo


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_errors_data_dir_permission_denied(short_dir: Path) -> None:
    """As another uid (fork + setuid: /root's interpreter is not reachable by exec)."""
    short_dir.chmod(0o755)  # pytest's tmp_path is under a 0700 directory
    data_dir = short_dir / "data"
    data_dir.mkdir(mode=0o700)  # owned by root
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.close(read_fd)
            os.setgid(65534)
            os.setuid(65534)
            try:
                open_data_dir(data_dir)
                os.write(write_fd, b"no error")
            except ConfigError as exc:
                os.write(write_fd, f"{exc}\nhint: {exc.hint}".encode())
                code = 0
            except BaseException as exc:
                os.write(write_fd, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        result = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, result
    assert f"data_dir: permission denied on {data_dir}" in result
    assert "User=quiverd" in result


def _arrow_file(path: Path, table: pa.Table) -> Path:
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)
    return path


def test_errors_send_with_a_bad_client_name_before_connecting(tmp_path: Path) -> None:
    ipc = _arrow_file(tmp_path / "t.arrow", pa.table({"a": [1]}))
    proc = quiverd("send", "--socket", str(tmp_path / "nope.sock"), "--client", "Bad Name",
                   str(ipc))
    assert_clean_error(proc, "--client: client name 'Bad Name' must match", "client= prefix")
    assert "no quiverd socket" not in proc.stderr  # refused before connecting


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_errors_send_of_a_file_with_a_reserved_column(tmp_path: Path, fmt: str) -> None:
    import pyarrow.parquet as pq

    table = pa.table({"a": [1], "_quiver_bundle": ["mine"]})
    path = tmp_path / f"t.{fmt}"
    if fmt == "arrow":
        _arrow_file(path, table)
    else:
        pq.write_table(table, path)
    proc = quiverd("send", "--socket", str(tmp_path / "nope.sock"), "--client", "c", str(path))
    assert_clean_error(proc, f"{path}: column '_quiver_bundle': the prefix '_quiver_' is "
                       "reserved", "nothing was sent")


def test_errors_subscribe_with_a_bad_name_before_connecting(tmp_path: Path) -> None:
    proc = quiverd("subscribe", "Bad Name", "--count", "1", "--socket",
                   str(tmp_path / "nope.sock"))
    assert_clean_error(proc, "invalid subscriber name 'Bad Name'", "lowercase letters")


def test_errors_subscribe_out_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    proc = quiverd("subscribe", "x", "--out", str(tmp_path / "file"), "--socket",
                   str(tmp_path / "nope.sock"))
    assert_clean_error(proc, f"--out {tmp_path / 'file'}: File exists", "names a directory")


@pytest.mark.parametrize(("args", "needle"), [
    (["files", "list", "--since", "yesterday"], "files list: argument --since: 'yesterday'"),
    (["subscribe", "x", "--count", "0"], "subscribe: argument --count: must be at least 1"),
    (["send", "--client", "c"], "send: the following arguments are required: --socket"),
    (["no-such-command"], "argument COMMAND: invalid choice: 'no-such-command'"),
    (["wal"], "wal: the following arguments are required"),
])
def test_errors_usage_errors_in_the_two_line_form(args: list[str], needle: str) -> None:
    proc = quiverd(*args)
    assert proc.returncode == 2  # argparse's usage-error status, as before
    assert_clean_error(proc, f"quiverd: {needle}", "--help` lists what it takes")


@pytest.mark.parametrize("reply", [b"", b"not json\n", b"[1, 2]\n"])
def test_errors_status_from_a_socket_that_is_not_an_admin_socket(short_dir: Path,
                                                                  reply: bytes) -> None:
    """E.g. the ingest socket passed as --socket: it answers no JSON line."""
    import threading

    path = short_dir / "other.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(reply)

    thread = threading.Thread(target=answer)
    thread.start()
    proc = quiverd("status", "--socket", str(path))
    thread.join(10)
    server.close()
    assert_clean_error(proc, f"{path} did not answer as a quiverd admin socket",
                       "not the ingest socket")


def test_errors_admin_request_without_an_answer_in_time(short_dir: Path) -> None:
    from quiverd.kernel.errors import DaemonUnreachable
    from quiverd.net.admin import request

    path = short_dir / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)  # never accepted: as a daemon still recovering its shards
        with pytest.raises(DaemonUnreachable, match="no answer on .* within 0.3 s") as info:
            request(path, "status", timeout_s=0.3)
    assert "recovered" in info.value.hint
