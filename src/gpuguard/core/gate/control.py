"""Whether a connection to the gate server comes from its unit's control process (pure).

Only the process systemd runs for a watched unit's ``ExecStartPre=``/``ExecStopPost=`` (its
``ControlPID=``, core/unitstate: ``UnitState.is_control_process``) speaks for the unit at the
gate server; any other process of its cgroup - a worker, another user's job in a shared
service, a left-over of an earlier run - gets no gate or reap. The server's parent asks systemd
without waiting for it, so an answer is read some time after it was asked for: it decides a
process only if that process already existed when systemd was asked. A process that existed
then and was not named is never the control process later (systemd forks a fresh one for each
``ExecStartPre=``/``ExecStopPost=``); one named is it while it lives. A process that started
since waits for the next answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.core.unitstate import UnitState


@dataclass(frozen=True, slots=True)
class ControlAnswer:
    """What systemd said of a unit, and when it was asked."""

    asked_ticks: int
    """The boot clock, in ``/proc/PID/stat`` start-time ticks, just before systemd was asked."""
    state: UnitState


def is_control(answer: ControlAnswer, pid: int, started_ticks: int) -> bool | None:
    """Whether process ``pid`` (started at ``started_ticks``) is the unit's control process.

    None when the answer cannot tell: the process started in or after the tick systemd was
    asked in (ticks are rounded down, so only an earlier tick proves it existed then). systemd
    not answering decides "no": only its word makes a control process.
    """
    if started_ticks >= answer.asked_ticks:
        return None
    return answer.state.is_control_process(pid, trust_unknown=False)
