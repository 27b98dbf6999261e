"""sd_notify through the real sdnotify package over a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from gpuguard.adapters.notify import Notifier, watchdog_interval_s

if TYPE_CHECKING:
    from pathlib import Path

    import pytest


def test_messages_reach_the_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """READY, STATUS and WATCHDOG arrive as systemd would receive them; STATUS stays one line."""
    path = tmp_path / "notify"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notifier = Notifier()
    notifier.ready("watching sglang.service → ok\nsecond line")
    notifier.watchdog()
    received = [server.recv(4096).decode("latin-1") for _ in range(2)]
    notifier.close()
    server.close()
    assert received[0] == "READY=1\nSTATUS=watching sglang.service ? ok second line"
    assert received[1] == "WATCHDOG=1"


def test_without_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside systemd (no NOTIFY_SOCKET) notifications are a silent no-op."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    notifier.ready("x")


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    """WatchdogSec=30 gives a ping every 15 s, and none when meant for another PID."""
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None
