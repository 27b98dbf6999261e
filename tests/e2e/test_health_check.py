"""Issue 25 on real systemd: an engine that dies without a line, seen by its health check.

gpuguard.service (as shipped, plus the shipped health-loopback.conf drop-in) watches the fake
SGLang (tests/e2e/fakesglang) with `health_url = "http://127.0.0.1:30000/health"`, probed every
2 s, 3 failures in a row. Three seconds after it is ready, its TP0 scheduler dies *silently*: no
fatal line, the unit `active (running)`, only `/health` answers 503. The daemon must call the
engine dead within every_s x failures + 2 s of the death: in `status` (CRITICAL, naming the
check) when the unit is left at the default, and with `on_engine_dead = "recover"` recovered to
a healthy run with no failed start. Under the shipped sandbox alone the check cannot be made: the
daemon says so, never calls the engine dead, and `doctor` names the drop-in.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from e2e.container import Container
from e2e.gpubox import CHECKOUT, CONFIG, DAEMON, UNIT, GpuBox, install
from e2e.scenario import SERVING_MIB, failed_starts, recovered_to_a_new_run

if TYPE_CHECKING:
    from pathlib import Path

    from e2e.gpubox import Artifacts

pytestmark = pytest.mark.slow

EVERY_S = 2.0
FAILURES = 3
HEALTH = (
    'health_url = "http://127.0.0.1:30000/health"\n'
    f"health_every_s = {EVERY_S}\nhealth_timeout_s = 1.0\nhealth_failures = {FAILURES}\n"
)
SILENT_LINE = "[fake] engine died silently"
#: The engine dies 3 s after ready, without a line, once (the run after a recovery stays up).
SILENT_DEATH = (
    "[Service]\n"
    "Environment=FAKE_SGLANG_ENGINE_DEATH_S=3 FAKE_SGLANG_SILENT_DEATH=1 "
    "FAKE_SGLANG_DEATH_MARKER=/run/fake-engine-died\n"
)
DROP_IN = CHECKOUT / "systemd" / "health-loopback.conf"
CAUSE = f"health check failed {FAILURES} times: HTTP 503"


def silent_death_at(gpubox: GpuBox, since_s: float) -> float:
    """When the fake said (for the test only) that its engine died without a line."""
    return gpubox.unit_line_at(SILENT_LINE, since_s=since_s, what="the engine's silent death")


def booted_with_health(booted: Container, config: str, *, drop_in: bool = True) -> GpuBox:
    """The box with ``config``, its daemon started (with the loopback drop-in by default)."""
    gpubox = GpuBox(booted, install_s=install(booted, config=config))
    if drop_in:
        booted.write_file(
            f"/etc/systemd/system/{DAEMON}.d/health-loopback.conf", DROP_IN.read_text()
        )
    gpubox.start_daemon()
    gpubox.drop_in(UNIT, "e2e-silent-death.conf", SILENT_DEATH)
    return gpubox


def test_a_silent_death_is_reported_by_its_health_check(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """No fatal line, unit active: status CRITICAL names the check within every x failures + 2 s."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = booted_with_health(booted, CONFIG + HEALTH)
        began = time.time()
        serving = gpubox.start_server()
        try:
            died = silent_death_at(gpubox, began)
            seen, dead = gpubox.wait_daemon_said(died - 1, "engine dead", timeout=60)
            detection_s = seen - died
            print(f"\nsilent death seen by the health check {detection_s:.1f} s after it")  # noqa: T201
            assert (dead["invocation_id"], dead["cause"]) == (serving, CAUSE)
            assert dead["action"] == "report"
            assert detection_s <= EVERY_S * FAILURES + 2.0, detection_s
            status = gpubox.gpuguard("status")
            assert status.returncode == 2, status.stdout
            assert f"({CAUSE}); unit still active" in status.stdout, status.stdout
            assert gpubox.show(UNIT, "ActiveState") == "active"
            assert not gpubox.daemon_said(began, "recovery finished")
        finally:
            gpubox.kill_server()


def test_a_silent_death_is_recovered_when_the_unit_opted_in(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """Opted in: a healthy run again, its health check passing, and no failed start."""
    config = CONFIG + HEALTH + 'on_engine_dead = "recover"\n'
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = booted_with_health(booted, config)
        began = time.time()
        serving = gpubox.start_server()
        try:
            died = silent_death_at(gpubox, began)
            seen, dead = gpubox.wait_daemon_said(died - 1, "engine dead", timeout=60)
            recovered_to_a_new_run(gpubox, died, serving)
            print(f"\nsilent death seen {seen - died:.1f} s after it, recovered")  # noqa: T201
            assert (dead["invocation_id"], dead["cause"]) == (serving, CAUSE)
            assert seen - died <= EVERY_S * FAILURES + 2.0
            time.sleep(EVERY_S * FAILURES + 1.0)  # probes of the new run: all healthy
            assert len(gpubox.daemon_said(began, "engine dead")) == 1
            assert failed_starts(gpubox, died) == []  # nor did any since, with the new run probed
            assert gpubox.allocated() == [SERVING_MIB] * 4
            status = gpubox.gpuguard("status")
            assert "engine dead" not in status.stdout, status.stdout
        finally:
            gpubox.kill_server()


def test_under_the_shipped_sandbox_the_check_is_skipped_and_doctor_names_the_drop_in(
    rootfs: Path, e2e_artifacts: Artifacts
) -> None:
    """No drop-in: the daemon cannot make the socket, says so, and never calls the engine dead."""
    with Container(rootfs, binds=e2e_artifacts.binds()) as booted:
        gpubox = booted_with_health(booted, CONFIG + HEALTH, drop_in=False)
        began = time.time()
        gpubox.start_server()
        try:
            died = silent_death_at(gpubox, began)
            _, cannot = gpubox.wait_daemon_said(began, "health check cannot run", timeout=30)
            assert "cannot make the socket" in cannot["reason"]
            time.sleep(EVERY_S * FAILURES + 2.0)  # past the time a counted check would take
            assert gpubox.daemon_said(died - 1, "engine dead") == []
            doctor = gpubox.gpuguard("doctor")
            assert "health_url http://127.0.0.1:30000/health is TCP" in doctor.stdout
            assert "/usr/share/gpuguard/health-loopback.conf" in doctor.stdout, doctor.stdout
        finally:
            gpubox.kill_server()
