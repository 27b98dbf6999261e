"""Liveness of a watched unit's engine: dead while the unit lives, stuck starts, phase budgets."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from gpuguard.core.enginelines import (
    ENGINE_LINES,
    ENGINE_REGEX,
    FATAL_LINES,
    Phase,
    is_ready_line,
    match_line,
)
from gpuguard.core.events import EventKind, UnitEvent, parse_entry
from gpuguard.core.healthcheck import HealthBack, HealthDeath
from gpuguard.core.liveness import ENGINE_DEAD_GRACE_S, Liveness
from gpuguard.core.livenessview import State
from gpuguard.core.startbudgets import MIN_STARTS

UNIT = "vllm.service"
_cursors = itertools.count()

# Lines as the servers print them, each from a public report or the server's source.
VLLM_FATAL = (
    "(EngineCore_DP0 pid=413) ERROR 11-10 12:30:57 [core.py:710] EngineCore encountered a fatal "
    "error."
)
VLLM_WORKER = (
    "(EngineCore_DP0 pid=265) ERROR 02-27 10:31:24 [multiproc_executor.py:231] Worker proc "
    "VllmWorker-0 died unexpectedly, shutting down executor."
)
SGLANG_DEAD = "[01-28 04:18:10] Rank 0 scheduler is dead. Please check if there are relevant logs."


def entry(
    message: str,
    *,
    invocation: str = "run1",
    at_s: float = 100.0,
    writer: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """A journal entry a process wrote to stdout (``writer``: ``_PID``, ``_STREAM_ID``).

    By default the run's main process on the stream it opened.
    """
    pid, stream = writer or (4000 + sum(map(ord, invocation)), f"stream-of-{invocation}")
    return {
        "__CURSOR": f"s=1;i={next(_cursors):x}",
        "__MONOTONIC_TIMESTAMP": str(int(at_s * 1e6)),
        "__REALTIME_TIMESTAMP": str(int((1_764_590_000 + at_s) * 1e6)),
        "_SYSTEMD_UNIT": UNIT,
        "_SYSTEMD_INVOCATION_ID": invocation,
        "_TRANSPORT": "stdout",
        "_PID": str(pid),
        "_STREAM_ID": stream,
        "_BOOT_ID": "b",  # the boot of systemd()'s events
        "_UID": "1000",
        "MESSAGE": message,
    }


def output(message: str, *, invocation: str = "run1", at_s: float = 100.0) -> UnitEvent:
    """The event the parser makes of one output line (it must make one)."""
    event = parse_entry(entry(message, invocation=invocation, at_s=at_s), UNIT)
    assert event is not None
    return event


def systemd(
    kind: EventKind, *, invocation: str = "run1", at_s: float = 0.0, **fields: Any
) -> UnitEvent:
    """A lifecycle event as the parser makes it from PID 1's entry."""
    return UnitEvent(
        kind=kind,
        unit=UNIT,
        monotonic_s=at_s,
        realtime_s=1_764_590_000 + at_s,
        cursor=f"s=1;i={next(_cursors):x}",
        invocation_id=invocation,
        boot_id="b",
        **fields,
    )


def started(tracker: Liveness, invocation: str = "run1", at_s: float = 0.0) -> None:
    """A run started, as systemd says it."""
    tracker.observe(systemd(EventKind.STARTING, invocation=invocation, at_s=at_s), live=True)
    tracker.observe(systemd(EventKind.STARTED, invocation=invocation, at_s=at_s), live=True)


@pytest.mark.parametrize("line", [VLLM_FATAL, VLLM_WORKER, SGLANG_DEAD])
def test_a_fatal_line_of_a_running_unit_makes_its_engine_dead(line: str) -> None:
    """A live fatal line whose run outlives the grace: engine dead since the line, unit active."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    assert not tracker.observe(output(line, at_s=3723.0), live=True)
    assert tracker.wake_at == 3723.0 + ENGINE_DEAD_GRACE_S
    assert not tracker.tick(3725.0)
    assert tracker.view(3725.0).state is not State.ENGINE_DEAD  # the server may still exit
    assert tracker.tick(3733.0)
    view = tracker.view(3800.0)
    assert view.state is State.ENGINE_DEAD
    assert view.level == "critical"
    assert re.fullmatch(r"engine dead since \d\d:\d\d:\d\d \(.+\); unit still active", view.summary)
    assert view.deaths == 1


def test_the_summary_names_the_time_and_the_cause() -> None:
    """The status line reads like the issue's: time, cause, and that systemd sees it active."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    tracker.observe(output(VLLM_FATAL, at_s=3600.0), live=True)
    tracker.tick(3611.0)
    summary = tracker.view(3611.0).summary
    # 1_764_590_000 + 3600 s is 2025-12-01 12:53:20 UTC.
    assert summary == "engine dead since 12:53:20 (EngineCore fatal error); unit still active"


def test_replayed_history_rebuilds_a_death_but_never_reports_it_as_news() -> None:
    """History (live=False) says dead in status, and never asks the daemon to act."""
    tracker = Liveness(UNIT, "vllm")
    tracker.observe(systemd(EventKind.STARTED), live=False)
    assert not tracker.observe(output(VLLM_FATAL), live=False)
    assert not tracker.tick(200.0)
    view = tracker.view(200.0)
    assert view.state is State.ENGINE_DEAD
    assert view.deaths == 0


def test_a_line_of_an_older_run_says_nothing_about_the_current_one() -> None:
    """Lines are judged by the run that printed them (_SYSTEMD_INVOCATION_ID)."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker, "old")
    started(tracker, "new", at_s=50.0)
    assert not tracker.observe(output(VLLM_FATAL, invocation="old", at_s=60.0), live=True)
    assert tracker.view(70.0).state is not State.ENGINE_DEAD


def test_a_line_without_the_trusted_unit_field_is_no_event() -> None:
    """Another unit's, or a forged, line never reaches liveness: journald's _SYSTEMD_UNIT rules."""
    forged = entry(VLLM_FATAL) | {"_SYSTEMD_UNIT": "user@1000.service"}
    assert parse_entry(forged, UNIT) is None
    without_run = entry(VLLM_FATAL)
    del without_run["_SYSTEMD_INVOCATION_ID"]
    event = parse_entry(without_run, UNIT)
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    assert event is not None
    assert not tracker.observe(event, live=True)  # no run named: nothing to judge


def test_death_like_lines_after_a_stop_job_began_are_the_shutdown() -> None:
    """Servers print "died unexpectedly" while stopping: after "Stopping", nothing is dead."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    tracker.observe(systemd(EventKind.STOPPING, at_s=10.0, job_type="stop"), live=True)
    assert not tracker.observe(output(VLLM_WORKER, at_s=11.0), live=True)
    assert tracker.view(12.0).state is not State.ENGINE_DEAD


def test_the_runs_end_ends_its_dead_engine_verdict() -> None:
    """A fatal line, then the main process fails within the grace: systemd's to handle, no death."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    tracker.observe(output(SGLANG_DEAD, at_s=5.0), live=True)
    exited = systemd(EventKind.MAIN_EXITED, at_s=6.0, exit_code="exited", exit_status=1)
    tracker.observe(exited, live=True)
    assert not tracker.tick(60.0)
    view = tracker.view(60.0)
    assert view.state is State.UNKNOWN
    assert view.deaths == 0


def test_a_clean_exit_no_stop_job_asked_for_is_a_dead_engine() -> None:
    """An exit 0 no stop job asked for is a dead engine: Restart=on-failure never restarts it."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    assert tracker.observe(systemd(EventKind.DEACTIVATED, at_s=90.0), live=True)
    view = tracker.view(95.0)
    assert view.state is State.ENGINE_DEAD
    assert view.dead is not None
    assert view.dead.unit_inactive
    assert "no stop job asked for it" in view.summary


def test_a_fatal_line_then_a_clean_exit_keeps_the_first_cause_and_time() -> None:
    """A vLLM fatal error followed by exit status 0 is one death, dated at the fatal line."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    assert not tracker.observe(output(VLLM_FATAL, at_s=50.0), live=True)
    assert tracker.observe(systemd(EventKind.DEACTIVATED, at_s=52.0), live=True)
    view = tracker.view(60.0)
    assert view.dead is not None
    assert view.dead.since_s == 50.0
    assert view.dead.cause.startswith("EngineCore fatal error; then the main process exited")
    assert view.deaths == 1


def test_a_clean_exit_a_stop_job_asked_for_is_no_death() -> None:
    """A stop job ("Stopping", then "Deactivated successfully") is an exit as asked."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    tracker.observe(systemd(EventKind.STOPPING, at_s=80.0, job_type="stop"), live=True)
    assert not tracker.observe(systemd(EventKind.DEACTIVATED, at_s=81.0), live=True)
    assert tracker.view(82.0).state is State.UNKNOWN


def test_a_clean_exit_is_only_reported_when_configured() -> None:
    """clean_exit_is_death=False leaves an unasked exit 0 to systemd."""
    tracker = Liveness(UNIT, "vllm", clean_exit_is_death=False)
    started(tracker)
    assert not tracker.observe(systemd(EventKind.DEACTIVATED, at_s=9.0), live=True)
    assert tracker.view(10.0).state is State.UNKNOWN


def test_a_new_run_clears_the_old_runs_death() -> None:
    """The next start (systemd's restart, or a recovery's) is judged afresh."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    tracker.observe(output(VLLM_FATAL, at_s=5.0), live=True)
    started(tracker, "run2", at_s=30.0)
    assert tracker.view(31.0).state is not State.ENGINE_DEAD


def sglang_start(tracker: Liveness, invocation: str, at_s: float, graphs_s: float) -> None:
    """A whole SGLang start: 20 s to weights, 60 s of weights, graphs, 5 s of warm-up."""
    started(tracker, invocation, at_s)
    lines = [
        (20.0, "Load weight begin. avail mem=139.2 GB"),
        (80.0, "Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16"),
        (90.0, "Capture cuda graph begin. This can take up to several minutes. avail mem=9 GB"),
        (90.0 + graphs_s, "Capture cuda graph end. Time elapsed: 1.2 s. mem usage=0.4 GB."),
        (95.0 + graphs_s, "The server is fired up and ready to roll!"),
    ]
    for offset, text in lines:
        tracker.observe(output(text, invocation=invocation, at_s=at_s + offset), live=True)


def test_a_start_that_came_up_is_recorded_phase_by_phase() -> None:
    """Each phase's seconds and start-to-ready are kept for the runs that came up."""
    tracker = Liveness(UNIT, "sglang")
    sglang_start(tracker, "run1", 0.0, graphs_s=230.0)
    view = tracker.view(400.0)
    assert view.state is State.UP
    assert view.last_start is not None
    assert view.last_start.ready_s == 325.0
    assert dict(view.last_start.phases) == {
        Phase.STARTING: 20.0,
        Phase.LOADING_WEIGHTS: 60.0,
        Phase.INITIALISING: 10.0,
        Phase.CAPTURING_CUDA_GRAPHS: 230.0,
        Phase.WARMING_UP: 5.0,
    }


def test_status_says_the_phase_and_how_long_it_usually_takes() -> None:
    """Status names the phase, its time so far, and the usual and longest of earlier starts."""
    tracker = Liveness(UNIT, "sglang")
    for n, graphs_s in enumerate((230.0, 302.0, 200.0, 240.0)):
        sglang_start(tracker, f"run{n}", n * 1000.0, graphs_s)
    started(tracker, "now", 10_000.0)
    tracker.observe(output("Capture cuda graph begin.", invocation="now", at_s=10_090.0), live=True)
    view = tracker.view(10_090.0 + 250.0)
    assert view.state is State.STARTING
    assert view.summary == (
        "loading: capturing CUDA graphs for 4 min 10 s (usual 3 min 55 s, longest 5 min 2 s)"
    )


def test_a_start_past_its_learned_budget_is_stuck_in_its_phase() -> None:
    """No phase progress for longer than 1.5 times the longest seen: stuck, a warning."""
    tracker = Liveness(UNIT, "sglang")
    for n in range(MIN_STARTS):
        sglang_start(tracker, f"run{n}", n * 1000.0, graphs_s=200.0)
    started(tracker, "now", 10_000.0)
    tracker.observe(output("Capture cuda graph begin.", invocation="now", at_s=10_090.0), live=True)
    assert tracker.view(10_090.0 + 290.0).state is State.STARTING  # slow, within 300 s
    view = tracker.view(10_090.0 + 301.0)
    assert view.state is State.STUCK
    assert view.level == "warning"
    assert view.summary.startswith("stuck in phase capturing CUDA graphs for 5 min 1 s")
    assert view.stuck_starts == 1
    assert tracker.view(10_090.0 + 400.0).stuck_starts == 1  # one stuck start, counted once


def test_the_daemon_is_woken_just_past_the_budget_of_a_start_that_prints_nothing() -> None:
    """A hang logs nothing: wake_at names the moment past its phase's budget, then nothing."""
    tracker = Liveness(UNIT, "sglang")
    for n in range(MIN_STARTS):
        sglang_start(tracker, f"run{n}", n * 1000.0, graphs_s=200.0)
    assert tracker.wake_at is None  # the last start came up: nothing is due
    started(tracker, "now", 10_000.0)
    tracker.observe(output("Capture cuda graph begin.", invocation="now", at_s=10_090.0), live=True)
    due = tracker.wake_at
    assert due is not None
    assert 10_090.0 + 300.0 < due < 10_090.0 + 301.0  # the budget: 1.5 x 200 s
    assert tracker.view(due).state is State.STUCK
    assert tracker.wake_at is None  # said once: no wake in the past, no busy loop


def test_a_slow_start_without_enough_history_is_never_stuck() -> None:
    """Fewer than MIN_STARTS starts teach no budget: a slow start is only starting."""
    tracker = Liveness(UNIT, "sglang")
    sglang_start(tracker, "run0", 0.0, graphs_s=10.0)
    started(tracker, "now", 10_000.0)
    tracker.observe(output("Capture cuda graph begin.", invocation="now", at_s=10_090.0), live=True)
    assert tracker.view(10_090.0 + 100_000.0).state is State.STARTING


def test_phase_lines_of_another_server_do_not_count() -> None:
    """SGLang prints uvicorn's "Application startup complete." before its warm-up: not ready."""
    tracker = Liveness(UNIT, "sglang")
    started(tracker)
    tracker.observe(output("INFO:     Application startup complete.", at_s=50.0), live=True)
    assert tracker.view(60.0).state is not State.UP


def test_the_learned_starts_survive_a_restart_of_the_daemon() -> None:
    """export/restore keeps the remembered starts; malformed ones are named and left out."""
    tracker = Liveness(UNIT, "sglang")
    sglang_start(tracker, "run0", 0.0, graphs_s=100.0)
    saved = tracker.export()
    again = Liveness(UNIT, "sglang")
    assert again.restore(saved) == []
    assert again.phase_times(Phase.CAPTURING_CUDA_GRAPHS) is not None
    broken = Liveness(UNIT, "sglang")
    problems = broken.restore({"starts": [{"invocation_id": 1}, {"phases": {"bogus": 1}}]})
    assert len(problems) == 2


def test_every_table_line_matches_its_own_text_and_the_grep_alternation() -> None:
    """Each pattern finds the text it names in its source, alone and inside the alternation."""
    samples = {
        "vllm-engine-fatal": VLLM_FATAL,
        "vllm-worker-died": VLLM_WORKER,
        "vllm-engine-proc-died": "Engine core proc EngineCore_DP0 died unexpectedly, shutting "
        "down client.",
        "vllm-engine-dead-error": "vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
        "encountered an issue. See stack trace (above) for the root cause.",
        "sglang-scheduler-dead": SGLANG_DEAD,
        "sglang-scheduler-exception": "[2025-03-29 18:56:25 TP0] Scheduler hit an exception: Tr",
        "sglang-dp-controller-exception": "DataParallelController hit an exception: Traceback",
        "sglang-scheduler-terminated": "Scheduler or DataParallelController 1234 terminated with 1",
        "sglang-child-failed": "[2026-03-13 14:24:23] Received sigquit from a child process. It "
        "usually means the child failed.",
        "sglang-sigquit-received": "[2026-07-07 07:20:43] SIGQUIT received. signum=None, "
        "frame=None. It usually means one child failed.",
        "sglang-scheduler-watchdog": "[2026-12-07 22:15:11 TP0] Scheduler watchdog timeout "
        "(self.watchdog_timeout=300, self.soft=False)",
        "sglang-load-weight-begin": "[2025-01-01 TP0] Load weight begin. avail mem=78.5 GB",
        "sglang-load-weight-end": "Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16",
        "sglang-capture-cuda-graph-begin": "Capture cuda graph begin. This can take up to "
        "several minutes. avail mem=9.1 GB",
        "sglang-capture-cuda-graph-end": "Capture cuda graph end. Time elapsed: 4.2 s.",
        "sglang-ready": "[2025-01-01] The server is fired up and ready to roll!",
        "vllm-load-begin": "INFO [gpu_model_runner.py:1770] Starting to load model meta/x...",
        "vllm-weights-took": "INFO [default_loader.py:262] Loading weights took 12.04 seconds",
        "vllm-model-loading-took": "INFO Model loading took 15.2 GiB and 13.1 seconds",
        "vllm-init-engine-took": "INFO [core.py:193] init engine (profile, create kv cache, "
        "warmup model) took 45.21 seconds",
        "vllm-ready": "INFO:     Application startup complete.",
    }
    assert set(samples) == {line.key for line in ENGINE_LINES}
    alternation = re.compile(ENGINE_REGEX)
    for key, text in samples.items():
        found = match_line(text)
        assert found is not None, key
        assert found.key == key
        assert alternation.search(text)


def test_fatal_lines_come_before_phase_lines_and_name_their_source() -> None:
    """A line matching both kinds is a death; every line says where its text is from."""
    assert all(line.phase is None for line in FATAL_LINES)
    assert all(line.source and line.cause for line in ENGINE_LINES)


def test_a_hostile_megabyte_line_costs_its_scan_limit() -> None:
    """The parser scans only the first OUTPUT_SCAN_CHARS: a phrase past them is not seen."""
    event = parse_entry(entry("x" * (1 << 20) + VLLM_FATAL), UNIT)
    assert event is None


def test_a_runs_lines_before_its_start_message_are_kept() -> None:
    """The output and PID 1's messages are two streams: a phase line may come first."""
    tracker = Liveness(UNIT, "sglang")
    started(tracker, "old")
    tracker.observe(output("Load weight begin.", invocation="new", at_s=12.0), live=True)
    started(tracker, "new", at_s=10.0)
    tracker.observe(
        output("The server is fired up and ready to roll!", invocation="new", at_s=40.0), live=True
    )
    view = tracker.view(41.0)
    assert view.state is State.UP
    assert view.last_start is not None
    assert view.last_start.ready_s == 30.0


def test_a_line_of_an_ended_run_never_opens_it_again() -> None:
    """Once systemd ended a run, its late fatal lines (a survivor's) are not the unit's news."""
    tracker = Liveness(UNIT, "vllm")
    started(tracker)
    failed = systemd(EventKind.FAILED, at_s=5.0, result="exit-code")
    tracker.observe(failed, live=True)
    assert not tracker.observe(output(VLLM_WORKER, at_s=6.0), live=True)
    assert tracker.view(7.0).state is State.UNKNOWN


def test_a_server_that_prints_no_phase_line_is_never_loading_nor_stuck() -> None:
    """Without a phase line or any start that came up, readiness is unknown, never "loading"."""
    tracker = Liveness(UNIT, "sglang")
    started(tracker)
    view = tracker.view(1_000_000.0)
    assert view.state is State.UNKNOWN
    assert view.summary == "running; readiness unknown (no phase line seen yet)"
    assert view.level is None


HEALTH_DEATH = HealthDeath("run1", 400.0, 1_764_590_400.0, "health check failed 3 times: HTTP 503")


def test_a_death_by_the_health_check_alone_ends_at_a_healthy_answer() -> None:
    """Dead by three slow probes: still probed, and one 200 makes the run up again."""
    tracker = Liveness(UNIT, "sglang")
    sglang_start(tracker, "run1", 0.0, graphs_s=30.0)
    assert tracker.health_failed(HEALTH_DEATH)
    assert tracker.view(401.0).state is State.ENGINE_DEAD
    assert tracker.probed_run == "run1"  # still asked, though dead
    assert tracker.health_back(HealthBack("run1", "HTTP 200"))
    view = tracker.view(402.0)
    assert (view.state, view.deaths) == (State.UP, 1)
    assert tracker.up_run == "run1"


def test_a_fatal_line_after_a_health_death_is_never_undone() -> None:
    """A fatal line while the check called it dead: no longer probed, and a 200 changes nothing."""
    tracker = Liveness(UNIT, "sglang")
    sglang_start(tracker, "run1", 0.0, graphs_s=30.0)
    assert tracker.health_failed(HEALTH_DEATH)
    tracker.observe(output(SGLANG_DEAD, at_s=410.0), live=True)
    assert tracker.probed_run is None
    assert not tracker.health_back(HealthBack("run1", "HTTP 200"))
    view = tracker.view(420.0)
    assert view.state is State.ENGINE_DEAD
    assert view.dead is not None
    assert view.dead.cause.endswith("; then SGLang scheduler dead")


def test_a_restarted_daemon_resumes_the_run_an_earlier_one_saw_ready() -> None:
    """The saved ready run, active in systemd now: up (and probed); any other run is not."""
    tracker = Liveness(UNIT, "sglang")
    sglang_start(tracker, "run1", 0.0, graphs_s=30.0)
    saved = tracker.export()
    assert saved["ready_invocation_id"] == "run1"
    again = Liveness(UNIT, "sglang")
    assert again.restore(saved) == []
    assert not again.resume("run2")  # another run: its start was not seen, nothing is known
    assert again.view(400.0).state is not State.UP
    assert again.resume("run1")
    assert (again.up_run, again.probed_run) == ("run1", "run1")
    assert again.view(500.0).state is State.UP


def test_a_malformed_saved_ready_run_is_named_and_ignored() -> None:
    """A ready_invocation_id that is no ID is a problem named, and resumes nothing."""
    tracker = Liveness(UNIT, "sglang")
    assert tracker.restore({"starts": [], "ready_invocation_id": "x\n" * 3}) == [
        "liveness ready_invocation_id is not an invocation ID"
    ]
    assert not tracker.resume("x\n" * 3)


# --- a left-over's lines under the next run's stamp (issue 34, real vLLM 0.32.0) ----------------

CRASHED = (4101, "stream-of-crashed")
"""The crashed run's API server and the stdout stream it opened: before systemd 256 every line
of its process tree, its orphaned EngineCore's included, carries this _PID and _STREAM_ID."""
REAL_WORKER_DIED = (
    "(EngineCore_DP0 pid=4188) ERROR 12-07 22:15:11 [multiproc_executor.py:150] Worker proc "
    "VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."
)
REAL_FATAL = (
    "(EngineCore_DP0 pid=4188) ERROR 12-07 22:15:11 [core.py:710] EngineCore encountered a "
    "fatal error."
)


def crashed_then_restarted(tracker: Liveness) -> None:
    """Run "crashed" came up and was SIGKILLed; systemd's restart "next" came up and serves."""
    started(tracker, "crashed")
    up = "(APIServer pid=4101) INFO:     Application startup complete."
    tracker.observe(output_from(up, "crashed", 40.0, CRASHED), live=True)
    failed = systemd(EventKind.FAILED, invocation="crashed", at_s=100.0, result="signal")
    tracker.observe(failed, live=True)
    started(tracker, "next", at_s=101.0)
    tracker.observe(output(up, invocation="next", at_s=140.0), live=True)


def output_from(message: str, invocation: str, at_s: float, writer: tuple[int, str]) -> UnitEvent:
    """The event of a line ``writer`` wrote, stamped by journald with ``invocation``."""
    event = parse_entry(entry(message, invocation=invocation, at_s=at_s, writer=writer), UNIT)
    assert event is not None
    return event


@pytest.mark.parametrize("line", [REAL_WORKER_DIED, REAL_FATAL])
def test_a_left_overs_death_lines_on_its_old_stream_never_kill_the_next_run(line: str) -> None:
    """A crashed run's orphaned EngineCore writes vLLM's death lines while the next run serves.

    journald stamps them with the unit's current run; their _PID and _STREAM_ID are the crashed
    run's (systemd 252): the next run stays up.
    """
    tracker = Liveness(UNIT, "vllm")
    crashed_then_restarted(tracker)
    assert not tracker.observe(output_from(line, "next", 150.0, CRASHED), live=True)
    assert not tracker.tick(150.0 + ENGINE_DEAD_GRACE_S + 100.0)
    view = tracker.view(400.0)
    assert view.state is State.UP
    assert tracker.up_run == "next"
    assert view.deaths == 0


def test_a_process_systemd_named_left_over_never_kills_the_next_run() -> None:
    """A left-over systemd named at the start writes death lines as itself: not the next run's.

    systemd 256 and later stamp the writer's own _PID, the PID of "Found left-over process".
    """
    tracker = Liveness(UNIT, "vllm")
    started(tracker, "crashed")
    found = systemd(
        EventKind.LEFT_OVER_PROCESS, invocation="next", at_s=101.0, pid=4188, comm="VLLM::EngineCor"
    )
    tracker.observe(found, live=True)
    started(tracker, "next", at_s=101.0)
    writer = (4188, "stream-of-crashed")
    assert not tracker.observe(output_from(REAL_FATAL, "next", 150.0, writer), live=True)
    assert not tracker.tick(400.0)
    assert tracker.view(400.0).state is not State.ENGINE_DEAD


def test_the_next_runs_own_death_line_still_kills_it_even_on_a_reused_pid() -> None:
    """The next run's own stream says its engine died: dead, though its PID is the crashed run's."""
    tracker = Liveness(UNIT, "vllm")
    crashed_then_restarted(tracker)
    reused = (CRASHED[0], "stream-of-next-on-a-reused-pid")
    assert not tracker.observe(output_from(REAL_FATAL, "next", 150.0, reused), live=True)
    assert tracker.tick(150.0 + ENGINE_DEAD_GRACE_S)
    assert tracker.view(200.0).state is State.ENGINE_DEAD


def test_a_writer_of_another_boot_is_another_process() -> None:
    """PIDs repeat from boot to boot: a line of the last boot's run never mutes this boot's."""
    tracker = Liveness(UNIT, "vllm")
    earlier = entry(REAL_FATAL, invocation="last-boot", at_s=5.0, writer=CRASHED)
    tracker.observe(parse_and_check(earlier | {"_BOOT_ID": "a"}), live=False)
    started(tracker, "next", at_s=101.0)
    assert not tracker.observe(output_from(REAL_FATAL, "next", 150.0, CRASHED), live=True)
    assert tracker.tick(150.0 + ENGINE_DEAD_GRACE_S)
    assert tracker.view(200.0).state is State.ENGINE_DEAD


def parse_and_check(raw: dict[str, Any]) -> UnitEvent:
    """The event of one raw entry (the parser must make one)."""
    event = parse_entry(raw, UNIT)
    assert event is not None
    return event


def test_the_ready_line_that_makes_the_daemon_record_its_ledger_is_the_units_servers() -> None:
    """The daemon records a run's processes at its server's ready line, and only that line.

    A real vLLM's API server crashed 0.2 s after "Application startup complete." (issue 34),
    before the ledger's next timed record: its engine processes were never tied to the run.
    SGLang prints uvicorn's line before its warm-up: only "fired up" is its ready line.
    """
    assert is_ready_line("vllm-ready", "vllm")
    assert is_ready_line("sglang-ready", "sglang")
    assert not is_ready_line("vllm-ready", "sglang")
    assert not is_ready_line("vllm-load-begin", "vllm")
    assert not is_ready_line("vllm-engine-fatal", "vllm")
    assert not is_ready_line(None, "vllm")
