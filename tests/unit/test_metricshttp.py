"""The metrics listener's answer to a request head: total over any bytes."""

from __future__ import annotations

from gpuguard.adapters.metricshttp import response


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
