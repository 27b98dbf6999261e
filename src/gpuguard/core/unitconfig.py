"""A unit's effective settings as ``systemctl show`` prints them, and EnvironmentFile= text (pure).

``systemctl show`` prints the settings with every drop-in applied, so this is what systemd will
really do, not what the unit file says. Its text comes from root's systemd, but the values in
it (Environment=, paths, ExecStartPre= command lines) were written by whoever wrote the unit or
its environment files; every parser here is total and linear, and bounded in what it keeps.
EnvironmentFile= contents are the service side's text: parsed the way systemd reads them, never
executed, cut at ``ENV_FILE_MAX_BYTES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

PROPERTIES: Final = (
    "LoadState",
    "User",
    "Type",
    "KillMode",
    "TimeoutStopUSec",
    "TimeoutStartUSec",
    "Restart",
    "RestartUSec",
    "StartLimitIntervalUSec",
    "StartLimitBurst",
    "Environment",
    "EnvironmentFiles",
    "ExecStartPre",
    "ExecStart",
    "DropInPaths",
)
"""What ``doctor`` asks systemd for (``systemctl show --property=…``)."""

ENV_FILE_MAX_BYTES: Final = 64 * 1024
"""An environment file is read up to this; systemd's own limit is far larger, ours is enough."""
_MAX_VALUES: Final = 64  # repeated properties (ExecStartPre=, EnvironmentFiles=) kept per key
_MAX_LINE: Final = 8192  # a show line longer than this is cut (no setting needs more)

_SPAN_UNITS: Final = {
    "us": 1e-6,
    "usec": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "msec": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "w": 604800.0,
    "week": 604800.0,
    "weeks": 604800.0,
    "M": 2629800.0,
    "month": 2629800.0,
    "months": 2629800.0,
    "y": 31557600.0,
    "year": 31557600.0,
    "years": 31557600.0,
}
_SPAN_PART = re.compile(r"\s*(\d{1,12}(?:\.\d{1,9})?)\s*([a-zA-Zµ]{0,7})")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_ARGV = re.compile(r"argv\[\]=(?P<argv>[^;]{0,4096})")
_ENV_FILE = re.compile(r"(?P<path>\S{1,4096}) \(ignore_errors=(?P<ignore>yes|no)\)")


@dataclass(frozen=True, slots=True)
class UnitConfig:
    """The settings of one unit that decide how its stops, restarts and gate behave.

    Times are seconds; ``None`` is systemd's ``infinity`` (or a value that could not be read,
    which ``unreadable`` then names).
    """

    unit: str
    load_state: str | None = None
    user: str | None = None
    type: str | None = None
    kill_mode: str | None = None
    timeout_stop_s: float | None = None
    timeout_start_s: float | None = None
    restart: str | None = None
    restart_s: float | None = None
    start_limit_interval_s: float | None = None
    start_limit_burst: int | None = None
    environment: dict[str, str] = field(default_factory=dict)
    environment_files: tuple[tuple[str, bool], ...] = ()
    """(path, ignore_errors) of each EnvironmentFile=, in order."""
    exec_start_pre: tuple[tuple[str, ...], ...] = ()
    """The argv of each ExecStartPre= command."""
    exec_start: tuple[tuple[str, ...], ...] = ()
    """The argv of each ExecStart= command (the server's command line: foreign text, shown only
    through ``core.redaction.display_command``)."""
    drop_in_paths: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()


def parse_show(unit: str, text: str) -> UnitConfig:
    """``systemctl show --property=…`` output (KEY=VALUE lines, some keys repeated) → settings."""
    values: dict[str, list[str]] = {}
    for raw in text.splitlines():
        key, sep, value = raw[:_MAX_LINE].partition("=")
        if sep and key in PROPERTIES:
            kept = values.setdefault(key, [])
            if len(kept) < _MAX_VALUES:
                kept.append(value)
    unreadable: list[str] = []

    def one(key: str) -> str | None:
        found = values.get(key)
        return found[-1] if found and found[-1] else None

    def span(key: str) -> float | None:
        value = one(key)
        if value is None or value == "infinity":
            return None
        seconds = parse_timespan(value)
        if seconds is None:
            unreadable.append(key)
        return seconds

    burst = one("StartLimitBurst")
    return UnitConfig(
        unit=unit,
        load_state=one("LoadState"),
        user=one("User"),
        type=one("Type"),
        kill_mode=one("KillMode"),
        timeout_stop_s=span("TimeoutStopUSec"),
        timeout_start_s=span("TimeoutStartUSec"),
        restart=one("Restart"),
        restart_s=span("RestartUSec"),
        start_limit_interval_s=span("StartLimitIntervalUSec"),
        start_limit_burst=int(burst) if burst and burst.isdecimal() and len(burst) < 10 else None,
        environment=parse_environment(" ".join(values.get("Environment", []))),
        environment_files=tuple(
            (match["path"], match["ignore"] == "yes")
            for value in values.get("EnvironmentFiles", [])
            if (match := _ENV_FILE.fullmatch(value))
        ),
        exec_start_pre=tuple(
            tuple(_split(match["argv"]))
            for value in values.get("ExecStartPre", [])
            if (match := _ARGV.search(value))
        ),
        exec_start=tuple(
            tuple(_split(match["argv"]))
            for value in values.get("ExecStart", [])
            if (match := _ARGV.search(value))
        ),
        drop_in_paths=tuple(" ".join(values.get("DropInPaths", [])).split()),
        unreadable=tuple(unreadable),
    )


def exec_argvs(value: str) -> tuple[tuple[str, ...], ...]:
    """The argv of each command in one Exec*= property's text (``{ path=… ; argv[]=… ; … }``)."""
    return tuple(tuple(_split(match["argv"])) for match in _ARGV.finditer(value[:_MAX_LINE]))


def parse_timespan(text: str) -> float | None:
    """A systemd time span ("1min 30s", "100ms", "2h", "5") in seconds; None if not one.

    A bare number is seconds, as systemd reads it; every part must have a known unit.
    """
    text = text.strip()
    if not text or len(text) > 200:
        return None
    total = 0.0
    position = 0
    while position < len(text):
        match = _SPAN_PART.match(text, position)
        if match is None or match.end() == position:
            return None
        number, unit = match.groups()
        factor = _SPAN_UNITS.get(unit or "s")
        if factor is None:
            return None
        total += float(number) * factor
        position = match.end()
    return total


def parse_environment(value: str) -> dict[str, str]:
    """The Environment= property (shell-quoted NAME=value words) as a dict; later names win."""
    env: dict[str, str] = {}
    for word in _split(value):
        name, sep, text = word.partition("=")
        if sep and _ENV_NAME.fullmatch(name):
            env[name] = text
    return env


def parse_environment_file(data: bytes) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it: NAME=VALUE lines, ``#``/``;`` comments.

    Total and linear: undecodable bytes become replacement characters, quotes are single or
    double (backslash escapes inside double quotes), a trailing backslash joins the next line,
    an optional leading ``export`` is dropped, and a line that is none of this is skipped.
    """
    text = data[:ENV_FILE_MAX_BYTES].decode("utf-8", errors="replace")
    env: dict[str, str] = {}
    logical: list[str] = []
    for line in text.splitlines():
        if line.endswith("\\") and not line.endswith("\\\\"):
            logical.append(line[:-1])
            continue
        logical.append(line)
        _assign("".join(logical), env)
        logical = []
    if logical:
        _assign("".join(logical), env)
    return env


def _assign(line: str, env: dict[str, str]) -> None:
    stripped = line.strip()
    if not stripped or stripped[0] in "#;":
        return
    stripped = stripped.removeprefix("export ").lstrip()
    name, sep, value = stripped.partition("=")
    name = name.strip()
    if sep and _ENV_NAME.fullmatch(name):
        env[name] = _unquote(value.strip())


def _unquote(value: str) -> str:
    """A value without its surrounding quotes; inside "…", backslash escapes the next character."""
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        inner = value[1:-1]
        out: list[str] = []
        escaped = False
        for char in inner:
            if escaped:
                out.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            else:
                out.append(char)
        return "".join(out)
    return value


def _split(value: str) -> list[str]:
    """Shell words, or whitespace-separated words when the quoting is broken."""
    words = shell_words(value)
    return value.split() if words is None else words


# One token of POSIX shell words. The alternatives start with different characters and none can
# match inside another, so scanning is linear; an open quote or a lone final backslash matches
# nothing, which shell_words reports as None.
_SHELL_TOKEN = re.compile(r"""\s+|'[^']*'|"(?:[^"\\]|\\.)*"|\\.|[^\s'"\\]+""", re.DOTALL)
_DOUBLE_QUOTED_ESCAPE = re.compile(r'\\(["\\])')


def shell_words(text: str) -> list[str] | None:
    r"""``shlex.split(text)``'s words, or None when a quote is left open or text ends in ``\``.

    Not shlex itself: it grows each word a character at a time, quadratic in a long word, and a
    unit's Environment= may carry anything its author wrote.
    """
    words: list[str] = []
    word: list[str] | None = None
    position = 0
    for token in _SHELL_TOKEN.finditer(text):
        if token.start() != position:
            return None
        position = token.end()
        piece = token.group()
        if piece[0].isspace():
            if word is not None:
                words.append("".join(word))
            word = None
            continue
        if word is None:
            word = []
        word.append(_shell_unquote(piece))
    if position != len(text):
        return None
    if word is not None:
        words.append("".join(word))
    return words


def _shell_unquote(token: str) -> str:
    """The text one non-blank token of shell_words stands for."""
    if token[0] == "'":
        return token[1:-1]
    if token[0] == '"':
        return _DOUBLE_QUOTED_ESCAPE.sub(r"\1", token[1:-1])
    if token[0] == "\\":
        return token[1]
    return token
