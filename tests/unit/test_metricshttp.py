"""The metrics listener's answer to a request head: total over any bytes."""

from __future__ import annotations

import socket

from gpuguard.adapters.metricshttp import Listener, response


def _render() -> bytes:
    return b"gpuguard_test_up 1.0\n"


def test_get_metrics_is_answered_and_anything_else_is_not() -> None:
    """GET /metrics: 200 with the body; HEAD: no body; other paths, methods, garbage: 4xx."""
    ok = response(b"GET /metrics?x=1 HTTP/1.1\r\nHost: h", _render)
    assert ok.startswith(b"HTTP/1.0 200 OK\r\n")
    assert ok.endswith(b"\r\n\r\ngpuguard_test_up 1.0\n")
    assert response(b"HEAD /metrics HTTP/1.0", _render).endswith(b"Connection: close\r\n\r\n")
    assert response(b"GET / HTTP/1.0", _render).startswith(b"HTTP/1.0 404 ")
    assert response(b"POST /metrics HTTP/1.0", _render).startswith(b"HTTP/1.0 405 ")
    for garbage in (b"", b"\xff\xfe\x00", b"GET", b"GET /metrics", b" " * 100, b"\n\n\n"):
        assert response(garbage, _render).startswith(b"HTTP/1.0 400 "), garbage


def test_a_failed_render_is_a_500_and_the_listener_serves_on() -> None:
    """A render that raises answers 500; the next scrape is served by the same thread."""
    calls: list[int] = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("collector failed")
        return b"gpuguard_test_up 1.0\n"

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    Listener(server, render).start()
    port = server.getsockname()[1]
    answers = []
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            with sock.makefile("rb") as reader:
                answers.append(reader.read())
    assert answers[0].startswith(b"HTTP/1.0 500 ")
    assert answers[1].startswith(b"HTTP/1.0 200 OK")
    assert answers[1].endswith(b"gpuguard_test_up 1.0\n")
