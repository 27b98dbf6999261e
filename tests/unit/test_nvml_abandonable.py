"""NVML snapshots run in a forked child that a deadline can abandon."""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpuguard.adapters import nvmlworker
from gpuguard.core.values import NvmlHealth, NvmlReading


def _timed_out(timeout_s: float) -> NvmlReading:
    return NvmlReading(NvmlHealth.TIMED_OUT, f"after {timeout_s}")


def test_result_comes_back_from_the_child() -> None:
    """A reading produced in the child is returned to the caller unchanged."""
    expected = NvmlReading(NvmlHealth.OK, None, "1.2", ())
    got = nvmlworker.run_abandonable(lambda: expected, 5, _timed_out)
    assert got == expected


def test_a_blocked_call_is_abandoned_at_the_deadline() -> None:
    """Work that never returns yields the timeout reading soon after the deadline."""

    def hang() -> NvmlReading:
        time.sleep(3600)
        return NvmlReading(NvmlHealth.OK)

    started = time.monotonic()
    got = nvmlworker.run_abandonable(hang, 0.3, _timed_out)
    assert got == NvmlReading(NvmlHealth.TIMED_OUT, "after 0.3")
    assert time.monotonic() - started < 5


def test_an_exception_in_the_child_becomes_an_error_reading() -> None:
    """Anything the child raises is reported as an ERROR health, never raised in the caller."""

    def explode() -> NvmlReading:
        raise RuntimeError("driver said no")

    got = nvmlworker.run_abandonable(explode, 5, _timed_out)
    assert got.health is NvmlHealth.ERROR
    assert got.reason is not None
    assert "driver said no" in got.reason


def test_a_child_that_dies_silently_is_an_error() -> None:
    """A child killed before answering is reported, not treated as idle GPUs."""

    def die() -> NvmlReading:
        os._exit(9)

    got = nvmlworker.run_abandonable(die, 5, _timed_out)
    assert got.health is NvmlHealth.ERROR


def test_no_child_is_left_behind(tmp_path: Path) -> None:
    """An abandoned child, once dead, is collected by a later call: no zombie of ours remains."""
    pid_file = tmp_path / "child.pid"

    def hang() -> NvmlReading:
        pid_file.write_text(str(os.getpid()))
        time.sleep(3600)
        return NvmlReading(NvmlHealth.OK)

    assert nvmlworker.run_abandonable(hang, 0.5, _timed_out).health is NvmlHealth.TIMED_OUT
    child = Path(f"/proc/{pid_file.read_text()}")
    deadline = time.monotonic() + 5
    while child.exists() and time.monotonic() < deadline:
        nvmlworker.run_abandonable(lambda: NvmlReading(NvmlHealth.OK), 5, _timed_out)
        time.sleep(0.05)
    assert not child.exists(), f"{child} is still there: {_state(child)}"


def _state(process: Path) -> str:
    """The State: line of a process (Z for a zombie nobody waited for)."""
    try:
        status = (process / "status").read_text()
    except OSError:
        return "gone"
    return next((line for line in status.splitlines() if line.startswith("State:")), "?")
