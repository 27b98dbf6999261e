"""The gate socket's wire format: total on any bytes, strict on what it accepts."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import TYPE_CHECKING

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.adapters import gaterequest
from gpuguard.core.gate.proto import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    MAX_TEXT_CHARS,
    Frame,
    Request,
    encode_request,
    frame_exit,
    frame_text,
    parse_frame,
    parse_request,
)

if TYPE_CHECKING:
    import pytest


def test_a_request_survives_the_wire() -> None:
    """What the client encodes, the server decodes unchanged."""
    request = Request("reap", "sglang-a.service", scope="unit", grace=5.0, timeout=20.0)
    assert parse_request(encode_request(request).rstrip(b"\n")) == request


@given(st.binary(max_size=MAX_REQUEST_BYTES + 10))
def test_any_bytes_give_a_request_or_a_reason(line: bytes) -> None:
    """The server's parser is total: a peer's bytes never raise."""
    parsed = parse_request(line)
    assert isinstance(parsed, Request | str)


@given(st.binary(max_size=300))
def test_any_bytes_give_a_frame_or_none(line: bytes) -> None:
    """The client's parser is total too."""
    frame = parse_frame(line)
    assert frame is None or isinstance(frame, Frame)


def _request(**changes: object) -> bytes:
    document: dict[str, object] = {"v": 1, "command": "gate", "unit": "sglang.service"}
    document.update(changes)
    return json.dumps(document).encode()


def test_what_a_request_may_not_be() -> None:
    """Unknown keys (a config path!), bad names, unbounded numbers: refused."""
    assert isinstance(parse_request(_request()), Request)
    bad = {
        "unknown key": _request(config="/home/u/evil.toml"),
        "other version": _request(v=2),
        "unknown command": _request(command="run"),
        "a path for a unit": _request(unit="../../etc/passwd.service"),
        "not a service": _request(unit="sglang.socket"),
        "a newline in the unit": _request(unit="a\nb.service"),
        "unknown scope": _request(scope="everything"),
        "a negative grace": _request(grace=-1),
        "a day-long timeout": _request(timeout=86400),
        "an infinite timeout": _request(timeout=float("inf")),
        "a boolean timeout": _request(timeout=True),
        "a string json": _request(json="yes"),
        "too long": _request(unit="a" * MAX_REQUEST_BYTES + ".service"),
        "not an object": b"[1, 2]",
        "deeply nested": b"[" * 100000,
    }
    for what, line in bad.items():
        assert isinstance(parse_request(line), str), what


def test_frames_carry_text_and_one_verdict() -> None:
    """Output lines keep their stream; long text is cut; the verdict is a number."""
    text = parse_frame(frame_text(2, "gpuguard gate: Start allowed"))
    assert text is not None
    assert (text.fd, text.text, text.exit) == (2, "gpuguard gate: Start allowed", None)
    verdict = parse_frame(frame_exit(78))
    assert verdict is not None
    assert verdict.exit == 78
    long = parse_frame(frame_text(1, "x" * (MAX_TEXT_CHARS * 2)))
    assert long is not None
    assert len(long.text) == MAX_TEXT_CHARS


def test_a_frame_the_protocol_does_not_have_is_rejected() -> None:
    """Booleans are not numbers, fds are 1 or 2, a verdict has no text."""
    for line in (
        b'{"exit": 256}',
        b'{"exit": true}',
        b'{"exit": 0, "fd": 1}',
        b'{"fd": 3, "text": "x"}',
        b'{"fd": true, "text": "x"}',
        b'{"fd": 1, "text": 5}',
        b"exit 0",
    ):
        assert parse_frame(line) is None, line


def test_a_frame_of_any_text_fits_what_the_client_reads() -> None:
    """Emoji are 12 bytes each in JSON: a frame of the longest text still fits MAX_FRAME_BYTES."""
    for text in ("\U0001f600" * 20_000, "a" * 100_000, "\u202e" * 20_000):
        frame = frame_text(2, text)
        assert len(frame) <= MAX_FRAME_BYTES
        assert parse_frame(frame.rstrip(b"\n")) is not None


def test_a_huge_integer_is_a_reason_not_a_crash() -> None:
    """isfinite(10**400) raises OverflowError: the range is checked first."""
    line = b'{"v": 1, "command": "gate", "unit": "a.service", "timeout": 1' + b"0" * 400 + b"}"
    assert isinstance(parse_request(line), str)


def test_a_request_dripped_a_byte_at_a_time_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """One deadline for the whole line (real sockets): dripping cannot hold a server slot."""
    monkeypatch.setattr(gaterequest, "REQUEST_TIMEOUT_S", 0.5)
    server, client = socket.socketpair()
    line = encode_request(Request("gate", "a.service"))

    def drip() -> None:
        for byte in line:
            time.sleep(0.05)  # each byte well inside a per-recv timeout, the line far past 0.5 s
            with contextlib.suppress(OSError):
                client.send(bytes([byte]))

    sender = threading.Thread(target=drip)
    sender.start()
    try:
        assert gaterequest._read_request(server) is None
    finally:
        server.close()
        sender.join()
        client.close()
