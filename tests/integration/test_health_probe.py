"""The health probe against real local servers: it answers within its timeout whatever they do.

Each server is a real listening socket (TCP loopback, IPv4 and IPv6) served
by a thread that behaves one way: answers 200 or 503, hangs, resets, trickles, or sends an
endless body. The probe must return its verdict, never the server's text, within its timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import TYPE_CHECKING

import pytest

from gpuguard.adapters.healthprobe import probe
from gpuguard.core.healthcheck import HealthTarget, ProbeResult

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

TIMEOUT_S = 0.5
SLACK_S = 0.5
"""A loaded CI machine's scheduling jitter on top of the probe's own deadline."""


class Server:
    """A listening socket whose one thread serves each connection the same way."""

    def __init__(
        self, listener: socket.socket, serve: Callable[[socket.socket, threading.Event], None]
    ) -> None:
        """Serve ``listener``'s connections with ``serve`` until ``close``."""
        self.listener = listener
        self.done = threading.Event()
        self.requests: list[bytes] = []
        self._serve = serve
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.05)
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    self.requests.append(conn.recv(4096))
                    self._serve(conn, self.done)

    def close(self) -> None:
        """Stop serving and close the listener."""
        self.done.set()
        self._thread.join()
        self.listener.close()


def answer(text: bytes) -> Callable[[socket.socket, threading.Event], None]:
    """A server that sends ``text`` and closes."""

    def serve(conn: socket.socket, _done: threading.Event) -> None:
        conn.sendall(text)

    return serve


def hang(_conn: socket.socket, done: threading.Event) -> None:
    """A server that reads the request and never answers (until the test ends)."""
    done.wait()


def reset(conn: socket.socket, _done: threading.Event) -> None:
    """A server that resets the connection (SO_LINGER 0) instead of answering."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def endless_body(conn: socket.socket, done: threading.Event) -> None:
    """A 200 whose body never ends."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
    while not done.is_set():
        conn.sendall(b"\x1b[31m" * 1024)


def trickle(conn: socket.socket, done: threading.Event) -> None:
    """A server that sends its status line one byte at a time, slower than the timeout allows."""
    for byte in b"HTTP/1.1 200 OK\r\n":
        if done.wait(0.2):
            return
        conn.sendall(bytes([byte]))


def endless_line(conn: socket.socket, done: threading.Event) -> None:
    """A server that sends an endless first line with no newline."""
    while not done.is_set():
        conn.sendall(b"A" * 1024)


@pytest.fixture
def tcp_server() -> Iterator[Callable[..., tuple[Server, HealthTarget]]]:
    """Start a loopback server (IPv4 by default) with a behaviour; closed at the end."""
    made: list[Server] = []

    def start(
        serve: Callable[[socket.socket, threading.Event], None], *, family: int = socket.AF_INET
    ) -> tuple[Server, HealthTarget]:
        host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
        except OSError as err:
            listener.close()
            pytest.skip(f"no {host} on this machine: {err}")
        listener.listen(4)
        server = Server(listener, serve)
        made.append(server)
        return server, HealthTarget("/health", host, listener.getsockname()[1])

    yield start
    for server in made:
        server.close()


def timed(target: HealthTarget) -> tuple[ProbeResult, float]:
    """The probe's answer and how long it took."""
    began = time.monotonic()
    result = probe(target, TIMEOUT_S)
    return result, time.monotonic() - began


def test_a_200_is_healthy_and_the_request_is_a_plain_get(
    tcp_server: Callable[..., tuple[Server, HealthTarget]],
) -> None:
    """A 200 answer is healthy; the request is one GET with the loopback Host."""
    server, target = tcp_server(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    assert probe(target, TIMEOUT_S) == ProbeResult(ok=True, detail="HTTP 200")
    [request] = server.requests
    assert request.startswith(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1:")


def test_a_503_is_a_failure_named_by_its_code(
    tcp_server: Callable[..., tuple[Server, HealthTarget]],
) -> None:
    """SGLang's 503 once its engine died: a failure, its text never returned."""
    _, target = tcp_server(answer(b"HTTP/1.1 503 Service Unavailable\r\n\r\n\x1b[2Jsecret"))
    assert probe(target, TIMEOUT_S) == ProbeResult(ok=False, detail="HTTP 503")


def test_ipv6_loopback_is_asked(tcp_server: Callable[..., tuple[Server, HealthTarget]]) -> None:
    """http://[::1]:PORT/ is asked over IPv6."""
    _, target = tcp_server(answer(b"HTTP/1.0 204 No Content\r\n\r\n"), family=socket.AF_INET6)
    assert probe(target, TIMEOUT_S) == ProbeResult(ok=True, detail="HTTP 204")


@pytest.mark.parametrize(
    ("serve", "detail"),
    [
        (hang, f"no answer within {TIMEOUT_S:g} s"),
        (trickle, f"no answer within {TIMEOUT_S:g} s"),
        (reset, "connection closed without an answer"),
        (endless_line, "the answer is not HTTP"),
        (answer(b"SSH-2.0-OpenSSH_9.2\r\n"), "the answer is not HTTP"),
    ],
    ids=["hang", "trickle", "reset", "endless-line", "not-http"],
)
def test_a_bad_server_is_a_failure_within_the_timeout(
    tcp_server: Callable[..., tuple[Server, HealthTarget]],
    serve: Callable[[socket.socket, threading.Event], None],
    detail: str,
) -> None:
    """Whatever the server does, the probe fails in its own words within its timeout."""
    _, target = tcp_server(serve)
    result, took = timed(target)
    assert not result.ok
    assert result.detail in {detail, "cannot ask: Connection reset by peer"}
    assert took < TIMEOUT_S + SLACK_S


def test_an_endless_body_is_never_read(
    tcp_server: Callable[..., tuple[Server, HealthTarget]],
) -> None:
    """A 200 with an endless body is healthy at once: only the status line is read."""
    _, target = tcp_server(endless_body)
    result, took = timed(target)
    assert result == ProbeResult(ok=True, detail="HTTP 200")
    assert took < TIMEOUT_S + SLACK_S


def test_nothing_listening_is_connection_refused() -> None:
    """A closed port: refused, at once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
    result, took = timed(HealthTarget("/health", "127.0.0.1", port))
    assert result == ProbeResult(ok=False, detail="connection refused")
    assert took < TIMEOUT_S + SLACK_S
