"""Scenario (i) of issue 15: the daemon alone prevents the first failed start after a crash.

gpuguard.service (as shipped), no gate drop-in. sglang.service restarts on failure after
``RestartSec=3``; its TP3 worker ignores SIGTERM and sits in another cgroup. The main process
crashes (SIGKILL); systemd kills TP0-TP2 with the cgroup, TP3 survives holding GPU 3. The daemon
reaps TP3 when PID 1 says the run is over, by its INVOCATION_ID, before systemd's restart: the
next start finds the GPUs idle and nothing fails.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.container import Container
from e2e.gpubox import UNIT, GpuBox, daemon_events, install
from e2e.measure import Timeline
from e2e.scenario import SERVING_MIB, SETTLE_S, STUBBORN_TP3, alive, finish, story_line

if TYPE_CHECKING:
    from pathlib import Path

    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

#: A production-like restart policy: restart on failure, after 3 s.
ON_FAILURE = "[Service]\nRestart=on-failure\nRestartSec=3\n"


def test_i_survivors_of_a_crash_are_reaped_before_the_restart(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """0 failed starts: TP3 is reaped on its INVOCATION_ID at the run's end, before RestartSec."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted))
        timeline = Timeline(time.time())
        unit_file = gpubox.start_daemon()
        timeline.mark(f"gpuguard.service started ({unit_file})")
        gpubox.systemctl("enable", UNIT)
        gpubox.drop_in(UNIT, "e2e-fault.conf", STUBBORN_TP3)
        gpubox.drop_in(UNIT, "e2e-restart.conf", ON_FAILURE)
        serving = gpubox.start_server()
        [tp3] = gpubox.pids("sglang::scheduler_TP3")
        workers = set(gpubox.pids("sglang::scheduler_TP"))
        scope = gpubox.escape_to_scope(tp3)
        assert gpubox.allocated() == [SERVING_MIB] * 4
        timeline.mark(f"serving (run {serving[:8]}), TP3 (PID {tp3}) moved to {scope}")
        t0 = time.time()
        timeline.t0 = t0
        gpubox.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT)
        timeline.mark("the server's main process crashes (SIGKILL); RestartSec=3", t0)
        try:
            healthy = gpubox.wait_fired_up(after_s=t0, timeout=60)
            time.sleep(SETTLE_S)
            events = gpubox.daemon_log(t0)
            swept = daemon_events(events, "survivors of an ended run")
            started = daemon_events(events, "next run started")
            status = gpubox.gpuguard("status")
            m = finish(
                gpubox,
                timeline,
                scenario="i",
                title="crash, RestartSec=3, daemon alone",
                gpuguard="daemon",
                window_s=round(time.time() - t0, 1),
                exclude={serving},
                actions="; ".join(str(e.get("summary")) for e in started or swept),
                notes=[
                    "observed until the healthy start + 3 s",
                    *[f"status: {line}" for line in status.stdout.splitlines() if story_line(line)],
                ],
            )
            assert m.failed_starts == 0, m
            assert m.healthy_s is not None
            [sweep] = [e for e in swept if e.get("invocation_id") == serving]
            # TP3, which left the cgroup, is reaped; the workers systemd kills with the cgroup
            # may still be alive when the daemon sweeps (a race with systemd's own kill, on a
            # loaded machine), and then are reaped too: all of the ended run, no one else.
            assert tp3 in sweep["pids"], sweep
            assert set(sweep["pids"]) <= workers, (sweep, workers)
            count = len(sweep["pids"])
            survivors = f"reaped {count} survivor{'s' if count > 1 else ''} of run {serving[:8]}"
            assert str(sweep["summary"]).startswith(survivors), sweep
            assert tp3 in {e.get("pid") for e in daemon_events(events, "signal")}
            assert "GPUs idle before the restart" in str(started[0]["summary"]), started
            assert not daemon_events(events, "recovery finished")
            assert not alive(gpubox, tp3)
            assert gpubox.allocated() == [SERVING_MIB] * 4
            assert healthy in {h["invocation_id"] for h in gpubox.status_json()["holders"]}
            assert f"{survivors} within" in status.stdout
        finally:
            gpubox.kill_server()
