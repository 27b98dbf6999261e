"""The daemon's HTTP metrics listener under idle connections: real sockets, a real process.

The listener runs in a process of its own, as in the daemon (metricsio.serve, the daemon's
limits); the test holds hundreds of connections that send nothing, then asks that process to
spawn a subprocess, as the daemon spawns systemctl, journalctl and its NVML worker.
"""

from __future__ import annotations

import selectors
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from gpuguard.adapters import metricshttp

if TYPE_CHECKING:
    from collections.abc import Iterator

import pytest

SERVER = """
import os, subprocess, sys
from prometheus_client.core import GaugeMetricFamily
from gpuguard.adapters import metricsio
from gpuguard.core import metrics
latest = metrics.Latest()
latest.publish([GaugeMetricFamily("gpuguard_test_up", "The listener's test metric.", value=1)])
metricsio.serve(f"127.0.0.1:{sys.argv[1]}", latest)
print("serving", flush=True)
for _ in sys.stdin:  # each line: spawn a process, as the daemon spawns systemctl
    threads = len(os.listdir("/proc/self/task"))
    try:
        spawned = subprocess.run([sys.executable, "-c", "pass"], timeout=30).returncode
    except OSError as err:
        spawned = f"failed: {err}"
    print(f"{threads} {spawned}", flush=True)
"""


class Served:
    """The listener's process: its port, and a way to make it spawn and count its threads."""

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        """The running listener ``process`` on ``port``."""
        self.process = process
        self.port = port

    def spawn(self) -> tuple[int, str]:
        """Make it spawn a subprocess; its thread count just before, and the spawn's result."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write("spawn\n")
        self.process.stdin.flush()
        threads, spawned = self.process.stdout.readline().split(" ", 1)
        return int(threads), spawned.strip()

    def scrape(self, path: str = "/metrics") -> tuple[int, str]:
        """One fresh GET on a new connection (no proxy): its status and body."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
            with sock.makefile("rb") as reader:
                answer = reader.read()
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body.decode()


@pytest.fixture
def served() -> Iterator[Served]:
    """The listener on a free loopback port, in a process of its own."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "serving\n"
    yield Served(process, port)
    process.kill()
    process.communicate()


def _all_closed(held: list[socket.socket], within: float) -> bool:
    """Wait until the server has closed every held connection (EOF or reset), up to ``within``."""
    selector = selectors.DefaultSelector()
    for sock in held:
        selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + within
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(deadline - time.monotonic()):
            held_sock = key.fileobj
            assert isinstance(held_sock, socket.socket)
            try:
                data = held_sock.recv(1)
            except OSError:
                data = b""
            assert not data, "an idle connection was answered"
            selector.unregister(held_sock)
    return not selector.get_map()


def test_idle_connections_cost_no_task_and_time_out(served: Served) -> None:
    """300 idle connections: no thread each, a spawn works, then a fresh scrape is answered.

    Before, prometheus_client's server parked a thread per connection with no read timeout: in
    gpuguard.service's TasksMax=64, 64 idle connections from any local user kept the daemon
    from forking systemctl, journalctl or its NVML worker.
    """
    before, _ = served.spawn()
    held: list[socket.socket] = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            held.append(sock)
        threads, spawned = served.spawn()
        assert threads <= before + 1, f"{threads} threads with 300 idle connections"
        assert spawned == "0", spawned
        # Over the cap: closed at once; the rest after the read timeout.
        assert _all_closed(held, metricshttp.TIMEOUT_S * 4), "idle connections left open"
    finally:
        for sock in held:
            sock.close()
    status, body = served.scrape()
    assert status == 200
    assert "gpuguard_test_up 1.0" in body, body


def test_only_get_metrics_is_answered(served: Served) -> None:
    """Another path is 404, a head past 8 KiB 431; the listener serves on after either."""
    assert served.scrape("/")[0] == 404
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 9000 + b"\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.0 431 "), "an overlong head is refused"
    status, body = served.scrape()
    assert status == 200
    assert "gpuguard_test_up 1.0" in body
