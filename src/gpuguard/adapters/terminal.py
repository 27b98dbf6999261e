"""``gpuguard status --watch`` on the terminal: draw a frame every few seconds, then leave.

It runs in the terminal's alternate screen with the cursor hidden, and whatever ends it
(Ctrl-C, SIGTERM, a hangup) puts both back, so the operator's scrollback is as it was. The
frames are ``core.watchframe``'s. Standard output that is not a terminal is refused (a pipe or a
file would fill with control sequences): ``gpuguard status`` or ``--json`` in a loop is the tool
for that. Signal handlers are installed here; nothing is sent (``adapters.signals`` sends).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, TextIO

from gpuguard.core.exits import EX_USAGE
from gpuguard.core.watchframe import ENTER, LEAVE, compose, header

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType


class _Stop(Exception):  # noqa: N818 - a signal's request, not an error
    """Raised by the SIGTERM/SIGHUP handler: leave the loop and restore the terminal."""


class _Resize(Exception):  # noqa: N818 - a signal's request, not an error
    """Raised by the SIGWINCH handler while waiting: draw the next frame now."""


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
                top = header(interval_s, datetime.now(timezone.utc), host)
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
