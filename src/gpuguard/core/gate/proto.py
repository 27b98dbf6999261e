"""The gate socket's wire format: one request line in, framed output lines and a verdict out.

The drop-in's ``ExecStartPre=``/``ExecStopPost=`` run ``gpuguard gate``/``reap`` unprivileged, in
the watched unit's environment; they only *ask* the root gate server (``gpuguard serve-gate``,
socket-activated) over ``/run/gpuguard/gate.sock``. Everything here is pure and total: the
server parses a request from an untrusted peer, the client parses what the server sends.

Request: one JSON object on one line, at most ``MAX_REQUEST_BYTES``::

    {"v": 1, "command": "gate", "unit": "sglang.service", "scope": "unit",
     "grace": null, "timeout": null, "json": false}

Response: JSON lines ``{"fd": 1|2, "text": "..."}`` (what the command printed, one line each,
for the client's stdout or stderr), then ``{"exit": N}``. Framing as JSON keeps a holder's
command line, whatever it contains, from ever forging a verdict.

The gate client imports this module before every start of a watched unit, so it stays cheap:
its records are NamedTuples, not dataclasses (importing dataclasses pulls in inspect and ast,
about half of the client's import time).
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

from gpuguard.core.unitname import SERVICE_NAME

SOCKET_PATH = "/run/gpuguard/gate.sock"
VERSION = 1
MAX_REQUEST_BYTES = 4096
#: Longest response line the client accepts; the server cuts text to fit well below it.
MAX_FRAME_BYTES = 64 * 1024
#: json.dumps writes a non-ASCII character as up to 12 bytes (a surrogate pair of \uXXXX).
MAX_TEXT_CHARS = (MAX_FRAME_BYTES - 64) // 12
COMMANDS = ("gate", "reap")
SCOPES = ("unit", "patterns", "all")
#: Upper bounds for the numbers a caller may send: an instance must not live for days.
MAX_TIMEOUT_S = 3600.0
MAX_GRACE_S = 600.0
#: The gate server's last journal line of a request whose client went before the answer (in
#: place of "exit N"): the work ends there, so what it had not logged yet (a target's outcome,
#: the GPUs at the end) is unknown. ``explain`` reads it (its ``*-abandoned`` rows).
CLIENT_GONE = "the client has gone: stopped before the end, its outcome unknown"

_KEYS = frozenset({"v", "command", "unit", "scope", "grace", "timeout", "json"})


class Request(NamedTuple):
    """What a caller asks for; ``grace``/``timeout`` None mean the configured values."""

    command: str
    unit: str
    scope: str = "unit"
    grace: float | None = None
    timeout: float | None = None
    json: bool = False


def encode_request(request: Request) -> bytes:
    """The request as the one line the client sends."""
    document = {
        "v": VERSION,
        "command": request.command,
        "unit": request.unit,
        "scope": request.scope,
        "grace": request.grace,
        "timeout": request.timeout,
        "json": request.json,
    }
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


def parse_request(line: bytes) -> Request | str:
    """The request in ``line``, or why it is not one (a short phrase, safe to print)."""
    if len(line) > MAX_REQUEST_BYTES:
        return f"request longer than {MAX_REQUEST_BYTES} bytes"
    try:
        document = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "request is not one JSON line"
    if not isinstance(document, dict):
        return "request is not a JSON object"
    problem = _problem(document)
    if problem is not None:
        return problem
    return Request(
        command=document["command"],
        unit=document["unit"],
        scope=document.get("scope", "unit"),
        grace=_number(document.get("grace")),
        timeout=_number(document.get("timeout")),
        json=bool(document.get("json", False)),
    )


def _problem(document: dict[str, object]) -> str | None:
    """What is wrong with a decoded request, if anything."""
    unknown = set(document) - _KEYS
    if unknown or document.get("v") != VERSION:
        return f"request is not version {VERSION} of the gate protocol"
    unit = document.get("unit")
    problem = None
    if document.get("command") not in COMMANDS:
        problem = "unknown command"
    elif not isinstance(unit, str) or not SERVICE_NAME.fullmatch(unit):
        problem = "unit is not a service unit name such as sglang.service"
    elif document.get("scope", "unit") not in SCOPES:
        problem = "unknown scope"
    elif not isinstance(document.get("json", False), bool):
        problem = "json must be true or false"
    else:
        for key, limit in (("grace", MAX_GRACE_S), ("timeout", MAX_TIMEOUT_S)):
            value = document.get(key)
            if value is not None and not _in_range(value, limit):
                problem = f"{key} must be a number of seconds from 0 to {limit:g}"
    return problem


def _in_range(value: object, limit: float) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and 0 <= value <= limit  # first: isfinite(10**400) raises OverflowError
        and math.isfinite(value)
    )


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def frame_text(fd: int, text: str) -> bytes:
    """One output line for the client's stdout (1) or stderr (2), cut to MAX_TEXT_CHARS."""
    if len(text) > MAX_TEXT_CHARS:
        text = text[: MAX_TEXT_CHARS - 1] + "…"
    return json.dumps({"fd": fd, "text": text}).encode() + b"\n"


def frame_exit(code: int) -> bytes:
    """The verdict: the exit status the client ends with."""
    return json.dumps({"exit": code}).encode() + b"\n"


class Frame(NamedTuple):
    """One decoded response line: output (``fd``, ``text``) or the verdict (``exit``)."""

    fd: int = 0
    text: str = ""
    exit: int | None = None


def parse_frame(line: bytes) -> Frame | None:
    """A response line decoded, or None when it is not one the protocol allows."""
    try:
        document = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    code = document.get("exit")
    if set(document) == {"exit"} and type(code) is int and 0 <= code <= 255:  # not a bool
        return Frame(exit=code)
    fd, text = document.get("fd"), document.get("text")
    if set(document) == {"fd", "text"} and type(fd) is int and fd in (1, 2) and type(text) is str:
        return Frame(fd=fd, text=text)
    return None
