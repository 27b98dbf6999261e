"""Recovery planner: only GPU-caused loops, spaced by a growing backoff, then needs operator."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.detector import Cause, Diagnosis
from gpuguard.core.recovery import (
    Action,
    Interrupted,
    RecoveryLimits,
    RecoveryPlanner,
    resume_problem,
)

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


def test_gpu_needing_a_reset_goes_straight_to_needs_operator_and_is_not_sticky() -> None:
    """No recovery is tried or counted; once the GPU is healthy the next loop is recovered."""
    planner = RecoveryPlanner(LIMITS)
    decision = planner.decide(diagnosis(cause=Cause.GPU_NEEDS_RESET), 1000)
    assert decision.action is Action.NEEDS_OPERATOR
    assert "no kill or restart can help" in decision.reason
    assert planner.attempts_without_help == 0
    assert planner.decide(diagnosis(), 1010).action is Action.RECOVER


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
    """What export() saves, restore() takes back; each malformed value is named and ignored."""
    planner = RecoveryPlanner(LIMITS)
    planner.recovered(1000)
    planner.recovered(1500)
    planner.decide(diagnosis(), 5000)
    again = RecoveryPlanner(LIMITS)
    assert again.restore(planner.export(), same_boot=True) == ()
    assert again.needs_operator
    assert again.attempts_without_help == 2
    fresh = RecoveryPlanner(LIMITS)
    problems = fresh.restore(
        {"attempts_without_help": "x", "last_recovery_monotonic_s": [1], "needs_operator": 1},
        same_boot=True,
    )
    assert len(problems) == 3
    assert fresh.attempts_without_help == 0
    assert not fresh.needs_operator
    assert fresh.decide(diagnosis(), 1).action is Action.RECOVER


def test_a_backoff_from_another_boot_is_over() -> None:
    """Monotonic times of an earlier boot mean nothing now: its backoff does not hold."""
    planner = RecoveryPlanner(LIMITS)
    planner.recovered(1000)
    same, other = RecoveryPlanner(LIMITS), RecoveryPlanner(LIMITS)
    same.restore(planner.export(), same_boot=True)
    other.restore(planner.export(), same_boot=False)
    assert same.decide(diagnosis(), 1050).action is Action.WAIT
    assert other.decide(diagnosis(), 1050).action is Action.RECOVER
    assert other.attempts_without_help == 1


BOOT = "b" * 32


def interrupted(**changes: object) -> Interrupted:
    """A recovery interrupted 30 s ago in this boot, with the unit as the recovery left it."""
    found: dict[str, Any] = {
        "record_boot": BOOT,
        "record_started_s": 1000.0,
        "boot": BOOT,
        "now": 1030.0,
        "active_state": "failed",
    }
    return Interrupted(**(found | changes))


def test_a_fresh_interrupted_recovery_in_this_boot_is_resumed() -> None:
    """Same boot, young, unit stopped (or our stop still pending): finish it."""
    assert resume_problem(interrupted(), dry_run=False, within_s=900) is None
    assert resume_problem(interrupted(active_state="inactive"), dry_run=False, within_s=900) is None
    pending = interrupted(active_state="deactivating")
    assert resume_problem(pending, dry_run=False, within_s=900) is None


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"record_boot": "c" * 32}, "another boot"),
        ({"record_boot": None}, "another boot"),
        ({"boot": None}, "another boot"),
        ({"record_started_s": "yesterday"}, "does not say when"),
        ({"now": 5000.0}, "only a recovery younger"),
        ({"now": 10.0}, "only a recovery younger"),
        ({"active_state": None}, "cannot say"),
        ({"active_state": "active"}, "started it since"),
        ({"active_state": "activating"}, "started it since"),
        ({"active_state": "reloading"}, "started it since"),
    ],
)
def test_an_interrupted_recovery_is_not_resumed_when(changes: dict[str, Any], says: str) -> None:
    """Another boot, an old or undated record, or a unit someone started: left alone.

    On main a record from another boot stopped and started a healthy unit.
    """
    problem = resume_problem(interrupted(**changes), dry_run=False, within_s=900)
    assert problem is not None
    assert says in problem


def test_dry_run_never_resumes() -> None:
    """dry_run is honoured on the resume path too (main resumed with dry_run = true)."""
    problem = resume_problem(interrupted(), dry_run=True, within_s=900)
    assert problem == "dry_run is set"


def test_not_looping_is_no_action() -> None:
    """A healthy unit needs nothing."""
    assert RecoveryPlanner(LIMITS).decide(diagnosis(looping=False), 1).action is Action.NONE


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
saved_planners = st.dictionaries(
    st.sampled_from(["attempts_without_help", "last_recovery_monotonic_s", "needs_operator"])
    | st.text(max_size=8),
    json_values,
)


@given(saved_planners, st.booleans())
def test_restore_takes_any_json_without_raising(saved: dict[str, Any], same_boot: bool) -> None:
    """Whatever a state file holds, restore() keeps only well-typed values and never raises."""
    planner = RecoveryPlanner(LIMITS)
    problems = planner.restore(saved, same_boot=same_boot)
    assert isinstance(planner.attempts_without_help, int)
    assert planner.attempts_without_help >= 0
    assert isinstance(planner.needs_operator, bool)
    assert len(problems) <= len(saved)
    assert planner.decide(diagnosis(), 10**6).action in set(Action)


@given(json_values, json_values, st.sampled_from([None, "inactive", "failed", "active", "x"]))
def test_resume_problem_takes_any_record_without_raising(
    boot: object, started: object, state: str | None
) -> None:
    """Any record fields give a reason or None; a malformed record is never resumed."""
    found = interrupted(record_boot=boot, record_started_s=started, active_state=state)
    problem = resume_problem(found, dry_run=False, within_s=900)
    if boot != BOOT or not isinstance(started, (int, float)) or isinstance(started, bool):
        assert problem is not None
