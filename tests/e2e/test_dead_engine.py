"""Issue 25 on real systemd: an engine that dies while its unit lives, seen and (opted in) cured.

gpuguard.service (as shipped) watches the fake SGLang (tests/e2e/fakesglang). Three seconds after
it is ready, its TP0 scheduler "hits an exception" and dies while the main process lives on:
systemd still says `active (running)`. With `on_engine_dead = "recover"` the daemon must say so
within its grace (10 s) plus 2 s of the line, then stop, reap, and start the unit again, with no
failed start. In the second scenario the main process then exits with status 0 under
`Restart=on-failure`: systemd calls it a success and restarts nothing; the daemon, left at its
default (`report`), must call it a dead engine in `status` and touch nothing; opted in, it must
start the unit again itself, to a healthy run with no failed start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.container import Container
from e2e.gpubox import CONFIG, UNIT, GpuBox, install
from e2e.scenario import SERVING_MIB, recovered_to_a_new_run

if TYPE_CHECKING:
    from pathlib import Path

    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

DEATH_LINE = "Scheduler hit an exception"
#: The engine dies 3 s after ready, once (the run after a recovery stays up).
DEATH = (
    "[Service]\n"
    "Environment=FAKE_SGLANG_ENGINE_DEATH_S=3 FAKE_SGLANG_DEATH_MARKER=/run/fake-engine-died\n"
)
#: ... and the server then exits 0, under a restart policy that only restarts failures.
EXIT_0 = DEATH + "Environment=FAKE_SGLANG_EXIT_0_AFTER_DEATH=1\nRestart=on-failure\n"
GRACE_S = 10.0


def death_at(gpubox: GpuBox, since_s: float) -> float:
    """When the unit's output said its scheduler died (the journal's wall clock)."""
    return gpubox.unit_line_at(DEATH_LINE, since_s=since_s, what="the engine's death line")


def test_a_dead_engine_in_a_live_unit_is_recovered_when_the_unit_opted_in(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """Detected within the grace + 2 s, recovered to a healthy run, no failed start."""
    config = CONFIG + 'on_engine_dead = "recover"\n'
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted, config=config))
        gpubox.start_daemon()
        gpubox.drop_in(UNIT, "e2e-death.conf", DEATH)
        began = time.time()
        serving = gpubox.start_server()
        try:
            died = death_at(gpubox, began)
            assert gpubox.show(UNIT, "ActiveState") == "active"  # systemd sees nothing
            seen, dead = gpubox.wait_daemon_said(died - 1, "engine dead", timeout=60)
            recovered_to_a_new_run(gpubox, died, serving)
            detection_s = seen - died
            print(f"\ndead engine seen {detection_s:.1f} s after its line")  # noqa: T201
            assert dead["invocation_id"] == serving
            assert dead["cause"] == "SGLang scheduler exception"
            assert dead["action"] == "recover"
            assert detection_s <= GRACE_S + 2.0, detection_s
            assert gpubox.allocated() == [SERVING_MIB] * 4
            status = gpubox.gpuguard("status")
            assert "engine dead" not in status.stdout, status.stdout
        finally:
            gpubox.kill_server()


def test_an_exit_0_after_engine_death_is_reported_and_left_alone_by_default(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """Restart=on-failure, Result=success: status CRITICAL names it; the unit stays stopped."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted))
        gpubox.start_daemon()
        gpubox.drop_in(UNIT, "e2e-exit0.conf", EXIT_0)
        began = time.time()
        serving = gpubox.start_server()
        try:
            died = death_at(gpubox, began)
            _, dead = gpubox.wait_daemon_said(died - 1, "engine dead", timeout=60)
            assert dead["invocation_id"] == serving
            assert dead["action"] == "report"
            gpubox.box.wait_for(
                "the unit inactive", lambda: gpubox.show(UNIT, "ActiveState") == "inactive"
            )
            assert gpubox.show(UNIT, "Result") == "success"
            time.sleep(GRACE_S + 2.0)  # past the grace: a recovery would have begun
            status = gpubox.gpuguard("status")
            assert status.returncode == 2, status.stdout
            assert "engine dead since" in status.stdout
            assert "no stop job asked for it" in status.stdout
            assert not gpubox.daemon_said(began, "recovery finished")
            assert gpubox.show(UNIT, "ActiveState") == "inactive"
            assert gpubox.show(UNIT, "NRestarts") == "0"
        finally:
            gpubox.kill_server()


def test_an_exit_0_after_engine_death_is_started_again_when_the_unit_opted_in(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """Restart=on-failure restarts nothing after the exit 0; the opted-in daemon starts it again."""
    config = CONFIG + 'on_engine_dead = "recover"\n'
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = GpuBox(booted, install_s=install(booted, config=config))
        gpubox.start_daemon()
        gpubox.drop_in(UNIT, "e2e-exit0.conf", EXIT_0)
        began = time.time()
        serving = gpubox.start_server()
        try:
            died = death_at(gpubox, began)
            _, dead = gpubox.wait_daemon_said(died - 1, "engine dead", timeout=60)
            assert dead["invocation_id"] == serving
            assert dead["action"] == "recover"
            recovered_to_a_new_run(gpubox, died, serving)
            assert gpubox.show(UNIT, "ActiveState") == "active"
            assert gpubox.show(UNIT, "NRestarts") == "0"  # systemd itself restarted nothing
            assert gpubox.allocated() == [SERVING_MIB] * 4
        finally:
            gpubox.kill_server()
