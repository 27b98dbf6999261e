"""The gate's loop (core.gate.run_gate) over an in-memory host: reaping frees memory, or not.

The host twin (tests/support/daemontwins.py) lists its processes to NVML and /proc and removes
those it is asked to reap, so the loop's whole path runs without root: plan, reap, gather
again, pass; or spare, wait, refuse naming who blocks.
"""

from __future__ import annotations

from builders import plan_request
from daemontwins import GpuHost, Process

from gpuguard.core.gate.run import GateSettings, run_gate
from gpuguard.core.values import MIB

UNIT = "sglang.service"
REQUEST = plan_request(gpu_set=frozenset({0, 1}), protected_names=("nvidia-persistenced",))
"""Before the start: everything in the cgroup is left over."""


class Clock:
    """A monotonic clock that the loop's sleeps advance."""

    def __init__(self) -> None:
        """Start at zero."""
        self.now = 0.0

    def __call__(self) -> float:
        """The time now."""
        return self.now

    def sleep(self, seconds: float) -> None:
        """Advance the clock."""
        self.now += seconds


def test_left_over_workers_are_reaped_and_the_start_passes() -> None:
    """Two workers of an earlier run in the unit's cgroup hold GPUs 0 and 1: reaped, then pass."""
    host = GpuHost()
    for pid in (501, 502):
        host.add(Process(pid, (0, 1), 30000, f"/system.slice/{UNIT}", "0" * 32))
    clock = Clock()
    outcome = run_gate(
        GateSettings(REQUEST, 16 * MIB, 300.0), host.gather, host.reap, clock, clock.sleep
    )
    assert outcome.passed
    assert not outcome.fast_path
    assert sorted(t.identity.pid for t in host.reaped) == [501, 502]
    assert {r.target.identity.pid for r in outcome.reaped} == {501, 502}


def test_a_tenants_job_blocks_until_the_timeout_and_is_named() -> None:
    """A job of another user on GPU 1 is spared; at the timeout the refusal names it."""
    host = GpuHost()
    host.add(Process(900, (1,), 2000, "/user.slice/user-1000.slice/session-3.scope"))
    clock = Clock()
    lines: list[str] = []
    outcome = run_gate(
        GateSettings(REQUEST, 16 * MIB, 30.0, poll_s=1.0, report_every_s=10.0),
        host.gather,
        host.reap,
        clock,
        clock.sleep,
        report=lines.append,
    )
    assert not outcome.passed
    assert host.reaped == []
    assert 900 in host.processes
    assert clock.now >= 30.0
    assert any("PID 900" in blocker for blocker in outcome.blockers)
    assert lines  # it said who blocks while it waited
    assert all("PID 900" in line for line in lines)


def test_a_job_outside_the_set_does_not_delay_the_start() -> None:
    """The same job on GPU 3, outside the unit's set: the fast path, nothing reaped."""
    host = GpuHost()
    host.add(Process(900, (3,), 2000, "/user.slice/user-1000.slice/session-3.scope"))
    clock = Clock()
    outcome = run_gate(
        GateSettings(REQUEST, 16 * MIB, 300.0), host.gather, host.reap, clock, clock.sleep
    )
    assert outcome.passed
    assert outcome.fast_path
    assert host.reaped == []
