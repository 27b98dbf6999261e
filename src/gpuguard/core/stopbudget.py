"""How much time a unit's own ExecStopPost= reap may spend: what fits in its TimeoutStopSec= (pure).

systemd gives the stop-post phase of a stop (the ExecStopPost= commands) the unit's
TimeoutStopSec= afresh, and kills a command still running past it ("State 'stop-post' timed
out. Terminating."): the reap is cut mid-grace, its survivors stay until the next start, and
the stop ends "Failed with result 'timeout'". The gate drop-in's reap asks for a 5 s SIGTERM
grace, the reaper's 5 s wait after SIGKILL and a 20 s wait for the memory to go (30 s); in a
shorter TimeoutStopSec= it takes what fits, in this order of giving up: first the wait for the
memory (the next start's gate waits for it anyway), then the grace and SIGKILL's wait, shrunk in
proportion. ``MARGIN_S`` of the budget stays unused: the client's own start, the answer's way
back and systemd's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MARGIN_S: Final = 1.5
"""Seconds of the stop timeout the reap leaves to what is not its own work."""


@dataclass(frozen=True, slots=True)
class ReapTimes:
    """The reap's three waits, in seconds, and the stop timeout that cut them (None: not cut)."""

    grace_s: float
    kill_wait_s: float
    timeout_s: float
    cut_by_s: float | None = None

    @property
    def total_s(self) -> float:
        """The longest the reap's waits take together."""
        return self.grace_s + self.kill_wait_s + self.timeout_s

    def in_words(self) -> str:
        """The waits as doctor and the reap's note say them."""
        wait = (
            f"{self.timeout_s:.1f} s wait for the memory"
            if self.timeout_s > 0
            else "no wait for the memory (the next start's gate waits for it)"
        )
        return f"{self.grace_s:.1f} s SIGTERM grace, {self.kill_wait_s:.1f} s after SIGKILL, {wait}"


DROP_IN: Final = ReapTimes(grace_s=5.0, kill_wait_s=5.0, timeout_s=20.0)
"""What the gate drop-in's ExecStopPost= asks for (adapters/dropin.py writes its --grace and
--timeout from it; the 5 s after SIGKILL are the reaper's own, adapters/reaper.KILL_WAIT_S)."""


def fit(asked: ReapTimes, stop_timeout_s: float | None, spent_s: float = 0.0) -> ReapTimes:
    """``asked`` as it fits what is left of a ``stop_timeout_s`` after ``spent_s`` of it.

    ``stop_timeout_s`` None or 0 is systemd's infinity (``TimeoutStopSec=infinity`` or 0): no
    cut. Whatever the budget, no wait is negative, and none longer than asked.
    """
    if stop_timeout_s is None or stop_timeout_s <= 0:
        return asked
    left = max(stop_timeout_s - MARGIN_S - max(spent_s, 0.0), 0.0)
    if left >= asked.total_s:
        return asked
    signals = asked.grace_s + asked.kill_wait_s
    if left >= signals:
        return ReapTimes(asked.grace_s, asked.kill_wait_s, left - signals, stop_timeout_s)
    share = left / signals if signals > 0 else 0.0
    return ReapTimes(asked.grace_s * share, asked.kill_wait_s * share, 0.0, stop_timeout_s)
