"""What a unit's liveness is at one moment, and whether the daemon acts on it (pure).

``core.liveness`` follows a unit's runs and draws a ``LivenessView``: the state ``status``
shows, the dead engine and its cause, the phase a start is in against its budget. This module
holds those values and the two rules the daemon's recovery asks before it acts: did the unit
opt in (``acted_on``), and does what systemd says now leave it alone after all (``left_alone``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from gpuguard.core.enginelines import Phase
    from gpuguard.core.startbudgets import StartRecord
    from gpuguard.core.unitstate import UnitState


class State(StrEnum):
    """What ``status`` says about a unit's engine."""

    UNKNOWN = "unknown"
    """No run seen yet (nothing in the replayed journal), or the last one ended."""
    STARTING = "starting"
    UP = "up"
    STUCK = "stuck"
    """Starting, in one phase for longer than that phase's learned budget."""
    ENGINE_DEAD = "engine-dead"


@dataclass(frozen=True, slots=True)
class DeadEngine:
    """Why and since when a run's engine is dead."""

    invocation_id: str
    since_s: float
    since_wall_s: float | None
    cause: str
    """"EngineCore fatal error", or the unasked clean exit."""
    line: str
    """The line that said so (escaped by the parser), PID 1's message, or the health check's
    verdict (our own words)."""
    unit_inactive: bool = False
    """The main process exited (status 0, no stop job): systemd has nothing left to restart."""
    by_health: bool = False
    """Said by the unit's health check (core.healthcheck), not by a line of the run."""
    by_silence: bool = False
    """Said by the health check for silence alone: no 2xx for long, never a refusal or a 5xx
    (core.healthcheck.HealthDeath.silent)."""


def acted_on(view: LivenessView, *, on_engine_dead: str, on_start_stuck: str) -> bool:
    """Whether the unit opted in to the daemon's recovery of what ``view`` shows."""
    if view.dead is not None:
        return on_engine_dead == "recover"
    return view.state is State.STUCK and on_start_stuck == "recover"


def left_alone(
    view: LivenessView, unit: str, now: UnitState, *, silence_recovered: bool = False
) -> str | None:
    """Why the daemon leaves an opted-in unit alone after all (systemd's ``now``); None: recover it.

    Never worse than doing nothing: a stuck start that is no longer the unit's run, a unit
    someone stopped, a unit systemd restarts by itself (an exit 0 under Restart=always), and a
    health check silent again after the daemon's last recovery was for that silence
    (``silence_recovered``): a restart for silence is never repeated without a new cause (a
    refusal or a 5xx, a fatal line, an exit), so load alone cannot keep restarting a unit.
    """
    if view.dead is None and now.invocation_id != view.invocation_id:
        return f"the stuck start is no longer {unit}'s run"
    if view.dead is not None and view.dead.by_health:
        why = _health_left_alone(view.dead, view.invocation_id, unit, now, silence_recovered)
        if why is not None:
            return why
    if now.active_state == "inactive" and not (view.dead and view.dead.unit_inactive):
        return f"{unit} was stopped: gpuguard does not start it"
    if now.sub_state == "auto-restart":
        return f"systemd restarts {unit} itself (auto-restart)"
    return None


def _health_left_alone(
    dead: DeadEngine, run: str | None, unit: str, now: UnitState, silence_recovered: bool
) -> str | None:
    """Why a run its health check made dead is left alone; None: nothing of the check's own."""
    if dead.by_silence and silence_recovered:
        return (
            f"{unit}'s health check is silent again after gpuguard restarted it for that: a "
            "busy engine answers late; not restarted again without a new cause (a refused "
            "connection, an HTTP 5xx, a fatal line)"
        )
    # A server that stops (an operator's stop whose line the daemon has not read yet) fails
    # its health check too: only a run systemd still calls active and its own is dead.
    if now.invocation_id != run:
        return f"the run whose health check failed is no longer {unit}'s run"
    if now.active_state != "active":
        return f"{unit} is {now.active_state or 'unknown'}: its health check failed as it ends"
    return None


@dataclass(frozen=True, slots=True)
class LivenessView:
    """One unit's liveness at one moment, with the line ``status`` prints."""

    state: State
    summary: str
    level: str | None
    """"critical" (engine dead), "warning" (stuck) or None: how ``status`` rates it."""
    invocation_id: str | None = None
    dead: DeadEngine | None = None
    phase: Phase | None = None
    phase_for_s: float | None = None
    budget_s: float | None = None
    last_start: StartRecord | None = None
    deaths: int = 0
    """Dead engines seen live by this daemon process (a counter for the metrics)."""
    stuck_starts: int = 0
    """Starts seen stuck by this daemon process."""

    def to_json(self) -> dict[str, Any]:
        """The unit's ``liveness`` object in the daemon's snapshot (docs/liveness.md)."""
        dead = self.dead
        return {
            "state": self.state.value,
            "summary": self.summary,
            "level": self.level,
            "invocation_id": self.invocation_id,
            "dead_since_s": None if dead is None else dead.since_s,
            "dead_cause": None if dead is None else dead.cause,
            "dead_line": None if dead is None else dead.line,
            "phase": None if self.phase is None else self.phase.value,
            "phase_for_s": _round(self.phase_for_s),
            "budget_s": _round(self.budget_s),
            "last_start": None if self.last_start is None else self.last_start.to_json(),
            "engine_deaths": self.deaths,
            "stuck_starts": self.stuck_starts,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
