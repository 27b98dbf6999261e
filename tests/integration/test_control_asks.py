"""The gate parent's asks of systemd for a unit's control process: real spawned processes.

A shell stands in for ``systemctl show``; the asks are read through a real poll(), as the
server's loop reads them, and every spawned process is reaped here as the parent reaps it.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from typing import TYPE_CHECKING

from gpuguard.adapters.controlasks import ASK_LIMIT_S, PENDING_PER_UNIT, ControlAsks

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

import pytest

UNIT = "sglang.service"


def _ticks_now() -> int:
    """The boot clock in /proc/PID/stat start-time ticks."""
    hz = os.sysconf("SC_CLK_TCK")
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * hz // 1_000_000_000


@pytest.fixture
def control() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that the stand-in names as the unit's ControlPID=, a tick old at least.

    An answer asked in the tick a process started in cannot speak for it (a real gate client
    connects after its interpreter has started, tens of ticks later).
    """
    process = subprocess.Popen(["sleep", "600"])
    started = _started(process.pid)
    while _ticks_now() <= started:
        time.sleep(0.001)
    yield process
    process.kill()
    process.wait()


def _started(pid: int) -> int:
    """When ``pid`` started, as the parent reads it (pinned by a pidfd, closed after)."""
    pidfd = os.pidfd_open(pid)
    try:
        tick = ControlAsks[str]().started(pid, pidfd)
    finally:
        os.close(pidfd)
    assert tick is not None
    return tick


def _answering(pid: int) -> Callable[[str], list[str]]:
    return lambda _: ["/bin/sh", "-c", f"echo SubState=start-pre; echo ControlPID={pid}"]


def _until_decided(asks: ControlAsks[str], poller: select.poll) -> list[tuple[str, bool]]:
    """Poll the asks' pipes and read them until something is decided (30 s at most)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for fd, _ in poller.poll(1000):
            if asks.owns(fd) and (decided := asks.read(fd)):
                return decided
    pytest.fail("no answer within 30 s")


def _reap(asks: ControlAsks[str]) -> None:
    for pid in list(asks.unreaped):
        os.waitpid(pid, 0)
        asks.reaped(pid)


def test_the_named_process_is_the_control_process_and_another_is_not(
    control: subprocess.Popen[bytes],
) -> None:
    """Both connections started before the ask: one answer decides both, and later ones too."""
    asks: ControlAsks[str] = ControlAsks(_answering(control.pid))
    asks.poller = poller = select.poll()
    mine = os.getpid()
    started = {pid: _started(pid) for pid in (control.pid, mine)}
    assert asks.decide(UNIT, control.pid, started[control.pid]) is None  # nothing asked yet
    assert asks.pend(UNIT, "control", control.pid, started[control.pid])
    assert asks.pend(UNIT, "worker", mine, started[mine])
    assert sorted(_until_decided(asks, poller)) == [("control", True), ("worker", False)]
    # The answer stands for processes that existed when it was asked: no second ask.
    assert asks.decide(UNIT, control.pid, started[control.pid]) is True
    assert asks.decide(UNIT, mine, started[mine]) is False
    assert asks.deadline() is None
    _reap(asks)


def test_a_process_started_after_the_ask_waits_for_the_next_one(
    control: subprocess.Popen[bytes],
) -> None:
    """A caller younger than the answer is not decided by it: a new ask is made at once."""
    asks: ControlAsks[str] = ControlAsks(_answering(control.pid))
    asks.poller = poller = select.poll()
    started = _started(control.pid)
    assert asks.pend(UNIT, "old", control.pid, started)
    assert asks.pend(UNIT, "young", control.pid, 2**62)  # started long after any ask
    assert _until_decided(asks, poller) == [("old", True)]
    assert asks.deadline() is not None, "the next ask is on its way"
    asks.drop()
    _reap(asks)


def test_systemd_not_answering_makes_no_control_process(
    control: subprocess.Popen[bytes],
) -> None:
    """An ask past its limit is killed, and nobody waiting for it is the control process."""
    asks: ControlAsks[str] = ControlAsks(lambda _: ["/bin/sleep", "600"])
    asks.poller = select.poll()
    started = _started(control.pid)
    assert asks.pend(UNIT, "control", control.pid, started)
    [spawned] = asks.unreaped
    assert asks.expire(time.monotonic()) == []  # not yet overdue
    assert asks.expire(time.monotonic() + ASK_LIMIT_S + 1) == [("control", False)]
    _, status = os.waitpid(spawned, 0)
    assert os.WIFSIGNALED(status), "the overdue systemctl was killed"
    asks.reaped(spawned)


def test_a_unit_keeps_at_most_pending_per_unit_callers_and_asks_once(
    control: subprocess.Popen[bytes],
) -> None:
    """Undecided callers wait up to the bound, with one ask for them all; the next is told no."""
    asks: ControlAsks[str] = ControlAsks(_answering(control.pid))
    asks.poller = select.poll()
    started = _started(control.pid)
    assert all(asks.pend(UNIT, f"c{i}", control.pid, started) for i in range(PENDING_PER_UNIT))
    assert not asks.pend(UNIT, "one too many", control.pid, started)
    assert len(asks.unreaped) == 1, "one ask per unit at a time"
    assert len(asks.drop()) == PENDING_PER_UNIT
    _reap(asks)
