"""``gpuguard status --watch``: the status screen, redrawn in place every few seconds.

Like ``watch(1)`` without its flicker: the screen is never cleared. Each frame homes the cursor,
overwrites line by line, clears what is left of each line and, after the last, the rest of the
screen. It runs in the terminal's alternate screen with the cursor hidden, and whatever ends it
(Ctrl-C, SIGTERM, a hangup) puts both back, so the operator's scrollback is as it was. Lines are
cut to the terminal's width and the frame to its height: a wrapped line would push the frame
off the screen. The frame's text comes escaped from the status renderer; the header escapes
the host name.

Standard output that is not a terminal is refused (a pipe or a file would fill with control
sequences): ``gpuguard status`` or ``--json`` in a loop is the tool for that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final, TextIO

from gpuguard.escaping import escape

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType

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
EX_USAGE: Final = 64


class _Stop(Exception):  # noqa: N818 - a signal's request, not an error
    """Raised by the SIGTERM/SIGHUP handler: leave the loop and restore the terminal."""


class _Resize(Exception):  # noqa: N818 - a signal's request, not an error
    """Raised by the SIGWINCH handler while waiting: draw the next frame now."""


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


def _fit(line: str, columns: int) -> str:
    return line if len(line) <= columns else line[: columns - 1] + "…"


def header(interval_s: float, now: datetime, host: str) -> str:
    """``Every 2s: gpuguard status   host: 2026-12-01 05:27:35 UTC`` (the host escaped)."""
    return (
        f"Every {interval_s:g}s: gpuguard status   {escape(host, 64)}: "
        f"{now.strftime('%Y-%m-%d %H:%M:%S')} UTC   (Ctrl-C to quit)"
    )


def run(frame: Callable[[], str], interval_s: float, out: TextIO) -> int:
    """Draw ``frame()`` every ``interval_s`` seconds until a signal ends it; 0 then.

    EX_USAGE when ``out`` is not a terminal. A terminal that goes away (hangup, EIO, a closed
    pipe) ends it quietly: there is nothing left to restore.
    """
    if not out.isatty():
        sys.stderr.write(
            "gpuguard status --watch: standard output is not a terminal; run "
            "`gpuguard status` (or --json) in a loop instead\n"
        )
        return EX_USAGE
    host = socket.gethostname()
    try:
        with _signals() as waiting, _screen(out):
            while True:
                size = os.get_terminal_size(out.fileno())
                text = frame()
                top = header(interval_s, datetime.now(UTC), host)
                out.write(compose(text, top, size.columns, size.lines))
                out.flush()
                waiting[0] = True
                with contextlib.suppress(_Resize):
                    time.sleep(interval_s)
                waiting[0] = False
    except (_Stop, KeyboardInterrupt):
        return 0
    except OSError:  # the terminal is gone (EIO, EPIPE): nothing to draw on or restore
        return 0


@contextlib.contextmanager
def _screen(out: TextIO) -> Iterator[None]:
    """The alternate screen with a hidden cursor, left however the body ends."""
    out.write(ENTER)
    out.flush()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            out.write(LEAVE)
            out.flush()


@contextlib.contextmanager
def _signals() -> Iterator[list[bool]]:
    """SIGTERM and SIGHUP end the loop; SIGWINCH redraws at once if it comes while waiting.

    A resize that comes while a frame is drawn is not raised there (it would cut the frame in
    half): the next frame reads the new size anyway.
    """
    waiting = [False]

    def stop(_signum: int, _frame: FrameType | None) -> None:
        raise _Stop

    def resize(_signum: int, _frame: FrameType | None) -> None:
        if waiting[0]:
            waiting[0] = False
            raise _Resize

    before = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, stop),
        signal.SIGHUP: signal.signal(signal.SIGHUP, stop),
        signal.SIGWINCH: signal.signal(signal.SIGWINCH, resize),
    }
    try:
        yield waiting
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
