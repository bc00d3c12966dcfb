"""systemd's sd_notify protocol: READY, STOPPING, WATCHDOG, EXTEND_TIMEOUT_USEC.

A datagram to a Unix socket; when NOTIFY_SOCKET is unset (not under systemd),
every call is a no-op. The send is a single non-blocking datagram, so it is
fine on the event loop.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        addr = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # A leading "@" names an abstract socket.
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        self._sock: socket.socket | None = None
        if self._addr:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def watchdog_interval_s(self) -> float | None:
        """Half of $WATCHDOG_USEC, as systemd recommends, or None."""
        usec = os.environ.get("WATCHDOG_USEC")
        if not self.enabled or not usec or not usec.isdigit():
            return None
        return int(usec) / 2_000_000

    def notify(self, *states: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(states).encode(), self._addr)
        except OSError:
            # systemd gone or queue full: a missed notification must not kill the daemon.
            pass

    def ready(self, status: str = "") -> None:
        self.notify("READY=1", f"STATUS={status}" if status else "STATUS=ready")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def extend_timeout(self, usec: int, status: str) -> None:
        """Ask for ``usec`` more before systemd's start timeout fires (long replays)."""
        self.notify(f"EXTEND_TIMEOUT_USEC={usec}", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
