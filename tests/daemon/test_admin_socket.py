"""The admin socket against a real daemon: peers that leave early or say nothing."""

from __future__ import annotations

import socket
import struct
import time

import msgspec

from quiverd.kernel.config import AdminConfig

TIMEOUT_S = AdminConfig().request_timeout_ms / 1000


def test_admin_peers_that_hang_up_before_the_reply_leave_the_daemon_serving(daemon_factory):
    d = daemon_factory({"shards": 1}, in_process=True).start()
    for _ in range(50):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(d.admin_socket))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset
        s.sendall(b'{"cmd": "status"}\n')
        s.close()  # gone before the reply: a Ctrl-C'd `quiverd status`
    time.sleep(0.5)
    assert d.running, d.log()[-3000:]
    assert d.status()["stopping"] is False
    assert "Traceback" not in d.log()
    assert d.stop() == 0


def test_admin_peer_that_sends_no_request_line_is_answered_and_closed(daemon_factory):
    d = daemon_factory({"shards": 1}, in_process=True).start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT_S + 10)
        s.connect(str(d.admin_socket))
        s.sendall(b"QVR\x01")  # e.g. a producer's HELLO sent to the wrong socket
        started = time.monotonic()
        got = b""
        while chunk := s.recv(4096):  # closed by the daemon, not left open forever
            got += chunk
        assert time.monotonic() - started < TIMEOUT_S + 5
    reply = msgspec.json.decode(got)
    assert reply["ok"] is False and "request_timeout_ms" in reply["error"]
    assert d.status()["stopping"] is False
    assert d.stop() == 0
