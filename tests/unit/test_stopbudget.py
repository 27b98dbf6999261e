"""A unit's own ExecStopPost= reap fits its waits into what is left of TimeoutStopSec=."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.stopbudget import MARGIN_S, ReapTimes, fit

DROP_IN = ReapTimes(grace_s=5.0, kill_wait_s=5.0, timeout_s=20.0)
"""What the gate drop-in's ExecStopPost= asks for: --grace 5, the reaper's 5 s, --timeout 20."""


def test_a_long_stop_timeout_leaves_the_reap_as_asked() -> None:
    """TimeoutStopSec=90s: 5 s grace, 5 s after SIGKILL and 20 s for the memory all fit."""
    assert fit(DROP_IN, 90.0) == DROP_IN


@pytest.mark.parametrize("infinite", [None, 0.0])
def test_an_infinite_stop_timeout_cuts_nothing(infinite: float | None) -> None:
    """TimeoutStopSec=infinity (or 0, which systemd reads as infinity): as asked."""
    assert fit(DROP_IN, infinite) == DROP_IN


def test_the_incidents_five_seconds_give_up_the_memory_wait_then_shrink_the_signals() -> None:
    """TimeoutStopSec=5s: no wait for the memory, grace and SIGKILL's wait halve what is left."""
    times = fit(DROP_IN, 5.0)
    assert times.timeout_s == 0.0
    assert times.grace_s == pytest.approx((5.0 - MARGIN_S) / 2)
    assert times.kill_wait_s == pytest.approx((5.0 - MARGIN_S) / 2)
    assert times.total_s == pytest.approx(5.0 - MARGIN_S)
    assert times.cut_by_s == 5.0
    assert times.in_words() == (
        "1.8 s SIGTERM grace, 1.8 s after SIGKILL, "
        "no wait for the memory (the next start's gate waits for it)"
    )


def test_a_middling_stop_timeout_shortens_only_the_memory_wait() -> None:
    """TimeoutStopSec=20s: the signals keep their 10 s, the memory wait gets the rest."""
    times = fit(DROP_IN, 20.0, spent_s=0.5)
    assert (times.grace_s, times.kill_wait_s) == (5.0, 5.0)
    assert times.timeout_s == pytest.approx(20.0 - MARGIN_S - 0.5 - 10.0)


def test_a_budget_already_spent_leaves_no_wait_at_all() -> None:
    """The inventory took the whole stop timeout: every wait is 0, none negative."""
    times = fit(DROP_IN, 5.0, spent_s=9.0)
    assert times.total_s == 0.0


@given(
    grace=st.floats(0, 600),
    kill=st.floats(0, 60),
    timeout=st.floats(0, 3600),
    stop=st.floats(0.001, 86400),
    spent=st.floats(0, 100),
)
def test_the_fitted_waits_end_within_the_stop_timeout(
    grace: float, kill: float, timeout: float, stop: float, spent: float
) -> None:
    """Any budget: no wait longer than asked or negative, all of them within what is left."""
    asked = ReapTimes(grace, kill, timeout)
    times = fit(asked, stop, spent)
    assert 0 <= times.grace_s <= grace
    assert 0 <= times.kill_wait_s <= kill
    assert 0 <= times.timeout_s <= timeout
    assert times.total_s <= max(stop - MARGIN_S - spent, 0.0) + 1e-6
