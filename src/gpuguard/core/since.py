"""The start of a history window, ``--since 1h`` or ``--since 2026-12-01T06:00`` (pure).

An operator's argument, parsed by hand: a bounded length, one pass, a clear message for
anything else. Relative windows are whole numbers of seconds, minutes, hours or days; an
absolute time is ISO 8601 (a time without an offset is the host's local time).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Final

_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_S: Final = 3650 * 86400
"""Ten years: further back than any journal or snapshot keeps, and far from overflow."""
_MAX_CHARS: Final = 40
USAGE: Final = (
    "a window like 90s, 30m, 1h, 2d, or an ISO time like 2026-12-01T06:00 or "
    "2026-12-01T06:00:00+00:00"
)


@dataclass(frozen=True, slots=True)
class Since:
    """A window's start: ``seconds`` before now, or the time ``at``."""

    text: str
    seconds: int | None = None
    at: datetime | None = None

    def start(self, now: datetime) -> datetime:
        """The window's first moment, as an aware time."""
        if self.at is not None:
            return self.at
        return now - timedelta(seconds=self.seconds or 0)


def parse_since(text: str) -> Since:
    """``text`` as a window start; ValueError with the accepted forms otherwise."""
    word = text.strip()
    if not word or len(word) > _MAX_CHARS or not word.isascii():
        raise ValueError(f"{word[:_MAX_CHARS]!r} is not {USAGE}")
    number, unit = word[:-1], word[-1:].lower()
    if unit in _UNITS and number.isdecimal():
        seconds = int(number) * _UNITS[unit]
        if seconds > _MAX_S:
            raise ValueError(f"{word!r} reaches back more than ten years")
        return Since(word, seconds=seconds)
    try:
        at = datetime.fromisoformat(word)
    except ValueError:
        raise ValueError(f"{word!r} is not {USAGE}") from None
    if at.tzinfo is None:
        at = at.astimezone()  # the host's local time, as journalctl --since reads it
    return Since(word, at=at.astimezone(timezone.utc))


def within(start: datetime | None, iso_time: object) -> bool:
    """Whether a recorded ISO time falls at or after ``start`` (no window: always).

    A record without a readable time cannot be placed in a window and is left out of it.
    """
    if start is None:
        return True
    if not isinstance(iso_time, str) or len(iso_time) > _MAX_CHARS:
        return False
    try:
        when = datetime.fromisoformat(iso_time)
    except ValueError:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)  # gpuguard writes UTC
    return when >= start
