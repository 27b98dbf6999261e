"""What doctor answers: a finding with its severity, and how its numbers and foreign text read.

A finding's severity is a monitoring-plugin level (its worst is doctor's exit status), and every
number in it is written the way systemd writes a time span, so a suggested line can be pasted
into a drop-in as it is. Foreign text (names, paths, environment values) goes through ``show``,
which escapes it onto one line and cuts it: what is at risk is a process name that forges a line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape
from gpuguard.core.levels import Level

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

NAME_CHARS: Final = 64
VALUE_CHARS: Final = 200


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing to change (or know), why, and the drop-in lines that change it.

    ``fix`` lines belong to ``section`` (``Service`` or ``Unit``); ``advice`` is what no drop-in
    line can do (install the gate, change a path's owner).
    """

    code: str
    severity: Level
    title: str
    evidence: tuple[str, ...] = ()
    fix: tuple[str, ...] = ()
    section: str = "Service"
    advice: str | None = None


def worst(findings: Iterable[Finding]) -> Level:
    """The exit status: the worst severity (UNKNOWN counts as worse than CRITICAL)."""
    return max((f.severity for f in findings), default=Level.OK)


def show(text: str, limit: int) -> str:
    """Foreign text on one line, escaped, cut to ``limit`` characters (with a marker)."""
    return escape(text, limit)


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank) of sorted ``values``."""
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


def round_up(seconds: float) -> float:
    """Up to a round value: 5 s steps below a minute, 30 s below 10 min, then whole minutes."""
    if seconds <= 60:
        step = 5.0
    elif seconds <= 600:
        step = 30.0
    else:
        step = 60.0
    return max(step, math.ceil(seconds / step) * step)


def span(seconds: float) -> str:
    """Seconds as systemd writes a time span: "90s" → "1min 30s", "0.1" → "100ms"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [
        f"{hours}h" if hours else "",
        f"{minutes}min" if minutes else "",
        f"{secs}s" if secs else "",
    ]
    return " ".join(p for p in parts if p) or "0"


def span_or_off(seconds: float | None) -> str:
    """A time span, or systemd's "infinity" for none."""
    return "infinity" if seconds is None else span(seconds)
