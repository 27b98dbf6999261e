"""Scenario (c) of issue 6: the incident with gpuguard's daemon alone (no gate drop-in).

gpuguard.service (the packaged unit, as shipped) follows the journal; the
restart during a long drain ends in SIGKILL, TP3 survives in another cgroup, the next start
fails with CUDA OOM, and the daemon must see the loop, reap TP3 and start the unit again. The
scenario runs once (module fixture) and the tests below examine what it left; its own module so
that its container is gone before other scenarios boot theirs (scenario.py has the common part).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from e2e.container import Container
from e2e.gpubox import UNIT, GpuBox, daemon_events, install
from e2e.measure import Timeline, results_dir
from e2e.scenario import SERVING_MIB, SETTLE_S, alive, finish, incident, story_line

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator
    from pathlib import Path

    from e2e.gpubox import Artifacts
    from e2e.measure import Measurement

pytestmark = pytest.mark.slow


@dataclass
class DaemonRecovery:
    """What scenario (c) left behind, for the tests that examine it."""

    gpubox: GpuBox
    t0: float
    tp3: int
    healthy: str
    healthy_at: float
    events: list[dict[str, Any]]
    measurement: Measurement
    status: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def daemon_recovery(rootfs: Path, e2e_artifacts: Artifacts) -> Iterator[DaemonRecovery]:
    """Scenario (c), run once for the tests below: the incident with gpuguard.service alone."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted))
        timeline = Timeline(time.time())
        unit_file = gpubox.start_daemon()
        timeline.mark(f"gpuguard.service started ({unit_file})")
        t0, serving, tp3 = incident(gpubox, timeline)
        healthy = gpubox.wait_fired_up(after_s=t0, timeout=120)
        healthy_at = time.time()
        time.sleep(SETTLE_S)
        events = gpubox.daemon_log(t0)
        finished = daemon_events(events, "recovery finished")
        status = gpubox.gpuguard("status")
        m = finish(
            gpubox,
            timeline,
            scenario="c",
            title="daemon alone (gpuguard run)",
            gpuguard="daemon",
            window_s=round(time.time() - t0, 1),
            exclude={serving},
            actions="; ".join(
                [
                    *(str(e.get("summary")) for e in daemon_events(events, "next run started")),
                    f"{len(finished)} recovery"
                    + "".join(f", {e.get('result')} (reaped {e.get('reaped')})" for e in finished),
                ]
            ),
            notes=[
                "observed until the healthy start + 3 s",
                f"daemon unit: {unit_file}",
                *[f"status: {line}" for line in status.stdout.splitlines() if story_line(line)],
            ],
        )
        yield DaemonRecovery(gpubox, t0, tp3, healthy, healthy_at, events, m, status)
        gpubox.kill_server()


def test_c_daemon_alone_detects_and_recovers(daemon_recovery: DaemonRecovery) -> None:
    """gpuguard.service reaps TP3 when the restart's stop ends, or recovers the first failure.

    The restart's start is immediate: the sweep of the ended run's survivors races the new
    run's model load. Won, nothing fails; lost, the loop rule sees the failed start and the
    recovery reaps TP3. Either way at most one failed start.
    """
    run = daemon_recovery
    events, m, status = run.events, run.measurement, run.status
    swept = [
        e
        for e in daemon_events(events, "survivors of an ended run")
        if str(e.get("summary")).startswith("reaped 1 survivor")
    ]
    loops = daemon_events(events, "restart loop")
    finished = daemon_events(events, "recovery finished")
    assert run.tp3 in {e.get("pid") for e in daemon_events(events, "signal")}
    assert m.failed_starts <= 1, m
    if m.failed_starts:
        assert loops, f"the daemon logged no restart loop: {events}"
        assert loops[0]["cause"] == "stale-gpu-holders"
        assert loops[0]["action"] == "recover"
        assert [e["result"] for e in finished] == ["restarted"], finished
        assert status.stdout.count(": restarted, reaped") == 1
    else:
        assert [e["pids"] for e in swept] == [[run.tp3]], swept
        assert not finished
    assert m.healthy_s is not None
    assert not alive(run.gpubox, run.tp3)
    assert run.gpubox.allocated() == [SERVING_MIB] * 4
    assert run.healthy in {h["invocation_id"] for h in run.gpubox.status_json()["holders"]}
    assert "Daemon: running" in status.stdout


def test_c_after_the_recovery_status_says_the_unit_is_up(daemon_recovery: DaemonRecovery) -> None:
    """stable_s after the healthy start, the daemon's verdict and `gpuguard status` say so."""
    run = daemon_recovery
    # stable_s (5 s in the test configuration) + a margin.
    time.sleep(max(0.0, run.healthy_at + 8 - time.time()))
    snapshot = run.gpubox.status_json()["daemon"]["snapshot"]["units"][UNIT]
    status = run.gpubox.gpuguard("status")
    assert not snapshot["looping"], snapshot["verdict"]
    assert "without failing" in snapshot["verdict"], snapshot["verdict"]
    assert status.returncode == 0, status.stdout


def test_c_explain_tells_the_incident_from_the_journal(daemon_recovery: DaemonRecovery) -> None:
    """`gpuguard explain` tells the incident after the fact, from the container's journal alone.

    The stop timeout, the SIGKILLs, what gpuguard did to TP3 and the healthy run; text and
    --json agree. The text is kept in the results directory for docs/explain.md.
    """
    run = daemon_recovery
    began = time.monotonic()
    text = run.gpubox.gpuguard("explain", "--unit", UNIT)
    done = run.gpubox.gpuguard("explain", "--unit", UNIT, "--json")
    took = time.monotonic() - began
    saved = results_dir() / "explain-c.txt"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(
        f"$ gpuguard explain --unit {UNIT}\n{text.stdout}{text.stderr}"
        f"(text and --json together: {took:.1f} s)\n"
    )
    assert text.returncode == 0, text.stdout + text.stderr
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    story = doc["story"]
    rows = doc["rows"]
    kinds = [(row["source"], row["kind"]) for row in rows]
    assert ("systemd", "stop-timed-out") in kinds
    assert any("State 'stop-sigterm' timed out" in line for line in story["stop_timeouts"])
    assert any("(python) with signal SIGKILL" in line for line in story["sigkilled"])
    assert doc["gpuguard_seen"]
    assert story["would"] == []
    tp3 = f"pid={run.tp3} "
    assert any(tp3 in line and "outcome=" in line for line in story["survivors"]), story
    recovered = daemon_events(run.events, "recovery finished")
    if recovered:  # the race of test_c_daemon_alone_detects_and_recovers, lost: a recovery
        assert any(
            line.startswith("recovery finished: result=restarted") for line in story["gpuguard"]
        )
        assert len(story["failed_starts"]) == 1
    else:  # won: the sweep of the ended run's survivors, nothing failed
        assert any(line.startswith("survivors of an ended run:") for line in story["gpuguard"])
        assert story["failed_starts"] == []
    assert story["healthy"].startswith(f"run {run.healthy[:8]} started and has not failed since")
    assert "What happened:" in text.stdout
    assert f"healthy: run {run.healthy[:8]}" in text.stdout
