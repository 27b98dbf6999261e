"""When a run is over and whose survivors a sweep may take, on journals recorded from systemd."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.core.events import EventKind, UnitEvent, parse_entry
from gpuguard.core.runend import (
    RunEnd,
    RunEnds,
    Sweep,
    describe,
    live_invocation,
    next_start,
    over_problem,
)

SAMPLES = Path(__file__).resolve().parents[1] / "journal_samples"
UNIT = "sglang.service"
RELEASES = ("bookworm", "trixie")


def sample_events(release: str, name: str) -> list[UnitEvent]:
    """The trusted events the parser finds in a recorded sample."""
    lines = (SAMPLES / release / f"{name}.jsonl").read_text().splitlines()
    parsed = (parse_entry(json.loads(line), UNIT) for line in lines)
    return [event for event in parsed if event is not None]


def ends_of(events: list[UnitEvent]) -> list[tuple[RunEnd, UnitEvent]]:
    """Each run end a fresh tracker reports, with the event that ended it."""
    tracker = RunEnds(UNIT)
    found = []
    for event in events:
        end = tracker.observe(event)
        if end is not None:
            found.append((end, event))
    return found


@pytest.mark.parametrize("release", RELEASES)
def test_a_crash_loop_ends_each_run_once_at_its_main_process_exit(release: str) -> None:
    """Every run of the loop is over when its main process exits, before the restart is due."""
    events = sample_events(release, "restart-loop-start-limit")
    found = ends_of(events)
    runs = {e.invocation_id for e in events if e.kind is EventKind.STARTED}
    assert {end.invocation_id for end, _ in found} == runs
    assert len(found) == len(runs)  # "Failed with result", "Scheduled restart" add nothing
    for end, event in found:
        assert event.kind is EventKind.MAIN_EXITED
        assert not end.stopped_on_purpose
        assert "Main process exited" in end.how
        assert end.ended_s == event.monotonic_s


@pytest.mark.parametrize("release", RELEASES)
def test_an_operators_stop_ends_the_run_at_stopped_on_purpose(release: str) -> None:
    """A stop job's run is over at "Stopped" (JOB_TYPE=stop), after its SIGKILLs and timeouts."""
    for name in ("stop-sigkill-survivor", "stop-sigterm-timeout", "clean-start-stop"):
        found = ends_of(sample_events(release, name))
        assert len(found) == 1, name
        end, event = found[0]
        assert event.kind is EventKind.STOPPED
        assert event.job_type == "stop"
        assert end.invocation_id == event.invocation_id
        assert end.stopped_on_purpose


@pytest.mark.parametrize("release", RELEASES)
def test_an_operators_restart_is_no_stop_on_purpose(release: str) -> None:
    """`systemctl restart` logs "Stopping" as a stop job; its "Stopped" says restart."""
    events = sample_events(release, "left-over-process")
    stopping = next(e for e in events if e.kind is EventKind.STOPPING)
    assert stopping.job_type == "stop"
    first, event = ends_of(events)[0]
    assert event.kind is EventKind.STOPPED
    assert event.job_type == "restart"
    assert not first.stopped_on_purpose


@pytest.mark.parametrize("release", RELEASES)
def test_the_left_over_run_ends_and_the_next_start_is_found(release: str) -> None:
    """The run that left its worker behind ends at its restart; the next run's start follows."""
    events = sample_events(release, "left-over-process")
    found = ends_of(events)
    first, event = found[0]
    assert len(found) == 2  # the restarted run, then the one stopped at the end
    assert found[1][0].stopped_on_purpose
    later = events[events.index(event) + 1 :]
    starts = [s for s in (next_start(e, first) for e in later) if s is not None]
    assert starts
    assert starts[0] > first.ended_s
    # The left-over warning names the new run but is no start; the ended run's own start
    # is no start after its end.
    left_over = next(e for e in later if e.kind is EventKind.LEFT_OVER_PROCESS)
    assert left_over.invocation_id != first.invocation_id
    assert next_start(left_over, first) is None
    own = next(e for e in events if e.kind is EventKind.STARTED)
    assert next_start(replace(own, monotonic_s=first.ended_s + 1), first) is None
    # A start logged before the end (a burst replays out of order) is no next start.
    early = replace(first, ended_s=starts[0] + 1)
    assert all(next_start(e, early) is None for e in later if e.monotonic_s <= starts[0])


def test_duplicates_and_history_end_nothing_twice() -> None:
    """A journal resume delivers entries again: the run already ended is not swept again."""
    events = sample_events("trixie", "restart-loop-start-limit")
    tracker = RunEnds(UNIT)
    first = [tracker.observe(e) for e in events]
    again = [tracker.observe(e) for e in events]
    assert any(first)
    assert not any(again)


def test_another_units_events_and_runs_without_id_end_nothing() -> None:
    """An end names one unit's run; without an invocation id there is no run to sweep."""
    event = next(
        e for e in sample_events("trixie", "restart-loop-start-limit") if e.kind is EventKind.FAILED
    )
    assert RunEnds("other.service").observe(event) is None
    assert RunEnds(UNIT).observe(replace(event, invocation_id=None)) is None


def test_memory_is_bounded() -> None:
    """A unit that restarts forever costs a bounded number of remembered runs."""
    tracker = RunEnds(UNIT)
    event = next(
        e
        for e in sample_events("trixie", "restart-loop-start-limit")
        if e.kind is EventKind.MAIN_EXITED
    )
    for number in range(1000):
        tracker.observe(replace(event, invocation_id=f"{number:032x}"))
    assert len(tracker._seen) <= 64


END = RunEnd(UNIT, "577f5c37" + "0" * 24, 100.0, "Main process exited", stopped_on_purpose=False)


def test_a_run_that_stays_active_after_its_main_exit_is_not_over() -> None:
    """RemainAfterExit=: the run is still up, its processes are live."""
    kwargs = {"invocation": END.invocation_id}
    assert over_problem(END, active_state="active", sub_state="exited", **kwargs)
    assert over_problem(END, active_state="activating", sub_state="auto-restart", **kwargs) is None
    assert (
        over_problem(END, active_state="deactivating", sub_state="stop-sigterm", **kwargs) is None
    )
    assert over_problem(END, active_state="active", sub_state="exited", invocation="b" * 32) is None


def test_only_the_next_run_is_live() -> None:
    """The ended run is never live, even while systemd still names it (deactivating)."""
    assert live_invocation(END, running=True, invocation=END.invocation_id) is None
    assert live_invocation(END, running=True, invocation="b" * 32) == "b" * 32
    assert live_invocation(END, running=False, invocation="b" * 32) is None


def test_the_summary_says_whom_how_fast_and_the_gpus_against_the_restart() -> None:
    """The line operators read in the journal and in status."""
    sweep = Sweep(END, reaped=3, planned=3, reaped_after_s=1.2, idle_after_s=2.0)
    assert describe(sweep) == (
        "reaped 3 survivors of run 577f5c37 within 1.2 s of its end; GPUs idle at +2.0 s"
    )
    assert describe(replace(sweep, next_start_after_s=3.04)) == (
        "reaped 3 survivors of run 577f5c37 within 1.2 s of its end; "
        "GPUs idle before the restart at +3.0 s (idle at +2.0 s)"
    )
    late = replace(sweep, idle_after_s=None, next_start_after_s=0.5, reaped=1)
    assert describe(late) == (
        "reaped 1 survivor of run 577f5c37 within 1.2 s of its end; "
        "GPUs not idle at the restart at +0.5 s"
    )
    dry = Sweep(END, reaped=0, planned=2, reaped_after_s=None, idle_after_s=None, dry_run=True)
    assert describe(dry).startswith("dry run: would reap 2 survivors of run 577f5c37")
    reported = replace(dry, dry_run=False, reported_only=True)
    assert "reported, not reaped (daemon.reap_stopped_survivors is off)" in describe(reported)


def test_the_summary_names_the_units_left_over_containers() -> None:
    """A stopped container is said by name; survivors only when there were some."""
    container = ("sglang (docker 1a2b3c4d5e6f)",)
    alone = Sweep(END, 0, 0, 0.8, 1.5, containers=container)
    assert describe(alone) == (
        "stopped container sglang (docker 1a2b3c4d5e6f) of run 577f5c37 within 0.8 s of its end; "
        "GPUs idle at +1.5 s"
    )
    both = replace(alone, reaped=2, planned=2, containers=(*container, "b (podman 0f0f0f0f0f0f)"))
    assert describe(both).startswith(
        "reaped 2 survivors and stopped containers sglang (docker 1a2b3c4d5e6f), "
        "b (podman 0f0f0f0f0f0f) of run 577f5c37"
    )
    dry = replace(alone, reaped_after_s=None, idle_after_s=None, dry_run=True)
    assert describe(dry).startswith(
        "dry run: would stop container sglang (docker 1a2b3c4d5e6f) of run 577f5c37"
    )
    reported = replace(dry, dry_run=False, reported_only=True, planned=1)
    assert describe(reported).startswith(
        "1 survivor and container sglang (docker 1a2b3c4d5e6f) of run 577f5c37, stopped on "
        "purpose, hold GPU memory: reported, not reaped"
    )
