"""Which connection is its unit's control process: systemd's answer, and only for its past."""

from __future__ import annotations

from gpuguard.core.gate.control import ControlAnswer, is_control
from gpuguard.core.unitstate import UnitState

RUNNING_PRE = UnitState("sglang.service", sub_state="start-pre", control_pid=4242)


def test_the_named_process_that_existed_when_asked_is_the_control_process() -> None:
    """ControlPID=4242 asked at tick 100: PID 4242 started at tick 99 is it, PID 4243 is not."""
    answer = ControlAnswer(100, RUNNING_PRE)
    assert is_control(answer, 4242, 99) is True
    assert is_control(answer, 4243, 99) is False


def test_a_process_started_in_or_after_the_asking_tick_waits_for_the_next_answer() -> None:
    """The answer cannot speak for a process it may not have seen: None, not no."""
    answer = ControlAnswer(100, RUNNING_PRE)
    assert is_control(answer, 4242, 100) is None
    assert is_control(answer, 4243, 150) is None


def test_no_answer_and_no_control_state_make_no_control_process() -> None:
    """No answer from systemd, or a unit not in start-pre/stop-post: no control process."""
    unknown = UnitState("sglang.service", error="systemctl show failed")
    running = UnitState("sglang.service", sub_state="running", control_pid=4242)
    for state in (unknown, running):
        assert is_control(ControlAnswer(100, state), 4242, 1) is False
