"""Issue 10: the daemon never starts a unit an operator stopped, on a real systemd.

The attack: an operator's `systemctl restart` times out in the drain (SIGKILL), the next run
comes up; then the operator runs `systemctl stop`, which times out too and leaves a worker that
had escaped the unit's cgroup holding GPU 3. On main the daemon called that an "immediate
restart loop" (a stop timed out and the next run failed - by the operator's stop), found the
stale holder and recovered: it reaped the worker and **started the unit the operator had just
stopped**. systemd marks the operator's stop as a stop job (``JOB_TYPE=stop``); gpuguard must
leave the unit stopped and the worker alone (it is the operator's to clean up, `gpuguard reap`).
Its own module: its container is gone before other scenarios boot theirs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.container import Container
from e2e.gpubox import UNIT, GpuBox, daemon_events, install
from e2e.scenario import STUBBORN_TP3, alive, pid1_messages

if TYPE_CHECKING:
    from pathlib import Path

    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
STARTED = "39f53479d3a045ac8e11786248231fbf"
# How long the daemon gets to (wrongly) act after the stop: on main it recovered within ~5 s.
WATCH_S = 15.0


def test_an_operators_stop_after_a_timed_out_restart_is_left_alone(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """Restart and stop both time out, a stale worker holds GPU 3: the unit stays stopped."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted))
        try:
            gpubox.start_daemon()
            gpubox.systemctl("enable", UNIT)
            gpubox.drop_in(UNIT, "e2e-fault.conf", STUBBORN_TP3)
            gpubox.start_server()
            restarted = time.time()
            gpubox.systemctl("--no-block", "restart", UNIT)  # drain 30 s > TimeoutStopSec=3
            gpubox.wait_fired_up(after_s=restarted, timeout=60)
            [tp3] = gpubox.pids("sglang::scheduler_TP3")
            gpubox.escape_to_scope(tp3)
            stopped = time.time()
            gpubox.systemctl("--no-block", "stop", UNIT)  # times out too; TP3 survives
            gpubox.box.wait_for(
                f"{UNIT} stopped",
                lambda: gpubox.show(UNIT, "ActiveState") in {"inactive", "failed"},
                timeout=30,
            )
            time.sleep(WATCH_S)

            state = gpubox.show(UNIT, "ActiveState")
            timeouts = [m for m in pid1_messages(gpubox, restarted - 1) if "timed out" in m]
            starts = pid1_messages(gpubox, stopped, STARTING) + pid1_messages(
                gpubox, stopped, STARTED
            )
            events = gpubox.daemon_log(restarted - 1)
            snapshot = gpubox.status_json()["daemon"]["snapshot"]["units"][UNIT]
            tp3_alive = alive(gpubox, tp3)
        finally:
            gpubox.kill_server()

    assert len(timeouts) >= 2, timeouts  # both stops timed out, as in the attack
    assert state in {"inactive", "failed"}, state
    assert starts == [], starts
    assert daemon_events(events, "recovery finished") == []
    recover = [e for e in daemon_events(events, "restart loop") if e.get("action") == "recover"]
    assert recover == [], recover
    assert not snapshot["looping"], snapshot["verdict"]
    assert "stopped by a stop job" in snapshot["verdict"], snapshot["verdict"]
    assert tp3_alive  # not reaped: nothing of the unit is acted on while it is stopped
