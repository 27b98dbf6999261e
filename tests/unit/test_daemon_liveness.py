"""The daemon and a dead engine: reported by default, recovered only for a unit that opted in.

The journal is systemd 252's own record of a clean start (tests/journal_samples), with one line
of the unit's output changed into a server's fatal line; every other port is an in-memory twin
(tests/support/daemontwins.py). What decides is the real code: events, liveness, planner.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest
import snapshots
from daemontwins import (
    TURNS,
    GpuHost,
    Harness,
    JournalClock,
    Recorder,
    ReplayFollower,
    SteppedClock,
    UnitTwin,
    daemon_twin,
    twin_settings,
)

from gpuguard.core.healthcheck import SILENT_DEAD_S, HealthTarget, ProbeResult
from gpuguard.core.levels import Level
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext, UnitView
from gpuguard.core.status.text import render_text
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Callable

UNIT = "vllm.service"
SAMPLE = Path(__file__).resolve().parents[1] / "journal_samples" / "bookworm"
FATAL = (
    "(EngineCore_DP0 pid=413) ERROR 11-10 12:30:57 [core.py:710] EngineCore encountered a fatal "
    "error."
)
REAL_WORKER_DIED = (
    "(EngineCore_DP0 pid=188) ERROR 12-07 22:15:11 [multiproc_executor.py:150] Worker proc "
    "VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."
)


def clean_start_stop() -> list[dict[str, object]]:
    """The entries systemd 252 wrote for a clean start, output and stop, renamed to UNIT."""
    entries = []
    for line in (SAMPLE / "clean-start-stop.jsonl").read_text().splitlines():
        entry = json.loads(line)
        for key in ("UNIT", "_SYSTEMD_UNIT"):
            if entry.get(key) == "sglang.service":
                entry[key] = UNIT
        entries.append(entry)
    return entries


def with_fatal_line(*, dead_for_s: float) -> list[dict[str, object]]:
    """Started, then the unit's output says its engine died ``dead_for_s`` before the newest entry.

    The sample's own output line ("sglang: serving") becomes the fatal line; its stop is cut.
    """
    starting, started, output = clean_start_stop()[:3]
    fatal = dict(output) | {"MESSAGE": FATAL}
    newest = int(str(fatal["__MONOTONIC_TIMESTAMP"])) + int(dead_for_s * 1e6)
    later = dict(output) | {
        "MESSAGE": "INFO: 127.0.0.1 GET /version 200",
        "__CURSOR": str(output["__CURSOR"]) + "0",
        "__MONOTONIC_TIMESTAMP": str(newest),
    }
    return [starting, started, fatal, later]


def build(
    tmp_path: Path,
    entries: list[dict[str, object]],
    *,
    on_engine_dead: Literal["report", "recover"] = "report",
    on_start_stuck: Literal["report", "recover"] = "report",
    live: bool = True,
    learned: list[dict[str, Any]] | None = None,
    health_url: str | None = None,
    probe_health: Callable[[HealthTarget, float], ProbeResult] | None = None,
    active: str = "active",
    clock: JournalClock | None = None,
    turns: int = TURNS,
) -> Harness:
    """A daemon watching UNIT (a vLLM unit) over ``entries``; it stops after a few idle turns.

    ``learned``: the starts the unit's saved state holds (core.liveness export).
    """
    units = UnitSettings(
        server="vllm",
        on_engine_dead=on_engine_dead,
        on_start_stuck=on_start_stuck,
        health_url=health_url,
        health_failures=1,
    )
    settings = twin_settings(tmp_path, {UNIT: units})
    twin = UnitTwin(invocation=str(entries[0]["INVOCATION_ID"]), active=active)
    saved: dict[str, dict[str, Any]] = {}
    if learned is not None:
        saved[UNIT] = {"schema_version": 1, "liveness": {"starts": learned}}
    follower = ReplayFollower(entries, live=live)
    return daemon_twin(
        settings,
        follower,
        GpuHost(),
        twin,
        saved=saved,
        probe_health=probe_health,
        clock=clock,
        turns=turns,
    )


def _status(harness: Harness) -> tuple[Level, str]:
    """What `gpuguard status` makes of the daemon's last snapshot."""
    context = StatusContext(
        watched_units={UNIT: ()},
        protected_names=(),
        idle_threshold_bytes=16 << 20,
        as_root=True,
        units=(UnitView(UNIT, "active (running)", "0-3"),),
        daemon=snapshots.running(snapshots.read_back(harness.snapshots[-1])),
    )
    report = assess(harness.host.gather(), context, datetime.now(timezone.utc))
    return report.level, render_text(report)


def test_a_dead_engine_is_reported_critical_and_left_alone_by_default(tmp_path: Path) -> None:
    """The fatal line of a running vLLM unit: CRITICAL in status, an error line, no systemctl."""
    harness = build(tmp_path, with_fatal_line(dead_for_s=30.0))

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    [(log_level, said)] = harness.said("engine dead")
    assert (log_level, said["cause"], said["action"]) == (
        "error",
        "EngineCore fatal error",
        "report",
    )
    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert liveness["state"] == "engine-dead"
    assert liveness["engine_deaths"] == 1
    level, text = _status(harness)
    assert level is Level.CRITICAL
    assert "(EngineCore fatal error); unit still active" in text
    assert any(note.startswith("STATUS") and "engine dead" in note for note in harness.log.notes)


def crash_restart_and_a_left_overs_death_lines() -> list[dict[str, object]]:
    """Issue 34's journal in systemd 252's shapes: a crash, a restart, a left-over's death lines.

    Run A up, its API server SIGKILLed, run B started and up; then A's orphaned EngineCore, its
    worker reaped, writes vLLM's death lines on A's stdout stream (A's _PID and _STREAM_ID),
    which journald stamps with run B.
    """
    starting, started, output = clean_start_stop()[:3]
    killed = next(
        json.loads(line)
        for line in (SAMPLE / "stop-sigterm-timeout.jsonl").read_text().splitlines()
        if "Main process exited" in line
    )
    run_a, run_b = str(started["INVOCATION_ID"]), "b0" * 16
    at = int(str(output["__MONOTONIC_TIMESTAMP"]))

    def moved(entry: dict[str, object], n: int, **fields: object) -> dict[str, object]:
        return dict(entry) | {
            "__CURSOR": f"{entry['__CURSOR']};issue34={n}",
            "__MONOTONIC_TIMESTAMP": str(at + n * 1_000_000),
            "__REALTIME_TIMESTAMP": str(int(str(entry["__REALTIME_TIMESTAMP"])) + n * 1_000_000),
            **fields,
        }

    b_writer = {"_PID": "91", "_STREAM_ID": "b1" * 16, "_SYSTEMD_INVOCATION_ID": run_b}
    return [
        starting,
        started,
        moved(output, 0, MESSAGE="(APIServer pid=58) INFO:     Application startup complete."),
        moved(killed, 10, UNIT=UNIT, INVOCATION_ID=run_a),
        moved(starting, 11, INVOCATION_ID=run_b),
        moved(started, 12, INVOCATION_ID=run_b),
        moved(output, 50, MESSAGE="(APIServer pid=91) INFO:     Application startup complete.")
        | b_writer,
        moved(output, 51, MESSAGE=REAL_WORKER_DIED, _SYSTEMD_INVOCATION_ID=run_b),
        moved(output, 52, MESSAGE=FATAL, _SYSTEMD_INVOCATION_ID=run_b),
        moved(output, 160, MESSAGE="INFO: 127.0.0.1 GET /v1/completions 200") | b_writer,
    ]


def test_a_left_overs_death_lines_never_make_the_next_runs_engine_dead(tmp_path: Path) -> None:
    """The crashed run's orphan says vLLM's death lines while run B serves: B stays up, untouched.

    Issue 34: status said "CRITICAL - engine dead … unit still active" long after B served,
    and an opted-in unit would have been restarted.
    """
    entries = crash_restart_and_a_left_overs_death_lines()
    harness = build(tmp_path, entries, on_engine_dead="recover")
    harness.unit.invocation = "b0" * 16

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not harness.said("engine dead")
    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert liveness["state"] == "up"
    assert liveness["engine_deaths"] == 0
    level, text = _status(harness)
    assert level is not Level.CRITICAL, text


def test_an_opted_in_unit_is_recovered_once_its_engine_stays_dead(tmp_path: Path) -> None:
    """A unit that opted in is recovered the usual way once its grace is over."""
    harness = build(tmp_path, with_fatal_line(dead_for_s=30.0), on_engine_dead="recover")

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {UNIT}", f"reset-failed {UNIT}", f"start {UNIT}"]
    [(_, decision)] = harness.said("engine dead: decision")
    assert decision["action"] == "recover"
    record = harness.snapshots[-1]["units"][UNIT]["recoveries"][-1]
    assert record["result"] == "restarted"
    assert str(record["reason"]).startswith("engine dead since ")
    assert record["evidence"] == [FATAL]


def test_an_engine_dead_only_for_seconds_is_not_acted_on_yet(tmp_path: Path) -> None:
    """Within its grace, the server's own exit may still come: neither said nor done yet."""
    harness = build(tmp_path, with_fatal_line(dead_for_s=1.0), on_engine_dead="recover")

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not harness.said("engine dead")
    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] != "engine-dead"


def test_a_dead_engine_in_replayed_history_is_shown_and_never_acted_on(tmp_path: Path) -> None:
    """History at start rebuilds the verdict for status; even an opted-in unit is not touched."""
    harness = build(
        tmp_path, with_fatal_line(dead_for_s=30.0), on_engine_dead="recover", live=False
    )

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not harness.said("engine dead")
    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] == "engine-dead"


def test_an_exit_0_no_stop_job_asked_for_is_a_dead_engine(tmp_path: Path) -> None:
    """A recorded "Deactivated successfully" without its "Stopping" is reported as dead."""
    starting, started, output, _stopping, deactivated, _stopped = clean_start_stop()
    harness = build(tmp_path, [starting, started, output, deactivated])

    assert harness.daemon.run() == 0

    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert liveness["state"] == "engine-dead"
    assert "no stop job asked for it" in liveness["summary"]
    assert "unit inactive" in liveness["summary"]


def test_an_operators_stop_is_no_dead_engine(tmp_path: Path) -> None:
    """The whole recorded start and stop: a stop job asked for that exit."""
    harness = build(tmp_path, clean_start_stop())

    assert harness.daemon.run() == 0

    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] != "engine-dead"
    level, _ = _status(harness)
    assert level is Level.OK


def came_up() -> list[dict[str, object]]:
    """A vLLM start with its phase lines, up to "Application startup complete." (ready)."""
    starting, started, output = clean_start_stop()[:3]
    base = int(str(output["__MONOTONIC_TIMESTAMP"]))
    lines = [
        (0, "Starting to load model meta-llama/Llama-3.1-70B..."),
        (40, "Loading weights took 38.51 seconds"),
        (42, "Model loading took 131.4 GiB and 41.2 seconds"),
        (100, "init engine (profile, create kv cache, warmup model) took 57.90 seconds"),
        (103, "INFO:     Application startup complete."),
    ]
    phases = [
        dict(output)
        | {
            "MESSAGE": text,
            "__CURSOR": f"{output['__CURSOR']}{n}",
            "__MONOTONIC_TIMESTAMP": str(base + int(at * 1e6)),
        }
        for n, (at, text) in enumerate(lines)
    ]
    return [starting, started, *phases]


def test_a_start_that_came_up_is_saved_phase_by_phase(tmp_path: Path) -> None:
    """The phase lines of a vLLM start reach the unit's saved state, second by second."""
    harness = build(tmp_path, came_up())

    assert harness.daemon.run() == 0

    [start] = harness.saved[UNIT]["liveness"]["starts"]
    assert start["phases"]["loading-weights"] == 40.0
    assert start["phases"]["warming-up"] == 3.0
    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert liveness["state"] == "up"
    assert liveness["last_start"]["ready_s"] == start["ready_s"]
    level, text = _status(harness)
    assert level is Level.OK
    assert f"engine: up (ready 1 min {start['ready_s'] - 60:.0f} s after its start)" in text


def exit_0_then_quiet(*, quiet_s: float) -> list[dict[str, object]]:
    """A start, then an exit 0 no stop job asked for, then ``quiet_s`` of nothing new."""
    starting, started, output, _stopping, deactivated, _stopped = clean_start_stop()
    later = dict(output) | {
        "MESSAGE": "INFO: shutting down",
        "__CURSOR": str(output["__CURSOR"]) + "0",
        "__MONOTONIC_TIMESTAMP": str(
            int(str(deactivated["__MONOTONIC_TIMESTAMP"])) + int(quiet_s * 1e6)
        ),
    }
    return [starting, started, output, deactivated, later]


def test_an_opted_in_unit_left_inactive_by_an_exit_0_is_started_again(tmp_path: Path) -> None:
    """Restart=on-failure saw a success and restarts nothing: the daemon's recovery does."""
    harness = build(tmp_path, exit_0_then_quiet(quiet_s=30.0), on_engine_dead="recover")
    harness.unit.active = "inactive"

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {UNIT}", f"reset-failed {UNIT}", f"start {UNIT}"]
    assert harness.snapshots[-1]["units"][UNIT]["recoveries"][-1]["result"] == "restarted"


def test_an_exit_0_systemd_restarts_by_itself_is_left_to_systemd(tmp_path: Path) -> None:
    """Restart=always (the unit in auto-restart): reported, and no systemctl call."""
    harness = build(tmp_path, exit_0_then_quiet(quiet_s=30.0), on_engine_dead="recover")
    harness.unit.active = "activating"

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    [(_, decision)] = harness.said("engine dead: decision")
    assert decision["action"] == "report"
    assert "auto-restart" in str(decision["reason"])


def loading_for(seconds: float) -> list[dict[str, object]]:
    """Started, then vLLM's "Starting to load model" line, and ``seconds`` later nothing else."""
    starting, started, output = clean_start_stop()[:3]
    base = int(str(output["__MONOTONIC_TIMESTAMP"]))
    loading = dict(output) | {"MESSAGE": "Starting to load model meta-llama/Llama-3.1-70B..."}
    quiet = dict(output) | {
        "MESSAGE": "INFO: 127.0.0.1 GET /health 503",
        "__CURSOR": f"{output['__CURSOR']}1",
        "__MONOTONIC_TIMESTAMP": str(base + int(seconds * 1e6)),
    }
    return [starting, started, loading, quiet]


LEARNED = [
    {"invocation_id": f"run{n}", "ready_s": 120.0, "phases": {"loading-weights": 40.0}}
    for n in range(3)
]
"""Three starts whose weights took 40 s: the phase's budget is 100 s (40 s + 60 s)."""


def test_a_stuck_start_is_only_reported_by_default(tmp_path: Path) -> None:
    """Loading weights for 5 min against a 100 s budget: one warning, nothing done."""
    harness = build(tmp_path, loading_for(300.0), learned=LEARNED)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    [(level, said)] = harness.said("start stuck")
    assert (level, said["action"]) == ("warning", "report")
    assert str(said["summary"]).startswith("stuck in phase loading weights for 5 min")


def test_an_opted_in_stuck_start_is_recovered_the_usual_way(tmp_path: Path) -> None:
    """on_start_stuck = "recover": stop, reset-failed, start, recorded with the stuck summary."""
    harness = build(tmp_path, loading_for(300.0), learned=LEARNED, on_start_stuck="recover")

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {UNIT}", f"reset-failed {UNIT}", f"start {UNIT}"]
    [(_, decision)] = harness.said("start stuck: decision")
    assert decision["action"] == "recover"
    record = harness.snapshots[-1]["units"][UNIT]["recoveries"][-1]
    assert record["result"] == "restarted"
    assert str(record["reason"]).startswith("stuck in phase loading weights")


def test_a_slow_start_within_its_budget_is_never_touched(tmp_path: Path) -> None:
    """Loading weights for 90 s, within its 100 s budget, even opted in: nothing said or done."""
    harness = build(tmp_path, loading_for(90.0), learned=LEARNED, on_start_stuck="recover")

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not harness.said("start stuck")
    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] == "starting"


def test_a_stuck_start_that_is_no_longer_the_units_run_is_left_alone(tmp_path: Path) -> None:
    """Another invocation runs now: the stuck run is not the unit's, so it is only reported."""
    harness = build(tmp_path, loading_for(300.0), learned=LEARNED, on_start_stuck="recover")
    harness.unit.invocation = "f" * 32

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    [(_, decision)] = harness.said("start stuck: decision")
    assert decision["action"] == "report"
    assert decision["reason"] == f"the stuck start is no longer {UNIT}'s run"


class ProbeTwin:
    """The health probe's twin: answers what it is told, and remembers each probe."""

    def __init__(self, answer: ProbeResult) -> None:
        """Answer ``answer`` to every probe."""
        self.answer = answer
        self.asked: list[tuple[HealthTarget, float]] = []

    def __call__(self, target: HealthTarget, timeout_s: float) -> ProbeResult:
        """One probe."""
        self.asked.append((target, timeout_s))
        return self.answer


HEALTH_URL = "http://127.0.0.1:8000/health"


def test_a_failed_health_check_makes_a_dead_engine_reported_by_default(tmp_path: Path) -> None:
    """An up run whose health check fails: CRITICAL, named by the check, and left alone."""
    probe = ProbeTwin(ProbeResult(ok=False, detail="HTTP 503"))
    harness = build(tmp_path, came_up(), health_url=HEALTH_URL, probe_health=probe)

    assert harness.daemon.run() == 0

    assert probe.asked == [(HealthTarget("/health", "127.0.0.1", 8000), 2.0)]
    assert harness.unit.calls == []
    [(log_level, said)] = harness.said("engine dead")
    assert (log_level, said["cause"], said["action"]) == (
        "error",
        "health check failed once: HTTP 503",
        "report",
    )
    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert (liveness["state"], liveness["engine_deaths"]) == ("engine-dead", 1)
    level, text = _status(harness)
    assert level is Level.CRITICAL
    assert "(health check failed once: HTTP 503); unit still active" in text


def test_an_opted_in_unit_is_recovered_when_its_health_check_fails(tmp_path: Path) -> None:
    """With on_engine_dead = "recover", a failed health check brings the usual recovery."""
    probe = ProbeTwin(ProbeResult(ok=False, detail="connection refused"))
    harness = build(
        tmp_path, came_up(), on_engine_dead="recover", health_url=HEALTH_URL, probe_health=probe
    )

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {UNIT}", f"reset-failed {UNIT}", f"start {UNIT}"]
    record = harness.snapshots[-1]["units"][UNIT]["recoveries"][-1]
    assert record["result"] == "restarted"
    assert "health check failed once: connection refused" in str(record["reason"])


def test_a_busy_engine_is_never_restarted_for_slow_answers(tmp_path: Path) -> None:
    """Opted in to recovery: health probes that time out (a busy engine) restart nothing."""
    probe = ProbeTwin(ProbeResult(ok=False, detail="no answer within 2 s"))
    harness = build(
        tmp_path, came_up(), on_engine_dead="recover", health_url=HEALTH_URL, probe_health=probe
    )

    assert harness.daemon.run() == 0

    assert probe.asked
    assert harness.unit.calls == []
    assert harness.said("engine dead") == []


def test_an_engine_silent_far_past_its_timeout_is_restarted_once(tmp_path: Path) -> None:
    """No 2xx for SILENT_DEAD_S: dead by silence, and the opted-in unit restarted once."""
    clock = SteppedClock.of(came_up())

    def probe(target: HealthTarget, timeout_s: float) -> ProbeResult:
        del target
        clock.advance(SILENT_DEAD_S / 2)  # the daemon's turns come this far apart
        return ProbeResult(ok=False, detail=f"no answer within {timeout_s:g} s")

    harness = build(
        tmp_path,
        came_up(),
        on_engine_dead="recover",
        health_url=HEALTH_URL,
        probe_health=probe,
        clock=clock,
        turns=12,
    )

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {UNIT}", f"reset-failed {UNIT}", f"start {UNIT}"]
    [(_, said)] = harness.said("engine dead")
    assert str(said["cause"]).startswith("health check answered no 2xx for ")


def test_a_healthy_answer_is_no_news(tmp_path: Path) -> None:
    """An up run that answers 200 is up, probed, and nothing is said."""
    probe = ProbeTwin(ProbeResult(ok=True, detail="HTTP 200"))
    harness = build(tmp_path, came_up(), health_url=HEALTH_URL, probe_health=probe)

    assert harness.daemon.run() == 0

    assert len(probe.asked) == 1
    assert harness.said("engine dead") == []
    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] == "up"


def test_a_start_is_never_probed(tmp_path: Path) -> None:
    """A run still loading (no ready line) is not asked for its health."""
    probe = ProbeTwin(ProbeResult(ok=False, detail="connection refused"))
    harness = build(tmp_path, came_up()[:-1], health_url=HEALTH_URL, probe_health=probe)

    assert harness.daemon.run() == 0

    assert probe.asked == []
    assert harness.said("engine dead") == []


def test_a_check_its_sandbox_refuses_is_said_and_never_counted(tmp_path: Path) -> None:
    """A TCP check under the shipped sandbox: one warning naming doctor, no dead engine."""
    probe = ProbeTwin(
        ProbeResult(ok=False, detail="cannot make the socket (refused)", counts=False)
    )
    harness = build(tmp_path, came_up(), health_url=HEALTH_URL, probe_health=probe)

    assert harness.daemon.run() == 0

    [(level, said)] = harness.said("health check cannot run")
    assert (level, said["reason"]) == ("warning", "cannot make the socket (refused)")
    assert harness.said("engine dead") == []
    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] == "up"


@pytest.mark.parametrize(
    ("active", "invocation"),
    [("deactivating", None), ("active", "f" * 32)],
    ids=["being-stopped", "restarted"],
)
def test_health_failures_of_a_run_systemd_no_longer_runs_active_are_dropped(
    tmp_path: Path, active: str, invocation: str | None
) -> None:
    """A stop or restart the journal has not told yet: no engine dead, not counted, no systemctl."""
    probe = ProbeTwin(ProbeResult(ok=False, detail="connection refused"))
    harness = build(
        tmp_path,
        came_up(),
        on_engine_dead="recover",
        health_url=HEALTH_URL,
        probe_health=probe,
        active=active,
    )
    harness.unit.invocation = invocation or harness.unit.invocation

    assert harness.daemon.run() == 0

    assert probe.asked
    assert harness.unit.calls == []
    assert harness.said("engine dead") == []
    assert harness.said("engine dead: decision") == []
    [(level, said)] = harness.said("health check failures not counted")[:1]
    assert (level, said["active_state"]) == ("debug", active)
    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert (liveness["state"], liveness["engine_deaths"]) == ("up", 0)


class ScriptedProbe:
    """A probe twin that answers from a script, then its last answer again."""

    def __init__(self, answers: list[ProbeResult]) -> None:
        """Answer ``answers`` in order."""
        self.answers = answers
        self.asked: list[tuple[HealthTarget, float]] = []

    def __call__(self, target: HealthTarget, timeout_s: float) -> ProbeResult:
        """One probe."""
        self.asked.append((target, timeout_s))
        return self.answers[min(len(self.asked), len(self.answers)) - 1]


def test_a_health_death_is_probed_on_and_one_success_ends_it(tmp_path: Path) -> None:
    """Reported only: the run is still probed, and its next 200 clears the dead engine."""
    clock = SteppedClock.of(came_up())
    probe = ScriptedProbe(
        [
            ProbeResult(ok=False, detail="HTTP 503"),
            ProbeResult(ok=True, detail="HTTP 200"),
        ]
    )
    harness = build(
        tmp_path, came_up(), health_url=HEALTH_URL, probe_health=probe, clock=clock, turns=12
    )

    assert harness.daemon.run() == 0

    assert len(probe.asked) >= 2
    [(level, _)] = harness.said("engine dead")
    assert level == "error"
    [(level, back)] = harness.said("engine answers again")
    assert (level, back["detail"]) == ("info", "HTTP 200")
    liveness = harness.snapshots[-1]["units"][UNIT]["liveness"]
    assert (liveness["state"], liveness["engine_deaths"]) == ("up", 1)


def test_two_units_probed_in_one_turn_have_a_watchdog_ping_between(tmp_path: Path) -> None:
    """The second probe of a turn comes after a WATCHDOG=1: two timeouts never add up silently."""
    other = "sglang-b.service"
    renamed = [
        entry
        | {key: other for key in ("UNIT", "_SYSTEMD_UNIT") if entry.get(key) == UNIT}
        | {
            key: f"{entry[key]}b"
            for key in ("INVOCATION_ID", "_SYSTEMD_INVOCATION_ID", "__CURSOR")
            if key in entry
        }
        for entry in came_up()
    ]
    recorder = Recorder()
    asked: list[int] = []

    def probe(target: HealthTarget, timeout_s: float) -> ProbeResult:
        del target, timeout_s
        asked.append(len(recorder.notes))
        return ProbeResult(ok=True, detail="HTTP 200")

    unit = UnitSettings(server="vllm", health_url=HEALTH_URL)
    settings = twin_settings(tmp_path, {UNIT: unit, other: unit})
    follower = ReplayFollower([*came_up(), *renamed])
    twin = UnitTwin(invocation=str(came_up()[0]["INVOCATION_ID"]), active="active")
    harness = daemon_twin(
        settings,
        follower,
        GpuHost(),
        twin,
        log=recorder,
        probe_health=probe,
        watchdog_interval_s=15.0,
    )

    assert harness.daemon.run() == 0

    first, second = asked
    assert "WATCHDOG" in recorder.notes[first:second]


def renamed_run(unit: str, tag: str) -> list[dict[str, object]]:
    """came_up() as another unit's run: its own name, invocation ID and cursors."""
    return [
        entry
        | {key: unit for key in ("UNIT", "_SYSTEMD_UNIT") if entry.get(key) == UNIT}
        | {
            key: f"{entry[key]}{tag}"
            for key in ("INVOCATION_ID", "_SYSTEMD_INVOCATION_ID", "__CURSOR")
            if key in entry
        }
        for entry in came_up()
    ]


def test_probes_that_take_their_timeout_share_one_budget_per_turn(tmp_path: Path) -> None:
    """Three units whose probes each take the full timeout: one per loop turn, in turn."""
    names = (UNIT, "b.service", "c.service")
    entries = [*came_up(), *renamed_run(names[1], "b"), *renamed_run(names[2], "c")]
    clock = SteppedClock.of(entries)
    seen: list[tuple[int, int]] = []

    def probe(target: HealthTarget, timeout_s: float) -> ProbeResult:
        seen.append((harness.turns[0], target.port))
        clock.advance(timeout_s)  # a server that hangs: the probe takes all of its timeout
        return ProbeResult(ok=False, detail=f"no answer within {timeout_s:g} s")

    settings = twin_settings(
        tmp_path,
        {
            name: UnitSettings(server="vllm", health_url=f"http://127.0.0.1:{8001 + n}/health")
            for n, name in enumerate(names)
        },
    )
    harness = daemon_twin(
        settings,
        ReplayFollower(entries),
        GpuHost(),
        UnitTwin(invocation=str(came_up()[0]["INVOCATION_ID"]), active="active"),
        clock=clock,
        probe_health=probe,
    )

    assert harness.daemon.run() == 0

    assert seen[:3] == [(1, 8001), (2, 8002), (3, 8003)]


def test_a_restarted_daemon_probes_the_run_it_saw_ready_before(tmp_path: Path) -> None:
    """After a restart, the journal past its cursor is quiet: the saved ready run is still up."""
    invocation = str(came_up()[0]["INVOCATION_ID"])
    first = build(tmp_path, came_up())
    assert first.daemon.run() == 0
    saved = first.saved[UNIT]["liveness"]
    assert saved["ready_invocation_id"] == invocation

    probe = ProbeTwin(ProbeResult(ok=True, detail="HTTP 200"))
    units = UnitSettings(server="vllm", health_url=HEALTH_URL)
    harness = daemon_twin(
        twin_settings(tmp_path, {UNIT: units}),
        ReplayFollower([]),
        GpuHost(),
        UnitTwin(invocation=invocation, active="active"),
        clock=JournalClock.of(came_up()),
        saved={UNIT: {"schema_version": 1, "liveness": saved}},
        probe_health=probe,
    )

    assert harness.daemon.run() == 0

    assert len(probe.asked) == 1
    [(_, said)] = harness.said("run up since before")
    assert said["invocation_id"] == invocation
    assert harness.snapshots[-1]["units"][UNIT]["liveness"]["state"] == "up"
