"""Scenarios (d), (h) and (f) of issue 6 on a real systemd (tests/e2e/gpubox.py, docs/e2e.md).

* (d) a GPU of the watched unit's set is held by a protected process (DCGM's `nv-hostengine`,
  its own transient unit): the gate never signals it, refuses the start after
  `gate_timeout_s`, names the blocker in the journal and in `gpuguard status` (exit 2). The
  same holder on a GPU outside the unit's set (`gpus = [0, 1, 2]`) does not block the start.
* (h) the Debian package: installed with apt, the daemon reaches READY, and the documented
  `gpuguard install-gate` / `gpuguard remove-gate` change the unit's ExecStartPre=.
* (f) the daemon SIGKILLed mid-recovery: systemd restarts it (Restart=always), it resumes the
  interrupted recovery, the unit serves again, and a bystander outside the unit's set survives.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.gpubox import CONFIG, DAEMON, STATE, UNIT, daemon_events
from e2e.measure import Timeline
from e2e.scenario import FAILURE_RESULT, SERVING_MIB, alive, incident, pid1_messages

if TYPE_CHECKING:
    from e2e.conftest import ContainerFactory
    from e2e.container import Container
    from e2e.gpubox import GpuBox

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HOLDER_MIB = 1000
GATE_TIMEOUT_S = 5.0


def _config(*, gpus: str | None = None) -> str:
    """The e2e configuration with a short gate timeout and, optionally, the unit's GPU set."""
    text = CONFIG.replace("gate_timeout_s = 60.0", f"gate_timeout_s = {GATE_TIMEOUT_S}")
    assert text != CONFIG, "CONFIG no longer sets gate_timeout_s = 60.0"
    if gpus is not None:
        text += f"gpus = {gpus}\n"
    return text


def _start_holder(gpubox: GpuBox, unit: str, gpu: int, name: str) -> int:
    """gpu_hold.py as its own transient unit `unit`, named `name`, on `gpu`; its PID."""
    before = gpubox.allocated_mib(gpu)
    gpubox.box.run(
        [
            "systemd-run", f"--unit={unit}", f"--setenv=FAKENVML_STATE={STATE}",
            "/usr/local/bin/gpu_hold.py", "--state", STATE, "--gpus", str(gpu),
            "--mib", str(HOLDER_MIB), "--name", name,
        ]
    )  # fmt: skip
    gpubox.box.wait_for(
        f"{name} holding GPU {gpu}",
        lambda: gpubox.allocated_mib(gpu) == before + HOLDER_MIB,
        timeout=15,
    )
    pid = int(gpubox.show(f"{unit}.service", "MainPID"))
    assert pid > 0
    comm = gpubox.box.run(["cat", f"/proc/{pid}/comm"]).stdout.strip()
    assert comm == name[:15], comm
    return pid


def _unit_output(gpubox: GpuBox, since_s: float) -> list[str]:
    """What sglang.service's processes (the gate included) wrote to the journal."""
    entries = gpubox.box.journal([f"_SYSTEMD_UNIT={UNIT}", f"--since=@{int(since_s)}"])
    return [str(e.get("MESSAGE")) for e in entries]


def _never_served(gpubox: GpuBox, since_s: float) -> bool:
    """No run of the server got as far as serving since `since_s`."""
    return not any("fired up" in line for line in _unit_output(gpubox, since_s))


# --- (d) a protected process holds a GPU ------------------------------------------------------


def test_d_protected_holder_in_the_set_blocks_the_start_and_is_named(gpubox: GpuBox) -> None:
    """nv-hostengine on GPU 2 (in the set): never signalled; the start is refused, explained."""
    gpubox.box.write_file("/etc/gpuguard/gpuguard.toml", _config())
    holder = _start_holder(gpubox, "dcgm-test", 2, "nv-hostengine")
    gpubox.install_gate()
    t0 = time.time()
    done = gpubox.systemctl("start", UNIT, check=False)
    assert done.returncode != 0, "the start must fail: GPU 2 is held by a protected process"
    refused = [line for line in _unit_output(gpubox, t0 - 1) if line.startswith("gpuguard gate:")]
    assert refused, _unit_output(gpubox, t0 - 1)
    line = refused[0]
    assert "Start refused" in line, line
    assert f"PID {holder}" in line, line
    assert "protected process" in line, line
    assert "nv-hostengine" in line, line
    assert pid1_messages(gpubox, t0 - 1, FAILURE_RESULT), "systemd logged no failed start"
    assert _never_served(gpubox, t0 - 1)
    assert alive(gpubox, holder)
    assert gpubox.show("dcgm-test.service", "ActiveState") == "active"
    assert gpubox.allocated() == [0, 0, HOLDER_MIB, 0]
    status = gpubox.gpuguard("status")
    assert status.returncode == 2, status.stdout + status.stderr
    assert "the gate refused the last start of sglang.service" in status.stdout, status.stdout
    assert f"PID {holder} (nv-hostengine" in status.stdout, status.stdout
    [unit] = gpubox.status_json()["units"]
    last = unit["gate_decisions"][-1]
    assert last["result"] == "refused"
    assert last["reaped"] == []
    assert last["waited_s"] >= GATE_TIMEOUT_S


def test_d_protected_holder_outside_the_set_does_not_block(gpubox: GpuBox) -> None:
    """Gpus = [0, 1, 2] and nv-hostengine on GPU 3: the gate passes, the holder is untouched."""
    gpubox.box.write_file("/etc/gpuguard/gpuguard.toml", _config(gpus="[0, 1, 2]"))
    holder = _start_holder(gpubox, "dcgm-test", 3, "nv-hostengine")
    gpubox.install_gate()
    t0 = time.time()
    gpubox.start_server(timeout=30)
    passed = [line for line in _unit_output(gpubox, t0 - 1) if line.startswith("gpuguard gate:")]
    assert passed, _unit_output(gpubox, t0 - 1)
    assert "start allowed" in passed[0], passed[0]
    assert alive(gpubox, holder)
    assert gpubox.show("dcgm-test.service", "ActiveState") == "active"
    assert gpubox.show(UNIT, "ActiveState") == "active"
    # the server uses all four GPUs of CUDA_VISIBLE_DEVICES; the holder's MiB stay on GPU 3
    assert gpubox.allocated() == [SERVING_MIB] * 3 + [SERVING_MIB + HOLDER_MIB]
    [unit] = gpubox.status_json()["units"]
    last = unit["gate_decisions"][-1]
    assert last["result"] == "passed"
    assert last["reaped"] == []
    status = gpubox.gpuguard("status")
    assert "refused" not in status.stdout, status.stdout


# --- (h) the Debian package -------------------------------------------------------------------

REQUIRE_ENV = "GPUGUARD_REQUIRE_DEB"
TRIVIAL_UNIT = """\
[Unit]
Description=stand-in for an SGLang server (gpuguard e2e)

[Service]
ExecStart=/bin/sleep infinity
"""


def _built_package() -> Path:
    """The newest .deb, one for every release (as test_package.py finds it); skip or fail."""
    base = Path(os.environ.get("GPUGUARD_DEB_DIR") or ROOT / "dist")
    found = sorted(base.glob("gpuguard_*.deb"))
    if not found:
        message = "no gpuguard .deb in dist: run `packaging/build-deb` (make deb)"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(message)
        pytest.skip(message)
    return found[-1]


def _exec_start_pre(box: Container) -> str:
    return box.systemctl("show", "-p", "ExecStartPre", UNIT).stdout.strip()


def test_h_package_installs_ready_and_documented_gate_commands_work(
    container: ContainerFactory,
) -> None:
    """Apt install ./gpuguard_*.deb; READY; install-gate / remove-gate as docs say."""
    from e2e.container import Bind  # noqa: PLC0415 - only this test binds a host directory

    deb = _built_package()
    box = container(binds=[Bind(deb.parent, "/debs")])
    box.run(
        ["sh", "-c", 'cd /debs && exec apt -y install "./$1"', "apt", deb.name],
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=300,
    )
    box.wait_for(
        "gpuguard.service active (READY=1)",
        lambda: box.systemctl("is-active", DAEMON, check=False).stdout.strip() == "active",
        timeout=60,
    )
    assert box.systemctl("show", "-P", "Type", DAEMON).stdout.strip() == "notify"
    box.write_file(f"/etc/systemd/system/{UNIT}", TRIVIAL_UNIT)
    box.systemctl("daemon-reload")
    assert "gpuguard" not in _exec_start_pre(box)
    done = box.run(["gpuguard", "install-gate", "--unit", UNIT], check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "remove-gate --unit sglang.service" in done.stdout, done.stdout
    shown = _exec_start_pre(box)
    assert "gpuguard gate" in shown or ("gpuguard" in shown and "gate" in shown), shown
    dropin = box.read_file(f"/etc/systemd/system/{UNIT}.d/gpuguard-gate.conf")
    assert "ExecStartPre=" in dropin
    again = box.run(["gpuguard", "install-gate", "--unit", UNIT], check=False)
    assert again.returncode == 0, again.stdout + again.stderr  # idempotent
    done = box.run(["gpuguard", "remove-gate", "--unit", UNIT], check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpuguard" not in _exec_start_pre(box)
    gone = box.run(["test", "-e", f"/etc/systemd/system/{UNIT}.d/gpuguard-gate.conf"], check=False)
    assert gone.returncode != 0
    assert box.systemctl("is-active", DAEMON, check=False).stdout.strip() == "active"


# --- (f) the daemon SIGKILLed mid-recovery ---------------------------------------------------


FIVE_GPUS = f"""\
cd /e2e/fakenvml
python3 -c 'import sys; from pathlib import Path; from fakestate import FakeGpu, write_state
write_state(Path(sys.argv[1]), [FakeGpu(release_delay_ms=500)] * 5)' {STATE}
"""
RESUMED = "resuming interrupted recovery"


def _swept(events: list[dict[str, object]]) -> list[dict[str, object]]:
    """The daemon's sweeps that signalled survivors of an ended run."""
    return [e for e in daemon_events(events, "survivors of an ended run") if e.get("pids")]


def test_f_daemon_killed_mid_recovery_resumes_and_spares_bystanders(gpubox: GpuBox) -> None:
    """SIGKILL the daemon once it acts: systemd restarts it, it finishes, bystanders live.

    It acts either by a recovery (the first failed start, scenario (c)) or, when it wins the
    race with the restart, by sweeping the ended run's survivors (scenario (i)); whichever it
    is, the daemon is killed in the middle of it. An interrupted recovery must be resumed.
    """
    # A fifth fake GPU, outside the unit's set (CUDA_VISIBLE_DEVICES=0,1,2,3), for a bystander
    # that even looks like an SGLang worker: only its GPU keeps it out of the plan.
    gpubox.box.run(["sh", "-c", FIVE_GPUS])
    bystander = _start_holder(gpubox, "bystander", 4, "sglang::scheduler_TP9")
    gpubox.start_daemon()
    t0, _serving, tp3 = incident(gpubox, Timeline(time.time()))

    def acting() -> bool:
        events = gpubox.daemon_log(t0)
        return bool(daemon_events(events, "recovery: stopping unit") or _swept(events))

    gpubox.box.wait_for("the daemon acting (recovery or sweep)", acting, timeout=40)
    killed_pid = int(gpubox.show(DAEMON, "MainPID"))
    gpubox.kill_unit(DAEMON)
    before_kill = gpubox.daemon_log(t0)
    gpubox.box.wait_for(
        "gpuguard.service restarted",
        lambda: (
            int(gpubox.show(DAEMON, "MainPID") or 0) not in {0, killed_pid}
            and gpubox.show(DAEMON, "ActiveState") == "active"
        ),
        timeout=30,
    )
    gpubox.wait_fired_up(after_s=t0, timeout=60)
    if daemon_events(before_kill, "recovery: stopping unit"):
        gpubox.box.wait_for(
            "the recovery finished",
            lambda: bool(daemon_events(gpubox.daemon_log(t0), "recovery finished")),
            timeout=20,
        )
    events = gpubox.daemon_log(t0)
    finished = daemon_events(events, "recovery finished")
    if daemon_events(before_kill, "recovery: stopping unit") and not daemon_events(
        before_kill, "recovery finished"
    ):
        # killed mid-recovery: the new daemon must say it resumes the interrupted recovery
        assert any(RESUMED in str(e.get("event")) for e in events), events
    if finished:
        assert finished[-1]["result"] == "restarted", finished
    else:
        assert _swept(events), events
    assert not alive(gpubox, tp3)
    assert gpubox.allocated() == [SERVING_MIB] * 4
    assert alive(gpubox, bystander)
    assert gpubox.allocated_mib(4) == HOLDER_MIB
    signalled = {e.get("pid") for e in daemon_events(events, "signal")}
    # The ended run's workers in its cgroup are the plan's too: systemd SIGKILLs them at the stop
    # timeout, and a sweep that looked a moment before they were gone signals them as well.
    ended_run = {
        int(word)
        for message in pid1_messages(gpubox, t0)
        if message.startswith(f"{UNIT}: Killing process ")
        and (word := message.split()[3]).isdigit()
    }
    assert signalled <= {tp3} | ended_run, f"signalled outside the plan: {signalled - {tp3}}"
