"""Issue 22: TP workers that left the unit's cgroup while the run lived, on a real systemd.

The fake SGLang starts each TP worker through ``systemd-run --scope``
(``FAKE_SGLANG_SCOPE_WORKERS``): each lives in its own transient scope
``tp-worker-<rank>-….scope`` with that scope's ``INVOCATION_ID``, not the unit's. A stop that
ends in SIGKILL (the 30 s drain against ``TimeoutStopSec=3``) or a crash of the main process
leaves all four alive, holding about 119 GiB of each GPU. Nothing of the unit's cgroup or
environment ties them to the run any more; the daemon's ledger, recorded while the run lived,
does.

* (m) the package as shipped (daemon) with the gate: an operator restart, then a crash with
  ``Restart=always``: 0 failed starts and a healthy start each time.
* (n) the daemon alone: a crash (0 failed starts), then an operator restart (at most one), and
  the unit is never left stopped.
* (o) the gate alone (no daemon, so no ledger): it cannot prove whose the workers are, and its
  refusal names them and the operator's command.
* (p) the package with the gate, the daemon held back (SIGSTOP) through a crash with
  ``RestartSec=100ms`` and through an operator's restart, let go once the next run serves: it
  reads each end after systemd started the next run, and kills nothing of that run.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import datetime
from typing import TYPE_CHECKING

import pytest

from e2e.container import ContainerError
from e2e.gpubox import CONFIG, DAEMON, UNIT, GpuBox, daemon_events, install
from e2e.measure import SESSION_NOTES, Timeline
from e2e.scenario import (
    PROCESS_EXIT,
    SAME_STOP_TIMEOUT,
    SERVING_MIB,
    SETTLE_S,
    alive,
    finish,
)

if TYPE_CHECKING:
    from e2e.conftest import ContainerFactory
    from e2e.container import Container
    from e2e.gpubox import Artifacts
    from e2e.measure import Measurement

pytestmark = pytest.mark.slow

SCOPED = "[Service]\nEnvironment=FAKE_SGLANG_SCOPE_WORKERS=1\n"
LEDGER = "/run/gpuguard/ledger.json"
COMMAND = f"gpuguard reap --unit {UNIT} --scope patterns"
#: (o): the gate's wait, short so its refusal comes soon (the shipped default is longer).
GATE_ALONE_CONFIG = CONFIG.replace("gate_timeout_s = 60.0", "gate_timeout_s = 8.0")
#: Issue 22's bound on (m): the run that serves starts within grace + release + 2 s of the
#: trigger (reap_grace_s of CONFIG; the fake driver's release_delay_ms, install's default).
GRACE_S = 1.0
assert f"\nreap_grace_s = {GRACE_S}\n" in CONFIG, "GRACE_S is CONFIG's reap_grace_s"
RELEASE_S = 0.5
BOUND_S = GRACE_S + RELEASE_S + 2.0
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"


def serve_escaped(gpubox: GpuBox, *, after_s: float | None = None) -> tuple[str, list[int]]:
    """Serve (or wait for the run started after ``after_s``); its invocation and TP PIDs.

    Each worker is checked to sit in its own scope with an INVOCATION_ID that is not the run's.
    """
    if after_s is None:
        gpubox.systemctl("enable", UNIT)
        gpubox.drop_in(UNIT, "e2e-scoped.conf", SCOPED)
        serving = gpubox.start_server()
    else:
        serving = gpubox.wait_fired_up(after_s=after_s, timeout=60)
    workers = []
    for rank in range(4):
        [pid] = gpubox.pids(f"sglang::scheduler_TP{rank}")
        cgroup = gpubox.box.read_file(f"/proc/{pid}/cgroup")
        assert f"tp-worker-{rank}-" in cgroup, cgroup
        environ = gpubox.box.read_file(f"/proc/{pid}/environ")
        assert f"INVOCATION_ID={serving}" not in environ
        workers.append(pid)
    return serving, workers


def recorded(gpubox: GpuBox) -> dict[int, str]:
    """PIDs in the daemon's ledger file, with the invocation each was recorded under."""
    with contextlib.suppress(Exception):
        document = json.loads(gpubox.box.read_file(LEDGER))
        return {p[0]: run["invocation_id"] for run in document["runs"] for p in run["processes"]}
    return {}


def wait_recorded(gpubox: GpuBox, serving: str, workers: list[int]) -> None:
    """Wait until the daemon's ledger holds every worker under the serving run."""
    gpubox.box.wait_for(
        "the ledger records the escaped workers",
        lambda: all(recorded(gpubox).get(pid) == serving for pid in workers),
        timeout=30,
    )


def crash(gpubox: GpuBox, timeline: Timeline) -> float:
    """SIGKILL the server's main process (systemd then kills its cgroup, not the scopes)."""
    t0 = time.time()
    timeline.t0 = t0
    gpubox.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT)
    timeline.mark("the main process crashes (SIGKILL); Restart=always, RestartSec=1", t0)
    return t0


def restart(gpubox: GpuBox, timeline: Timeline) -> float:
    """An operator's restart during the 30 s drain (TimeoutStopSec=3: SIGKILL)."""
    t0 = time.time()
    timeline.t0 = t0
    gpubox.systemctl("--no-block", "restart", UNIT)
    timeline.mark("systemctl restart sglang.service (drain 30 s > TimeoutStopSec=3)", t0)
    return t0


def measured(
    gpubox: GpuBox, timeline: Timeline, scenario: str, title: str, gpuguard: str, old: str
) -> Measurement:
    """The scenario's numbers from the journal since its trigger (the old run left out)."""
    time.sleep(SETTLE_S)
    events = gpubox.daemon_log(timeline.t0)
    swept = [str(e.get("summary")) for e in daemon_events(events, "survivors of an ended run")]
    return finish(
        gpubox,
        timeline,
        scenario=scenario,
        title=title,
        gpuguard=gpuguard,
        window_s=round(time.time() - timeline.t0, 1),
        exclude={old},
        actions="; ".join(swept) or "gate reaped the escaped workers",
        notes=["workers in their own transient scopes (systemd-run --scope)"],
        since_s=timeline.t0 - 1,
    )


def start_after(gpubox: GpuBox, since_s: float, serving: str) -> float:
    """Seconds from the old run's end to systemd's start of the run ``serving``, by journald.

    The old run ends when its main process is killed: the crash's SIGKILL, or the restart's
    stop timing out (SIGKILL after TimeoutStopSec=); from then on only the stop-reap, the gate
    and RestartSec= stand before the next start. Both are PID 1's entries with journald's
    trusted fields (``_PID=1``, ``__MONOTONIC_TIMESTAMP``).
    """
    entries = gpubox.box.journal(["_PID=1", f"UNIT={UNIT}", f"--since=@{int(since_s) - 1}"])
    started = [
        int(str(e["__MONOTONIC_TIMESTAMP"]))
        for e in entries
        if e.get("MESSAGE_ID") == UNIT_STARTED and e.get("INVOCATION_ID") == serving
    ]
    assert started, entries
    ended = [
        int(str(e["__MONOTONIC_TIMESTAMP"]))
        for e in entries
        if e.get("INVOCATION_ID") != serving
        and e.get("MESSAGE_ID") == PROCESS_EXIT
        and e.get("EXIT_CODE") == "killed"
        and int(str(e["__MONOTONIC_TIMESTAMP"])) <= started[0]
    ]
    assert ended, entries
    return round((started[0] - max(ended)) / 1e6, 2)


def test_m_daemon_and_gate_escaped_workers_restart_and_crash(gpubox: GpuBox) -> None:
    """The package as shipped with the gate: 0 failed starts after a restart and after a crash."""
    gpubox.install_gate(extra=SAME_STOP_TIMEOUT)
    gpubox.start_daemon()
    serving, workers = serve_escaped(gpubox)
    wait_recorded(gpubox, serving, workers)
    timeline = Timeline(time.time())
    timeline.mark(f"serving (run {serving[:8]}), TP0-TP3 {workers} each in its own scope")
    t0 = restart(gpubox, timeline)
    second, new_workers = serve_escaped(gpubox, after_s=t0)
    m = measured(gpubox, timeline, "m1", "escaped workers, restart, daemon + gate", "both", serving)
    assert m.failed_starts == 0, m
    assert m.healthy_s is not None, m
    took = start_after(gpubox, t0, second)
    SESSION_NOTES.append(
        f"(m1) the old run SIGKILLed at the stop timeout -> the serving run started: {took} s"
    )
    assert took <= BOUND_S, (took, BOUND_S)
    assert not any(alive(gpubox, pid) for pid in workers)
    assert gpubox.allocated() == [SERVING_MIB] * 4  # the new run, alone

    wait_recorded(gpubox, second, new_workers)
    timeline = Timeline(time.time())
    timeline.mark(f"serving (run {second[:8]}), TP0-TP3 {new_workers} each in its own scope")
    t1 = crash(gpubox, timeline)
    third, _ = serve_escaped(gpubox, after_s=t1)
    m = measured(gpubox, timeline, "m2", "escaped workers, crash, daemon + gate", "both", second)
    assert m.failed_starts == 0, m
    assert m.healthy_s is not None, m
    took = start_after(gpubox, t1, third)
    SESSION_NOTES.append(f"(m2) the crash (SIGKILL) -> the serving run started: {took} s")
    assert took <= BOUND_S, (took, BOUND_S)
    assert not any(alive(gpubox, pid) for pid in new_workers)
    assert gpubox.allocated() == [SERVING_MIB] * 4


def test_n_daemon_alone_escaped_workers_crash_and_restart(gpubox: GpuBox) -> None:
    """The daemon alone: a crash costs no failed start, a restart at most one; never left down."""
    gpubox.start_daemon()
    serving, workers = serve_escaped(gpubox)
    wait_recorded(gpubox, serving, workers)
    timeline = Timeline(time.time())
    timeline.mark(f"serving (run {serving[:8]}), TP0-TP3 {workers} each in its own scope")
    t0 = crash(gpubox, timeline)
    second, new_workers = serve_escaped(gpubox, after_s=t0)
    m = measured(gpubox, timeline, "n1", "escaped workers, crash, daemon alone", "daemon", serving)
    assert m.failed_starts == 0, m
    assert not any(alive(gpubox, pid) for pid in workers)

    wait_recorded(gpubox, second, new_workers)
    timeline = Timeline(time.time())
    timeline.mark(f"serving (run {second[:8]}), TP0-TP3 {new_workers} each in its own scope")
    t1 = restart(gpubox, timeline)
    serve_escaped(gpubox, after_s=t1)
    m = measured(gpubox, timeline, "n2", "escaped workers, restart, daemon alone", "daemon", second)
    assert m.failed_starts <= 1, m
    assert m.healthy_s is not None, m
    assert gpubox.show(UNIT, "ActiveState") == "active"
    assert not any(alive(gpubox, pid) for pid in new_workers)


def test_o_gate_alone_names_the_escaped_workers_and_the_command(
    container: ContainerFactory, e2e_artifacts: Artifacts
) -> None:
    """No daemon, no ledger: the gate cannot prove whose the workers are; its refusal says so."""
    booted: Container = container(binds=e2e_artifacts.binds())
    gpubox = GpuBox(booted, install_s=install(booted, config=GATE_ALONE_CONFIG))
    try:
        gpubox.install_gate(extra=SAME_STOP_TIMEOUT)
        serving, workers = serve_escaped(gpubox)
        t0 = restart(gpubox, Timeline(time.time()))
        found: list[str] = []
        said: list[str] = []

        def refused() -> bool:
            said[:] = [
                str(e.get("MESSAGE"))
                for e in gpubox.box.journal([f"_SYSTEMD_UNIT={UNIT}", f"--since=@{int(t0)}"])
            ]
            found.extend(line for line in said if "Start refused" in line and COMMAND in line)
            return bool(found)

        try:
            gpubox.box.wait_for("the gate's refusal", refused, timeout=60)
        except ContainerError:
            raise AssertionError("\n".join(said[-40:])) from None
        assert all(f"PID {pid} (" in found[0] for pid in workers), found[0]
        assert all(alive(gpubox, pid) for pid in workers)  # nothing unproven was signalled
        del serving
    finally:
        gpubox.kill_server()


def caught_up(gpubox: GpuBox, serving: str, workers: list[int]) -> None:
    """Wait until a daemon let go has read what it missed: the run ``serving`` recorded as its.

    Its ledger files the run's workers under that run, then the loop publishes its snapshot
    after the same burst (its sweeps done).
    """
    wait_recorded(gpubox, serving, workers)
    seen = time.time()

    def published() -> bool:
        with contextlib.suppress(Exception):
            document = json.loads(gpubox.box.read_file("/run/gpuguard/daemon.json"))
            updated = datetime.fromisoformat(document["updated_at"]).timestamp()
            return updated >= int(seen)
        return False

    gpubox.box.wait_for("the daemon's snapshot after the burst", published, timeout=90)


def test_p_a_daemon_held_back_kills_nothing_of_the_next_run(gpubox: GpuBox) -> None:
    """The daemon reads a crash and a restart only after systemd started the next run: no kill.

    Before, the end's last record filed the running run's server and workers under the ended
    run, and the sweep SIGTERMed the running run's TP workers as its survivors.
    """
    gpubox.install_gate(extra=SAME_STOP_TIMEOUT + "RestartSec=100ms\n")
    gpubox.start_daemon()
    daemon = gpubox.show(DAEMON, "MainPID")
    serving, workers = serve_escaped(gpubox)
    wait_recorded(gpubox, serving, workers)
    for trigger in (crash, restart):
        timeline = Timeline(time.time())
        gpubox.box.run(["kill", "-STOP", daemon])
        try:
            t0 = trigger(gpubox, timeline)
            serving, workers = serve_escaped(gpubox, after_s=t0)
        finally:
            gpubox.box.run(["kill", "-CONT", daemon])
        caught_up(gpubox, serving, workers)
        signalled = [
            event.get("pid")
            for event in daemon_events(gpubox.daemon_log(t0), "signal")
            if event.get("pid") in workers
        ]
        assert signalled == [], signalled
        assert all(alive(gpubox, pid) for pid in workers)
        assert gpubox.show(UNIT, "ActiveState") == "active"
        assert gpubox.allocated() == [SERVING_MIB] * 4
