"""Recovery planner: only GPU-caused loops, spaced by a growing backoff, then needs operator."""

from __future__ import annotations

from gpuguard.detector import Cause, Diagnosis
from gpuguard.recovery import Action, RecoveryLimits, RecoveryPlanner

LIMITS = RecoveryLimits(max_attempts=2, backoff_s=100.0, stable_s=300.0)


def diagnosis(*, looping: bool = True, cause: Cause = Cause.STALE_GPU_HOLDERS) -> Diagnosis:
    """A verdict as the detector gives it."""
    return Diagnosis(
        unit="sglang.service",
        looping=looping,
        reason="3 failed starts in 10 min" if looping else "running",
        starts_in_window=3,
        n_restarts=3,
        failures_in_window=3,
        evidence=(),
        cause=cause,
        cause_detail="PID 10 holds GPU 0",
        first_failure_s=0.0,
        immediate=False,
    )


def test_gpu_caused_loop_is_recovered() -> None:
    """A loop with stale GPU holders and no recovery yet: recover."""
    assert RecoveryPlanner(LIMITS).decide(diagnosis(), 1000).action is Action.RECOVER


def test_loop_without_gpu_cause_is_only_reported() -> None:
    """A loop that is not GPU-related is reported, never acted on."""
    decision = RecoveryPlanner(LIMITS).decide(diagnosis(cause=Cause.NOT_GPU_RELATED), 1000)
    assert decision.action is Action.REPORT
    assert "does not act" in decision.reason


def test_backoff_grows_then_needs_operator() -> None:
    """Recoveries wait out a doubling backoff; after max_attempts unhelped ones, stop."""
    planner = RecoveryPlanner(LIMITS)
    planner.recovered(1000)
    waiting = planner.decide(diagnosis(), 1050)
    assert waiting.action is Action.WAIT
    assert waiting.not_before_s == 1100
    assert planner.decide(diagnosis(), 1100).action is Action.RECOVER
    planner.recovered(1100)
    assert planner.decide(diagnosis(), 1250).action is Action.NEEDS_OPERATOR
    assert planner.needs_operator


def test_a_stable_run_heals() -> None:
    """A unit that ran stably long enough after a recovery starts afresh."""
    planner = RecoveryPlanner(LIMITS)
    planner.recovered(1000)
    planner.recovered(1200)
    planner.healthy(1300)
    assert planner.attempts_without_help == 2
    planner.healthy(1600)
    assert planner.attempts_without_help == 0
    assert planner.decide(diagnosis(), 1600).action is Action.RECOVER


def test_state_survives_a_restart() -> None:
    """What export() saves, restore() takes back; garbage is ignored."""
    planner = RecoveryPlanner(LIMITS)
    planner.recovered(1000)
    planner.recovered(1500)
    planner.decide(diagnosis(), 5000)
    again = RecoveryPlanner(LIMITS)
    again.restore(planner.export())
    assert again.needs_operator
    assert again.attempts_without_help == 2
    fresh = RecoveryPlanner(LIMITS)
    fresh.restore({"attempts_without_help": "x", "last_recovery_s": None, "needs_operator": 1})
    assert fresh.attempts_without_help == 0
    assert not fresh.needs_operator


def test_not_looping_is_no_action() -> None:
    """A healthy unit needs nothing."""
    assert RecoveryPlanner(LIMITS).decide(diagnosis(looping=False), 1).action is Action.NONE
