"""``gpuguard breaker``: the host-wide breaker's state, and ``--close``, root's one way to close it.

The daemon opens the breaker after ``breaker_max_recoveries`` recoveries in
``breaker_window_s`` (core.breaker) and from then on only reports; it never closes it by
itself. A person closes it here, after checking the host: the file is rewritten closed with a
fresh window, and the daemon reads it before its next recovery.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from gpuguard.adapters import breakerfile, releaselog
from gpuguard.commands.output import Said
from gpuguard.core.breaker import close, in_window, open_phrase
from gpuguard.core.exits import EX_CANTCREAT, EX_NOPERM
from gpuguard.core.levels import Level

if TYPE_CHECKING:
    from gpuguard.config import Settings


def run(settings: Settings, *, close_it: bool) -> Said:
    """Say the breaker's state (exit 0 closed, 2 open); with ``close_it``, close it (root)."""
    limits = settings.daemon.breaker_limits()
    found = breakerfile.load(settings.runtime_dir, releaselog.boot_id())
    if found is None or not found.is_open:
        recent = len(in_window(found, limits, time.monotonic())) if found else 0
        said = (
            f"breaker closed: {recent} of {limits.max_recoveries} recoveries in the last "
            f"{limits.window_s / 60:g} min"
        )
        return Said(int(Level.OK), (said,))
    opened = open_phrase(found, limits)
    if not close_it:
        return Said(
            int(Level.CRITICAL),
            (
                f"{opened}; {found.refused} refused since: gpuguard's daemon only reports",
                "after checking the host (gpuguard status): gpuguard breaker --close",
            ),
        )
    if os.geteuid() != 0:
        return Said(EX_NOPERM, notices=("gpuguard: breaker --close needs root",))
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        breakerfile.save(
            settings.runtime_dir, close(found, at=at, by="gpuguard breaker --close (uid 0)")
        )
    except OSError as err:
        return Said(EX_CANTCREAT, notices=(f"gpuguard: cannot close the breaker: {err}",))
    return Said(
        int(Level.OK),
        (f"breaker closed at {at}; it was {opened}, {found.refused} refused since",),
    )
