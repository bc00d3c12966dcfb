"""systemd integration: the unit installs and verifies, sd_notify, watchdog, journald priorities."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from quiverd.client import Client
from tests.daemon.helpers import tagged_table

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "quiverd.service"
needs_systemd_tools = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or shutil.which("systemd-sysusers") is None,
    reason="systemd-analyze / systemd-sysusers not installed")


@needs_systemd_tools
@pytest.mark.skipif(os.geteuid() != 0, reason="scripts/install runs as root")
def test_systemd_install_into_a_root_then_unit_verifies(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = subprocess.run([str(ROOT / "scripts" / "install"), "--root", str(root)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^quiverd:x:\d+:\d+:", (root / "etc/passwd").read_text(), re.M)
    config_dir = root / "etc/quiverd"
    assert config_dir.stat().st_mode & 0o777 == 0o750
    site = next((root / "opt/quiverd/lib").glob("python3*/site-packages"))
    assert (site / "quiverd_actors" / "wal_writer.py").exists()
    assert not (site / "actors").exists()  # no top-level name that could clash
    # The tree is an image: nothing in it may name the directory it was written to.
    named = subprocess.run(["grep", "-rlF", "--binary-files=text", str(root),
                            str(root / "opt/quiverd")], capture_output=True, text=True)
    assert named.returncode == 1 and named.stdout == "", named.stdout[:3000]
    assert (root / "opt/quiverd/bin/quiverd").read_text().startswith(
        "#!/opt/quiverd/bin/python\n")
    # Run it where the image puts it, with the install directory out of sight (a private
    # mount namespace: /opt/quiverd is the tree's, the tree's own path an empty tmpfs).
    image = subprocess.run(
        ["unshare", "--mount", "sh", "-ec",
         f"mount -t tmpfs tmpfs /opt && mkdir /opt/quiverd && "
         f"mount --bind {root}/opt/quiverd /opt/quiverd && mount -t tmpfs tmpfs {root} && "
         "/opt/quiverd/bin/quiverd --version && /opt/quiverd/bin/python -c "
         "'import quiverd.cli.main as m; print(m._parser.__code__.co_filename)'"],
        capture_output=True, text=True, timeout=60, cwd="/")
    assert image.returncode == 0, image.stdout + image.stderr
    version, compiled = image.stdout.splitlines()
    assert version.startswith("quiverd ")
    in_image = Path("/opt/quiverd") / site.relative_to(root / "opt/quiverd")
    assert compiled == str(in_image / "quiverd/cli/main.py")  # the bytecode's file name
    _installed_daemon_serves_the_default_config(root, tmp_path)
    # verify resolves the unit's dependencies (sysinit.target, ...) inside the root.
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system",
                    dirs_exist_ok=True)
    verify = subprocess.run(["systemd-analyze", f"--root={root}", "verify", "quiverd.service"],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # The check can fail: without the installed binary, verify refuses the unit.
    (root / "opt/quiverd/bin/quiverd").unlink()
    broken = subprocess.run(["systemd-analyze", f"--root={root}", "verify", "quiverd.service"],
                            capture_output=True, text=True, timeout=60)
    assert broken.returncode != 0 and "not executable" in broken.stderr


def _installed_daemon_serves_the_default_config(root: Path, tmp_path: Path) -> None:
    """The plain install (no test or bench extras) imports every module and serves the
    installed config.toml as it is (a lake file rotates 1 s after its first bundle): the
    daemon starts, acks, registers the rows in the lake (the Iceberg projection's worker
    process included) and stops on SIGTERM with exit 0. /var/lib is a private tmpfs, so
    the default data_dir /var/lib/quiverd is this test's."""
    config = tmp_path / "config.toml"
    text = (root / "etc/quiverd/config.toml").read_text()
    assert text == (ROOT / "config.toml").read_text()
    assert "\nfile_duration_ms = 1000\n" in text
    config.write_text(text)
    work = tmp_path / "smoke"
    work.mkdir()
    script = Path(__file__).with_name("installed_smoke.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-ec",
         f"mount -t tmpfs tmpfs /opt && mkdir /opt/quiverd && "
         f"mount --bind {root}/opt/quiverd /opt/quiverd && "
         "mount -t tmpfs tmpfs /var/lib && mkdir /var/lib/quiverd && "
         f"exec /opt/quiverd/bin/python -I {script} {config} {work}"],
        capture_output=True, text=True, timeout=240, cwd="/", env=env)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1:] == ["ok"], \
        proc.stdout[-3000:] + proc.stderr[-5000:]


@needs_systemd_tools
def test_systemd_security_exposure_is_low() -> None:
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)],
                          capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for quiverd.service: (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) <= 2.0, proc.stdout


def _notify_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(20)
    return sock


def test_systemd_extend_timeout_before_ready(daemon_factory: Any, short_dir: Path) -> None:
    notify = _notify_socket(short_dir / "notify")
    daemon_factory(env={"NOTIFY_SOCKET": str(short_dir / "notify")}).start(wait=False)
    messages = []
    while not any(b"READY=1" in m for m in messages):
        messages.append(notify.recv(4096))
    first = messages[0].decode()
    assert "EXTEND_TIMEOUT_USEC=15000000" in first and "STATUS=recovering" in first
    notify.close()


def test_systemd_watchdog_stops_while_an_fdatasync_hangs(daemon_factory: Any,
                                                          short_dir: Path) -> None:
    notify = _notify_socket(short_dir / "notify")
    gate = short_dir / "gate"
    d = daemon_factory({"shards": 1}, env={"NOTIFY_SOCKET": str(short_dir / "notify"),
                                           "WATCHDOG_USEC": "400000"})
    d.start(faults=f"wal.fdatasync=gate:{gate}")

    def pings_during(seconds: float) -> int:
        count, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            notify.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                count += notify.recv(4096).count(b"WATCHDOG=1")
            except TimeoutError:
                break
        return count

    assert pings_during(1.0) >= 2  # healthy: a ping every 0.2 s
    gate.touch()  # every fdatasync now waits: the disk "hangs"
    acked: list[Any] = []

    def send_one() -> None:
        with Client.connect(d.socket) as c:
            acked.append(c.send(tagged_table(1), client="w"))

    sender = threading.Thread(target=send_one)
    sender.start()
    deadline = time.monotonic() + 10
    while d.status()["shards"][0]["in_flight"] < 1:  # written, waiting for its fdatasync
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.01)
    time.sleep(0.5)  # a whole watchdog interval and more: the stall is seen
    pings_during(0.05)  # drop pings sent before that (queued in the socket meanwhile)
    assert pings_during(1.2) == 0
    assert d.events("watchdog_shard_stalled")
    gate.unlink()
    sender.join(20)
    assert len(acked) == 1
    assert pings_during(1.0) >= 2  # progress again: pings resume
    notify.close()


def test_systemd_journal_lines_carry_a_priority(daemon_factory: Any) -> None:
    d = daemon_factory({"shards": 1}, env={"JOURNAL_STREAM": "8:1234"}).start()
    assert d.stop() == 0
    lines = d.log().splitlines()
    assert any(ln.startswith('<6>{') and '"quiverd_ready"' in ln for ln in lines), lines[:5]
    assert not any(ln.startswith("{") for ln in lines)
