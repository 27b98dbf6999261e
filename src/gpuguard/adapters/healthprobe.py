"""The HTTP health probe: one ``GET`` to a loopback TCP port, bounded in time and size.

A raw socket rather than ``http.client``: the probe needs the status line only, and one deadline
for the whole exchange. Every step (connect, each send, each receive) gets the time left until
that deadline as its socket timeout, so the probe returns within ``timeout_s`` (plus the
scheduler's jitter) whatever the server does: hang, trickle one byte at a time, or send an
endless body. It reads at most ``MAX_HEAD`` bytes, never the body, and closes. Nothing the
server sends is returned but the status code: the answer is foreign text.

The daemon calls it from its loop (daemon/healthprobes.py), and the configuration keeps
``timeout_s`` at most 5 s and below the probe interval: a probe can neither block the loop past
its timeout nor starve systemd's watchdog (15 s between pings under gpuguard.service).
"""

from __future__ import annotations

import re
import socket
import time
from typing import TYPE_CHECKING, Final

from gpuguard.core.healthcheck import REFUSED, ProbeResult

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuguard.core.healthcheck import HealthTarget

MAX_HEAD: Final = 4096
"""Bytes read at most to find the status line: a status line is a few dozen."""
_STATUS: Final = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?\r?\n")


def probe(
    target: HealthTarget, timeout_s: float, *, clock: Callable[[], float] = time.monotonic
) -> ProbeResult:
    """Ask ``target`` once; healthy on a 2xx status, else why not, within ``timeout_s``."""
    deadline = clock() + timeout_s
    family = socket.AF_INET6 if ":" in target.address else socket.AF_INET
    where = (target.address, target.port)
    request = (
        f"GET {target.path} HTTP/1.0\r\nHost: {target.host_header}\r\n"
        "User-Agent: gpuguard\r\nConnection: close\r\n\r\n"
    ).encode("ascii")
    try:
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError as err:  # RestrictAddressFamilies=AF_UNIX: EAFNOSUPPORT
        return _refused("cannot make the socket", err)
    try:
        with sock:
            return _exchange(sock, where, request, deadline, clock)
    except OSError as err:
        return _failed(err, timeout_s)


def _failed(err: OSError, timeout_s: float) -> ProbeResult:
    """The probe's error in our own words."""
    if isinstance(err, PermissionError):  # IPAddressDeny= without IPAddressAllow=localhost
        return _refused("not permitted to connect", err)
    if isinstance(err, TimeoutError):
        detail = f"no answer within {timeout_s:g} s"
    elif isinstance(err, ConnectionRefusedError):
        detail = REFUSED
    else:
        detail = f"cannot ask: {err.strerror or type(err).__name__}"
    return ProbeResult(ok=False, detail=detail)


def _exchange(
    sock: socket.socket,
    where: tuple[str, int],
    request: bytes,
    deadline: float,
    clock: Callable[[], float],
) -> ProbeResult:
    """Connect, send the request, read the status line: each step within the deadline."""
    _within(sock, deadline, clock)
    sock.connect(where)
    view = memoryview(request)
    while view:
        _within(sock, deadline, clock)
        view = view[sock.send(view) :]
    return _answer(sock, deadline, clock)


def _refused(what: str, err: OSError) -> ProbeResult:
    """The daemon's own sandbox, not the server, refused: not counted (doctor says the fix)."""
    why = err.strerror or type(err).__name__
    return ProbeResult(ok=False, detail=f"{what} ({why}): see gpuguard doctor", counts=False)


def _within(sock: socket.socket, deadline: float, clock: Callable[[], float]) -> None:
    """The next step's timeout is what is left of the whole probe's; none left: timed out."""
    left = deadline - clock()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _answer(sock: socket.socket, deadline: float, clock: Callable[[], float]) -> ProbeResult:
    """The status line's verdict, read in at most ``MAX_HEAD`` bytes before the deadline."""
    head = b""
    while b"\n" not in head:
        if len(head) >= MAX_HEAD:
            return ProbeResult(ok=False, detail="the answer is not HTTP")
        _within(sock, deadline, clock)
        chunk = sock.recv(MAX_HEAD - len(head))
        if not chunk:
            return ProbeResult(ok=False, detail="connection closed without an answer")
        head += chunk
    found = _STATUS.match(head)
    if found is None:
        return ProbeResult(ok=False, detail="the answer is not HTTP")
    code = int(found[1])
    return ProbeResult(ok=200 <= code < 300, detail=f"HTTP {code}")
