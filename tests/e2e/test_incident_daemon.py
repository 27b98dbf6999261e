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
from prometheus_client.parser import text_string_to_metric_families

from e2e.container import Container
from e2e.gpubox import UNIT, GpuBox, daemon_events, install
from e2e.measure import Timeline, results_dir
from e2e.scenario import (
    SERVING_MIB,
    SETTLE_S,
    after_the_sweep,
    alive,
    finish,
    incident,
    story_line,
)

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator
    from pathlib import Path

    from e2e.gpubox import Artifacts
    from e2e.measure import Measurement

pytestmark = pytest.mark.slow

TEXTFILE = "/var/lib/prometheus/node-exporter/gpuguard.prom"
"""Where the daemon writes its metrics by default ([metrics] textfile)."""


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
        # node_exporter's textfile directory as Debian's package leaves it: root's, inside the
        # prometheus user's /var/lib/prometheus (nobody stands in for that user here).
        booted.run(["install", "-d", "-m", "0755", TEXTFILE.rsplit("/", 1)[0]])
        booted.run(["chown", "nobody", "/var/lib/prometheus"])
        unit_file = gpubox.start_daemon()
        timeline.mark(f"gpuguard.service started ({unit_file})")
        t0, serving, tp3 = incident(gpubox, timeline)
        healthy = gpubox.wait_fired_up(after_s=t0, timeout=120)
        healthy_at = time.time()
        time.sleep(SETTLE_S)
        events = after_the_sweep(gpubox, t0)
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
    # A sweep that won the race logs its line once the set is released and _RELEASE_S (5 s)
    # passed with the new run holding the GPUs: that can be after healthy + SETTLE_S.
    deadline = time.monotonic() + 10
    while not m.failed_starts and time.monotonic() < deadline:
        if daemon_events(events, "survivors of an ended run"):
            break
        time.sleep(0.5)
        events = run.gpubox.daemon_log(run.t0)
    # TP3 escaped the unit's cgroup, so systemd's kill never reaches it; whether a sibling is
    # still alive when the sweep looks depends on how that kill raced. What matters: TP3 reaped.
    swept = [e for e in daemon_events(events, "survivors of an ended run") if e.get("pids")]
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
        assert run.tp3 in {pid for e in swept for pid in e["pids"]}, swept
        assert not finished
    assert m.healthy_s is not None
    assert not alive(run.gpubox, run.tp3)
    assert run.gpubox.allocated() == [SERVING_MIB] * 4
    assert run.healthy in {h["invocation_id"] for h in run.gpubox.status_json()["holders"]}
    assert "Daemon: running" in status.stdout


def test_c_after_the_recovery_status_says_the_unit_is_up(daemon_recovery: DaemonRecovery) -> None:
    """stable_s after the healthy start, the daemon's verdict and `gpuguard status` say so."""
    run = daemon_recovery
    snapshots: list[dict[str, Any]] = []

    def stable() -> bool:  # stable_s (5 s here) after the healthy start, and the next snapshot
        snapshots.append(run.gpubox.status_json()["daemon"]["snapshot"]["units"][UNIT])
        return "without failing" in snapshots[-1]["verdict"]

    run.gpubox.box.wait_for("the daemon's verdict: up without failing", stable, timeout=60)
    snapshot = snapshots[-1]
    status = run.gpubox.gpuguard("status")
    assert not snapshot["looping"], snapshot["verdict"]
    assert status.returncode == 0, status.stdout


def test_c_the_metrics_count_what_the_daemon_did(daemon_recovery: DaemonRecovery) -> None:
    """The textfile in node_exporter's directory counts the reap (and the recovery, if any)."""
    run = daemon_recovery
    # A sweep that won the race ends (and is written) once the new run holds the GPUs for 5 s.
    deadline = time.monotonic() + 10
    while True:
        text = run.gpubox.box.run(["cat", TEXTFILE], check=False).stdout
        found = _samples(text)
        reaped = sum(
            v for k, v in found.items() if k.startswith("gpuguard_reaped_processes_total,")
        )
        if reaped >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert reaped >= 1, text
    recoveries = found[f"gpuguard_recoveries_total,result=restarted,unit={UNIT}"]
    assert recoveries == (1 if run.measurement.failed_starts else 0), text
    assert found[f"gpuguard_recoveries_total,result=failed,unit={UNIT}"] == 0
    assert found["gpuguard_daemon_up"] == 1
    assert found["gpuguard_journal_attached"] == 1
    assert found[f"gpuguard_unit_needs_operator,unit={UNIT}"] == 0
    owner = run.gpubox.box.run(["stat", "-c", "%U %a", TEXTFILE]).stdout.split()
    assert owner == ["root", "644"]


def _samples(text: str) -> dict[str, float]:
    """Every sample of an exposition as NAME,label=value,... (prometheus_client's parser)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            found[key] = sample.value
    return found


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
    tp3 = f"PID {run.tp3}: "
    assert any(line.startswith(tp3) and "reaped by gpuguard" in line for line in story["survivors"])
    # The daemon's detector replayed on the same entries reaches each verdict the daemon logged.
    assert story["disagreements"] == [], story["disagreements"]
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
