"""The sd_notify adapter: READY, WATCHDOG and STATUS to systemd through the sdnotify package.

sdnotify swallows every error (and silently drops a STATUS= it cannot encode as Latin-1), so
this wrapper keeps a status line encodable and reports whether notifications go anywhere.
"""

from __future__ import annotations

import os

import sdnotify

from gpuguard.core.escaping import escape


class Notifier:
    """Talks to systemd when started by it (NOTIFY_SOCKET set); a no-op otherwise."""

    def __init__(self) -> None:
        """Connect once, as sdnotify does, but only when there is anyone to tell.

        sdnotify itself, constructed without NOTIFY_SOCKET, leaks the socket it opened.
        """
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None

    def close(self) -> None:
        """Close the socket sdnotify opened (it never does)."""
        sock = getattr(self._notifier, "socket", None)
        if sock is not None:
            sock.close()
        self._notifier = None

    def ready(self, status: str) -> None:
        """Start-up is complete: systemd marks the unit active."""
        self._send(f"READY=1\nSTATUS={_line(status)}")

    def status(self, status: str) -> None:
        """The one line `systemctl status gpuguard` shows."""
        self._send(f"STATUS={_line(status)}")

    def watchdog(self) -> None:
        """Proof of life; only the healthy main loop may call it."""
        self._send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        """Shutdown has begun."""
        self._send(f"STOPPING=1\nSTATUS={_line(status)}")

    def _send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)


def watchdog_interval_s() -> float | None:
    """Half of WatchdogSec= (as systemd's man page recommends), or None when it is not set.

    systemd passes WATCHDOG_USEC, and WATCHDOG_PID naming the process that must ping.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdecimal() or int(usec) == 0:
        return None
    if pid.isdecimal() and int(pid) != os.getpid():
        return None
    return int(usec) / 2_000_000


def _line(text: str) -> str:
    """One Latin-1 line: sdnotify encodes Latin-1 and would silently drop anything else.

    Escaped too: `systemctl status` shows the line on root's terminal.
    """
    single = escape(" ".join(text.split()))
    return single.encode("latin-1", "replace").decode("latin-1")
