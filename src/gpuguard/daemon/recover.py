"""The daemon's recovery procedure: stop the unit, free its GPUs the gate's way, start it again.

Written against the steps the daemon hands in (``Steps``, each already feeding systemd's
watchdog), so the procedure reads top to bottom without the loop around it. It returns a typed
``Recovery``; the daemon keeps it as one JSON record among the unit's recoveries.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuguard.core.gate.run import run_gate
from gpuguard.core.values import ReapOutcome
from gpuguard.core.xid.stuck import named_by, stuck_phrase

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.core.gate.run import GateOutcome, GateSettings
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ReapResult, ReapTarget
    from gpuguard.core.xid.stuck import XidClaim

STOP_WAIT_S = 300.0
"""How long a stopping unit may take before the recovery gives up on it."""
_POLL_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Steps:
    """What a recovery does to the world, each step bounded and feeding the watchdog."""

    control: Callable[[str, str], str | None]
    show_unit: Callable[[str], UnitState]
    gather: Callable[[], Inventory]
    gate_settings: Callable[[str, Inventory, UnitState], GateSettings]
    reap: Callable[[str, Sequence[ReapTarget]], tuple[ReapResult, ...]]
    """The daemon's reap port: the targets chosen for the unit named first."""
    containers: Callable[[PlanRequest], Callable[[Inventory], bool] | None]
    """The stopper of the unit's left-over containers for the gate's loop, if any."""
    monotonic: Callable[[], float]
    sleep: Callable[[float], None]


@dataclass(frozen=True, slots=True)
class Recovery:
    """How one recovery ended: the problem that stopped it (None: restarted) and the gate's run."""

    problem: str | None
    outcome: GateOutcome | None
    """The gate's outcome; None when the unit never stopped."""
    restarted_at: float
    """Monotonic time just before the start: the detector forgets the loop as of then."""

    @property
    def result(self) -> str:
        """``restarted`` or ``failed``, as the record and the log say it."""
        return "restarted" if self.problem is None else "failed"

    def record(self, xid_claims: Sequence[XidClaim]) -> dict[str, Any]:
        """The fields this recovery adds to the unit's JSON record (schema unchanged).

        ``xid_claims``: the application Xids seen, to tell a reaped process stuck in the driver.
        """
        outcome = self.outcome
        return {
            "result": self.result,
            "problem": self.problem,
            "reaped": [_reaped_record(r, xid_claims) for r in (outcome.reaped if outcome else ())],
            "waited_s": round(outcome.waited_s, 2) if outcome else None,
        }


def _reaped_record(result: ReapResult, xid_claims: Sequence[XidClaim]) -> dict[str, Any]:
    """One reaped process for the recovery's record.

    One that SIGKILL left alive after an application Xid naming it is stuck in the driver.
    """
    record: dict[str, Any] = {
        "pid": result.target.identity.pid,
        "outcome": result.outcome.value,
        "signals": list(result.signals),
    }
    if result.outcome is ReapOutcome.UNKILLABLE:
        identity = result.target.identity
        claim = named_by(identity.pid, identity.start_time / _TICKS, xid_claims)
        if claim is not None:
            record |= {"stuck_after_xid": claim.code, "detail": stuck_phrase(claim)}
    return record


def carry_out(unit: str, steps: Steps) -> Recovery:
    """Stop ``unit``, reap its stale holders and wait for idle GPUs, reset-failed, start.

    Once the unit stopped it is always started again, freed or not: the daemon never leaves
    stopped a unit it stopped itself.
    """
    problem = steps.control("stop", unit)
    stopped = problem is None and _wait_stopped(unit, steps)
    outcome: GateOutcome | None = None
    if stopped:
        inventory = steps.gather()
        settings = steps.gate_settings(unit, inventory, steps.show_unit(unit))
        pending = [inventory]

        def gather() -> Inventory:
            return pending.pop() if pending else steps.gather()

        outcome = run_gate(
            settings,
            gather,
            lambda targets: steps.reap(unit, targets),
            steps.monotonic,
            steps.sleep,
            containers=steps.containers(settings.request),
        )
        problem = None if outcome.passed else "; ".join(outcome.blockers)
    elif problem is None:
        problem = f"{unit} did not stop within {STOP_WAIT_S:.0f} s"
    # Forget the loop as of now, before the start: the new run's first entries can carry a
    # timestamp a few ms before `systemctl start` returns, and must not be dropped.
    restarted_at = steps.monotonic()
    if not stopped:
        return Recovery(problem, outcome, restarted_at)
    # Never worse: a unit this recovery stopped is started again even when its GPUs did not
    # free up, so it is back where systemd had it (restarting) rather than left stopped.
    reset = None
    if steps.show_unit(unit).active_state == "failed":
        # Only a failed unit has anything to reset; a unit systemd unloaded after the stop
        # (not enabled) answers "not loaded", which is no failure of the recovery.
        reset = steps.control("reset-failed", unit)
    start = steps.control("start", unit)
    if problem is not None and start is None:
        problem += f"; {unit} was started again, as systemd had it"
    return Recovery(problem or reset or start, outcome, restarted_at)


def _wait_stopped(unit: str, steps: Steps) -> bool:
    """Whether systemd says the unit is no longer running within STOP_WAIT_S."""
    deadline = steps.monotonic() + STOP_WAIT_S
    while steps.monotonic() < deadline:
        state = steps.show_unit(unit)
        if state.error is None and not state.running:
            return True
        steps.sleep(_POLL_S)
    return False
