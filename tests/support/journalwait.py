"""Waiting on a JournalFollower the way the daemon's loop does, for tests and benchmarks.

The daemon never blocks inside the follower: its loop polls ``fds()`` beside its other watches,
with a timeout of ``wake_in()``, then calls ``read_available()``. ``poll`` is that wait alone,
for a caller with nothing else to watch.
"""

from __future__ import annotations

import math
import select
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.adapters.journal import JournalFollower, JournalRecord


def poll(follower: JournalFollower, timeout_s: float) -> list[JournalRecord]:
    """Wait up to ``timeout_s`` (shortened to ``wake_in()``) for entries, then read them."""
    wait_s = timeout_s
    wake = follower.wake_in()
    if wake is not None:
        wait_s = min(wait_s, wake)
    fds = follower.fds()
    if fds:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(max(0, math.ceil(wait_s * 1000)))
    elif wait_s > 0:
        time.sleep(wait_s)
    return follower.read_available()
