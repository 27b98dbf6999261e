"""The frame of ``gpuguard status --watch`` (pure): redrawn in place, cut to the terminal.

Like ``watch(1)`` without its flicker: the screen is never cleared. Each frame homes the cursor,
overwrites line by line, clears what is left of each line and, after the last, the rest of the
screen. Lines are cut to the terminal's width and the frame to its height: a wrapped line would
push the frame off the screen. Width is measured in terminal cells, not code points: a wide
East-Asian character takes two cells, a combining mark or a format character none, so a
tenant's wide characters in a unit's output cannot wrap a line. The frame's text comes
escaped from the status renderer; the header escapes the host name. ``adapters.terminal`` draws it.
"""

from __future__ import annotations

import unicodedata
from typing import TYPE_CHECKING, Final

from gpuguard.core.escaping import escape

if TYPE_CHECKING:
    from datetime import datetime

ENTER: Final = "\x1b[?1049h\x1b[?25l"
"""Alternate screen on, cursor hidden."""
LEAVE: Final = "\x1b[?1049l\x1b[?25h"
"""Alternate screen off (the normal screen comes back as it was), then the cursor shown: a
terminal that keeps the cursor's visibility per screen (tmux) shows it on the normal one."""
_HOME: Final = "\x1b[H"
_CLEAR_LINE: Final = "\x1b[K"
_CLEAR_BELOW: Final = "\x1b[J"
MIN_INTERVAL_S: Final = 0.1
MAX_INTERVAL_S: Final = 86_400.0


def interval(text: str) -> float:
    """``--watch``'s SECONDS: a number from 0.1 to 86400 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise ValueError(f"--watch takes {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} seconds")
    return value


def compose(text: str, header: str, columns: int, rows: int) -> str:
    """One frame: the header and ``text`` cut to ``columns`` x ``rows`` (pure).

    Every line ends with clear-to-end-of-line and the frame with clear-to-end-of-screen, so
    a shorter frame leaves nothing of the one before. The last row stays free of a newline:
    writing one there would scroll the screen.
    """
    columns = max(columns, 20)
    rows = max(rows, 3)
    lines = [header, "", *text.rstrip("\n").split("\n")]
    if len(lines) > rows:
        hidden = len(lines) - rows + 1
        lines = [*lines[: rows - 1], f"… {hidden} more lines (enlarge the terminal)"]
    cut = [_fit(line, columns) for line in lines]
    return _HOME + (_CLEAR_LINE + "\n").join(cut) + _CLEAR_LINE + _CLEAR_BELOW


def cells(char: str) -> int:
    """The terminal cells one code point takes: 2 wide, 0 combining or format, else 1."""
    if unicodedata.combining(char) or unicodedata.category(char) in _ZERO_WIDTH:
        return 0
    return 2 if unicodedata.east_asian_width(char) in _WIDE else 1


def width(line: str) -> int:
    """The terminal cells ``line`` takes (its characters' :func:`cells`, summed)."""
    return sum(cells(char) for char in line)


_ZERO_WIDTH: Final = frozenset({"Mn", "Me", "Cf"})
_WIDE: Final = frozenset({"W", "F"})


def _fit(line: str, columns: int) -> str:
    """``line`` if it fits ``columns`` cells, else cut to ``columns - 1`` cells and '…'."""
    if width(line) <= columns:
        return line
    used = 0
    for index, char in enumerate(line):
        used += cells(char)
        if used > columns - 1:
            return line[:index] + "…"
    return line  # pragma: no cover - width(line) > columns means the loop returns


def header(interval_s: float, now: datetime, host: str) -> str:
    """``Every 2s: gpuguard status   host: 2026-12-01 05:27:35 UTC`` (the host escaped)."""
    return (
        f"Every {interval_s:g}s: gpuguard status   {escape(host, 64)}: "
        f"{now.strftime('%Y-%m-%d %H:%M:%S')} UTC   (Ctrl-C to quit)"
    )
