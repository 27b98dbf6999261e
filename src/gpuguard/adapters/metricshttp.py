"""The daemon's HTTP metrics listener: one thread, a few connections, every read timed (adapter).

``gpuguard.service`` has ``TasksMax=64``. prometheus_client's server starts a thread per
connection with no cap and no read timeout, so idle connections from any local user parked a
thread each until the daemon could no longer fork ``systemctl``, ``journalctl`` or its NVML
worker, while its watchdog stayed fed. This listener is one thread, whatever connects: it
multiplexes the connections with a selector, takes at most ``max_connections`` at once (more
are closed at once, unread), gives each ``timeout_s`` from its accept to its whole exchange
(request head in, answer out), reads at most HEAD_MAX_BYTES of a request, and answers
``GET /metrics`` (or ``HEAD``) with the newest metrics, anything else with 404 or 405, always
``Connection: close``. A connection costs a file descriptor, never a task.
"""

from __future__ import annotations

import contextlib
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

#: Connections open at once; more are closed as they are accepted. A scraper needs one at a
#: time: 16 leave room for a few scrapers and an operator's curl, and bound the descriptors
#: idle connections can take (the listener's threads are one, whatever this is).
MAX_CONNECTIONS = 16
#: From accept to the last byte of the answer; an idle or dripping connection is closed then.
TIMEOUT_S = 5.0
#: A request head (line and headers) longer than this is answered 431 and closed.
HEAD_MAX_BYTES = 8192
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Limits(NamedTuple):
    """What the listener allows; the defaults are the daemon's, tests pass smaller ones."""

    max_connections: int = MAX_CONNECTIONS
    timeout_s: float = TIMEOUT_S


@dataclass
class _Connection:
    sock: socket.socket
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: bytes = b""
    answering: bool = False


def response(head: bytes, render: Callable[[], bytes]) -> bytes:
    """The whole HTTP/1.0 answer to a request ``head`` (its bytes up to the blank line)."""
    line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return _answer(400, b"bad request\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in {b"GET", b"HEAD"}:
        return _answer(405, b"only GET\n")
    if target != b"/metrics":
        return _answer(404, b"only /metrics\n")
    answer = _answer(200, render())
    return answer if method == b"GET" else answer.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}


def _answer(status: int, body: bytes) -> bytes:
    reason = _REASONS.get(status, "Request Header Fields Too Large")
    head = (
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: {_CONTENT_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Listener:
    """Serves ``render()``'s bytes at ``/metrics`` on ``listener`` from one daemon thread."""

    def __init__(
        self,
        listener: socket.socket,
        render: Callable[[], bytes],
        limits: Limits = Limits(),  # noqa: B008 - an immutable NamedTuple
    ) -> None:
        """Take ``listener`` (bound and listening); nothing is served until :meth:`start`."""
        self._listener = listener
        self._render = render
        self._limits = limits
        self._selector = selectors.DefaultSelector()
        self._open: dict[int, _Connection] = {}

    def start(self) -> threading.Thread:
        """Serve from a daemon thread of its own (the listener's only one)."""
        thread = threading.Thread(target=self._serve, name="gpuguard-metrics", daemon=True)
        thread.start()
        return thread

    def _serve(self) -> None:
        self._listener.setblocking(False)  # noqa: FBT003 - positional only
        self._selector.register(self._listener, selectors.EVENT_READ)
        while True:
            deadlines = [c.deadline for c in self._open.values()]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, _ in self._selector.select(wait):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fd in self._open:
                    self._step(self._open[key.fd])
            now = time.monotonic()
            for conn in [c for c in self._open.values() if now >= c.deadline]:
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):  # a turn of the loop takes at most this many: the rest stay queued
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, aborted: the connection is lost, not the loop
                return
            if len(self._open) >= self._limits.max_connections:
                sock.close()  # over the cap: refused, unread
                continue
            sock.setblocking(False)  # noqa: FBT003 - positional only
            conn = _Connection(sock, time.monotonic() + self._limits.timeout_s)
            self._open[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _step(self, conn: _Connection) -> None:
        try:
            if conn.answering:
                sent = conn.sock.send(conn.out)
                conn.out = conn.out[sent:]
                if not conn.out:
                    self._close(conn)
                return
            chunk = conn.sock.recv(HEAD_MAX_BYTES + 1 - len(conn.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not chunk:
            self._close(conn)
            return
        conn.head += chunk
        end = conn.head.find(b"\r\n\r\n")
        if end < 0 and len(conn.head) <= HEAD_MAX_BYTES:
            return
        if end < 0:
            conn.out = _answer(431, b"request head too long\n")
        else:
            try:
                conn.out = response(bytes(conn.head[:end]), self._render)
            except Exception:  # noqa: BLE001 - one failed render must not end the listener
                conn.out = _answer(500, b"the metrics could not be rendered\n")
        conn.answering = True
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)

    def _close(self, conn: _Connection) -> None:
        self._open.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
