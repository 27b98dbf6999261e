"""When is a unit's run over, and whose survivors may be reaped right then (pure: no I/O).

Without the gate, the daemon would wait for the next start to fail before it acts. But PID 1
says when a run ends ("Main process exited", "State 'stop-sigterm' timed out", "Failed with
result", "Deactivated successfully", "Scheduled restart job"), and every process of that run
carries its ``INVOCATION_ID``: its survivors are known exactly, before the next start (which
``RestartSec=`` delays) meets their GPU memory. ``RunEnds`` turns trusted events into one
``RunEnd`` per ended invocation (a run a stop job ends, at its "Stopped", which tells a stop
from a restart); ``over_problem`` checks systemd's current view before anything
is touched; ``describe`` says what a sweep did, for the journal and ``status``.

Only PID 1's events count (``events.parse_entry`` trusts nothing else), and only live ones: the
daemon never acts on history. A run ended by a stop job (an operator's ``systemctl stop``) is
marked ``stopped_on_purpose``: its survivors are reported, and reaped only when configured.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from gpuguard.core.events import EventKind, UnitEvent

_ENDS: Final = frozenset(
    {
        EventKind.MAIN_EXITED,
        EventKind.STOP_TIMED_OUT,
        EventKind.SURVIVED_SIGKILL,
        EventKind.FAILED,
        EventKind.DEACTIVATED,
        EventKind.RESTART_SCHEDULED,
    }
)
"""PID 1's words for "this invocation's main process is gone / the run is over"."""
_STARTS: Final = frozenset({EventKind.STARTING, EventKind.STARTED})
_REMEMBERED: Final = 64
"""Invocations remembered per unit: a few per run, so a journal resume's duplicates still find
their run, while a unit that restarts forever costs bounded memory."""


@dataclass(frozen=True, slots=True)
class RunEnd:
    """One run of a unit is over: its survivors may be swept."""

    unit: str
    invocation_id: str
    ended_s: float
    """The journal's monotonic stamp of the first event that ended it."""
    how: str
    """PID 1's message, for people."""
    stopped_on_purpose: bool
    """A stop job (``JOB_TYPE=stop``) that was no restart ended it: an operator, a conflict or
    gpuguard wanted the unit down."""


@dataclass(slots=True)
class _Seen:
    stop_job: bool = False
    ended: bool = False


class RunEnds:
    """Which runs of one unit are over, one ``RunEnd`` per invocation, in the order they ended."""

    def __init__(self, unit: str) -> None:
        """Track ``unit``'s invocations."""
        self._unit = unit
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    def observe(self, event: UnitEvent) -> RunEnd | None:
        """The run ``event`` ends, the first time one of its ending events is seen; else None.

        A run whose "Stopping" says ``JOB_TYPE=stop`` ends at its "Stopped", whose job type
        tells an operator's stop (``stop``) from ``systemctl restart``, which logs its stop phase
        as a stop job too and only its "Stopped" as ``restart``. An event without an invocation
        id names no run and ends nothing.
        """
        invocation = event.invocation_id
        if event.unit != self._unit or invocation is None:
            return None
        seen = self._seen.get(invocation)
        if seen is None:
            seen = self._seen[invocation] = _Seen()
            while len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)
        if seen.ended:
            return None
        if event.kind is EventKind.STOPPING and event.job_type == "stop":
            seen.stop_job = True
        if seen.stop_job:
            if event.kind is not EventKind.STOPPED:
                return None
            # Anything but a restart's "Stopped" counts as a stop: its survivors are reported.
            on_purpose = event.job_type != "restart"
        elif event.kind in _ENDS:
            on_purpose = False
        else:
            return None
        seen.ended = True
        return RunEnd(self._unit, invocation, event.monotonic_s, event.message, on_purpose)


def next_start(event: UnitEvent, end: RunEnd) -> float | None:
    """When ``event`` is the start of a run after ``end``: its monotonic stamp, else None."""
    later = event.monotonic_s >= end.ended_s
    if later and event.kind in _STARTS and event.invocation_id not in (None, end.invocation_id):
        return event.monotonic_s
    return None


def over_problem(
    end: RunEnd, *, active_state: str | None, sub_state: str | None, invocation: str | None
) -> str | None:
    """Why systemd's current view says the run is not over after all; None when it is.

    A main process that exits while the unit stays ``active (exited)`` (``RemainAfterExit=``)
    leaves a run that is still up: its processes are live.
    """
    if invocation == end.invocation_id and active_state == "active" and sub_state == "exited":
        return f"{end.unit} stays active after its main process exited (RemainAfterExit=)"
    return None


def live_invocation(end: RunEnd, *, running: bool, invocation: str | None) -> str | None:
    """The run that is starting or running now, never the ended one: its processes are kept."""
    if running and invocation != end.invocation_id:
        return invocation
    return None


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one sweep of an ended run's survivors did; times are seconds after the run's end."""

    end: RunEnd
    reaped: int
    planned: int
    reaped_after_s: float | None
    idle_after_s: float | None
    next_start_after_s: float | None = None
    dry_run: bool = False
    reported_only: bool = False
    containers: tuple[str, ...] = ()
    """The unit's left-over containers stopped (planned, for a dry run or a report), each as
    ``NAME (docker <id12>)``."""
    dying: int = 0
    """Survivors SIGKILLed but still alive when the sweep ended (an uninterruptible wait): not
    reaped, not counted in ``reaped``; they go when their wait ends."""


def describe(sweep: Sweep) -> str:
    """One line for the journal and ``status``: whom, how fast, and the GPUs against the restart.

    "reaped 3 survivors of run 577f5c37 within 1.2 s of its end; GPUs idle before the restart
    at +2.0 s".
    """
    run = f"run {sweep.end.invocation_id[:8]}"
    if sweep.dry_run:
        head = f"dry run: would {_whom(sweep, sweep.planned, ('reap ', 'stop '))} of {run}"
    elif sweep.reported_only:
        head = (
            f"{_whom(sweep, sweep.planned, ('', ''))} of {run}, stopped on purpose, hold GPU "
            "memory: reported, not reaped (daemon.reap_stopped_survivors is off)"
        )
    else:
        after = sweep.reaped_after_s
        within = "" if after is None else f" within {after:.1f} s of its end"
        head = f"{_whom(sweep, sweep.reaped, ('reaped ', 'stopped '))} of {run}{within}"
        if sweep.dying:
            # Reaped only once gone: a survivor SIGKILL has not ended yet is dying, said so.
            head += (
                f"; {_survivors(sweep.dying)} SIGKILLed but still alive (dying: in an "
                "uninterruptible wait, gone when it ends)"
            )
    return f"{head}; {_gpus(sweep)}"


def _whom(sweep: Sweep, count: int, verbs: tuple[str, str]) -> str:
    """Who, with the verbs: "reaped 2 survivors and stopped container sglang (docker 1a2b…)".

    Survivors are left unsaid when there are none but a container.
    """
    said = [] if sweep.containers and not count else [f"{verbs[0]}{_survivors(count)}"]
    if sweep.containers:
        plural = "s" if len(sweep.containers) > 1 else ""
        said.append(f"{verbs[1]}container{plural} {', '.join(sweep.containers)}")
    return " and ".join(said)


def _survivors(count: int) -> str:
    return f"{count} survivor" + ("" if count == 1 else "s")


def _gpus(sweep: Sweep) -> str:
    idle, start = sweep.idle_after_s, sweep.next_start_after_s
    if idle is None:
        gpus = "GPUs not idle"
        return gpus if start is None else f"{gpus} at the restart at +{start:.1f} s"
    if start is None:
        return f"GPUs idle at +{idle:.1f} s"
    when = "before" if idle <= start else "after"
    return f"GPUs idle {when} the restart at +{start:.1f} s (idle at +{idle:.1f} s)"
