"""`gpuguard gate` and `gpuguard reap` with real processes, real cgroups and the fake NVML."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import snapshots
from clirunner import ENDED, gate_in_unit, unit_name
from fakeholder import process_gone
from fakestate import allocated_mib, update_gpu

if TYPE_CHECKING:
    from clirunner import Cli, FakeSystemd, Openers, UnitCgroups
    from fakeholder import HolderSpawner
    from hostile import HostileProcesses


def idle_everywhere(cli: Cli) -> bool:
    """Every fake GPU has no allocation left."""
    return all(allocated_mib(cli.state, minor) == 0 for minor in range(4))


def test_incident_is_reaped_and_the_next_start_succeeds(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups, opener: Openers
) -> None:
    """A SIGKILLed server's surviving TP workers are reaped; nothing else; the next start fits."""
    unit = unit_name()
    for gpu in range(4):
        update_gpu(cli.state, gpu, release_delay_ms=1000)
    server = spawn_holder(
        cli.state,
        gpus=(0, 1, 2, 3),
        mib=20000,
        children=4,
        name="python3 -m sglang.launch_server",
        child_name="sglang::scheduler_TP{i}",
        ignore_sigterm=True,
    )
    for pid in (server.pid, *server.children):
        unit_cgroups.move(pid, unit)
    # Like the real ones, these open the device files but have no CUDA context (no memory).
    persistenced = opener(cli.state, "nvidia-persistenced", 0, 1, 2, 3)
    bystander = opener(cli.state, "gpu-exporter", 0)
    server.kill()  # systemd's SIGKILL after TimeoutStopSec; the workers survive
    server.wait()
    assert not any(process_gone(pid) for pid in server.children)
    assert allocated_mib(cli.state, 0) == 20000

    started = time.monotonic()
    result = gate_in_unit(cli, unit_cgroups, unit, "--grace", "1", "--timeout", "30")
    took = time.monotonic() - started

    assert result.code == 0, result.err
    assert all(process_gone(pid) for pid in server.children)
    assert not process_gone(persistenced)
    assert not process_gone(bystander)
    assert idle_everywhere(cli)
    assert took >= 1.0  # SIGTERM ignored: the grace, then the driver's release delay
    assert "4 stale holder(s) reaped: start allowed" in result.err
    for child in server.children:
        assert f"pid={child}" in result.err
    decision = json.loads((cli.config.parent / "run" / "gate" / f"{unit}.json").read_text())[-1]
    assert decision["result"] == "passed"
    assert sorted(r["pid"] for r in decision["reaped"]) == sorted(server.children)
    assert {r["outcome"] for r in decision["reaped"]} == {"killed"}
    # NVML lists the killed server's PID, not the workers': no positive evidence, no timing.
    assert decision["released"] == []

    successor = spawn_holder(cli.state, gpus=(0, 1, 2, 3), mib=20000, name="sglang next run")
    assert allocated_mib(cli.state, 0) == 20000
    assert not process_gone(successor.pid)
    status = cli("status", "--json").json()
    gates = next(u for u in status["units"] if u["name"] == "sglang.service")
    assert gates is not None


def test_the_gate_times_the_drivers_release_of_what_it_reaped(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """A stale holder NVML lists on GPUs 0 and 1: each GPU's release, from its SIGTERM, recorded.

    In the gate's decision and in the release log, the same seconds.
    """
    unit = unit_name()
    for gpu in (0, 1):
        update_gpu(cli.state, gpu, release_delay_ms=1200)
    holder = spawn_holder(cli.state, gpus=(0, 1), mib=20000, name="sglang::scheduler_TP0")
    unit_cgroups.move(holder.pid, unit)

    started = time.monotonic()
    result = gate_in_unit(cli, unit_cgroups, unit, "--grace", "5", "--timeout", "30")
    took = time.monotonic() - started

    assert result.code == 0, result.err
    decision = json.loads((cli.config.parent / "run" / "gate" / f"{unit}.json").read_text())[-1]
    assert [r["outcome"] for r in decision["reaped"]] == ["exited"]
    released = {r["gpu"]: r for r in decision["released"]}
    assert sorted(released) == [0, 1]
    for record in released.values():
        assert 1.2 <= record["seconds"] < took, record
        assert record["model"] == "NVIDIA H200"
        assert record["uuid"].startswith("GPU-")
    logged = json.loads((cli.config.parent / "run" / "releases.json").read_text())
    assert {(r["by"], r["unit"], r["gpu"], r["seconds"]) for r in logged} == {
        ("gate", unit, gpu, record["seconds"]) for gpu, record in released.items()
    }


def test_fast_path_when_idle(cli: Cli, unit_cgroups: UnitCgroups) -> None:
    """Idle GPUs: the gate exits 0 at once and records a fast-path decision."""
    unit = unit_name()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        unit_cgroups.move(sleeper.pid, unit)
        result = gate_in_unit(cli, unit_cgroups, unit)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert result.code == 0, result.err
    assert "idle: start allowed" in result.err
    decision = json.loads((cli.config.parent / "run" / "gate" / f"{unit}.json").read_text())[-1]
    assert decision["fast_path"] is True


def test_second_run_takes_the_light_fast_path(cli: Cli, unit_cgroups: UnitCgroups) -> None:
    """Once the config is cached, an idle gate never imports pydantic or structlog."""
    unit = unit_name()
    assert gate_in_unit(cli, unit_cgroups, unit).code == 0  # full load fills the cache
    cli.env["PYTHONPROFILEIMPORTTIME"] = "1"
    try:
        result = gate_in_unit(cli, unit_cgroups, unit)
    finally:
        del cli.env["PYTHONPROFILEIMPORTTIME"]
    assert result.code == 0, result.err
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.err.splitlines() if "|" in line}
    assert "gpuguard.adapters.nvml" in imported
    assert "pydantic" not in imported
    assert "structlog" not in imported
    assert "gpuguard.adapters.procfs" in imported  # only to learn its own cgroup; no /proc walk
    decision = json.loads((cli.config.parent / "run" / "gate" / f"{unit}.json").read_text())[-1]
    assert decision["fast_path"] is True


def test_protected_and_foreign_holders_make_the_gate_time_out(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """A protected process and another unit's job on our GPUs are left alone and named."""
    unit = unit_name()
    other = unit_name().replace("sglang", "training")
    dcgm = spawn_holder(cli.state, gpus=(1,), mib=500, name="nv-hostengine")
    job = spawn_holder(cli.state, gpus=(2,), mib=8000, name="python3 train.py")
    unit_cgroups.move(job.pid, other)
    unit_cgroups.move(dcgm.pid, unit_name().replace("sglang", "nvidia-dcgm"))
    started = time.monotonic()
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "2", "--grace", "0.5")
    assert time.monotonic() - started < 20
    assert result.code == 1
    assert not process_gone(dcgm.pid)
    assert not process_gone(job.pid)
    message = result.err.strip().splitlines()[-1]
    assert message.startswith(f"gpuguard gate: GPUs of {unit} still busy after")
    assert f"PID {dcgm.pid} (nv-hostengine" in message
    assert "protected process" in message
    assert f"PID {job.pid}" in message
    assert f"belongs to {other}" in message
    assert "Start refused" in message


def test_other_units_gpus_do_not_block(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """A second server's live use of GPUs outside our set neither blocks us nor is touched."""
    unit = unit_name()
    neighbour = spawn_holder(cli.state, gpus=(2, 3), mib=30000, name="python3 -m sglang b")
    unit_cgroups.move(neighbour.pid, unit_name())
    cli.configure(f'[units."{unit}"]\ngpus = [0, 1]\n')
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "5")
    assert result.code == 0, result.err
    assert "GPUs 0,1 (from config)" in result.err
    assert not process_gone(neighbour.pid)


def test_cuda_visible_devices_of_the_unit_sets_the_gpus(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """Without config, the unit's CUDA_VISIBLE_DEVICES (inherited by the gate) is its set."""
    unit = unit_name()
    neighbour = spawn_holder(cli.state, gpus=(0,), mib=1000, name="python3 -m sglang a")
    unit_cgroups.move(neighbour.pid, unit_name())
    cli.env["CUDA_VISIBLE_DEVICES"] = "2,3"
    try:
        result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "5")
    finally:
        del cli.env["CUDA_VISIBLE_DEVICES"]
    assert result.code == 0, result.err
    assert "GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3)" in result.err
    assert not process_gone(neighbour.pid)


def test_orphaned_worker_outside_the_cgroup_is_reaped(
    cli: Cli,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    fake_systemd: FakeSystemd,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker of an ended run, reparented outside any unit, is reaped by the next gate.

    Its INVOCATION_ID names a run PID 1 logged for the unit and it runs as the unit's user.
    """
    unit = unit_name()
    fake_systemd(unit, state="activating")  # as seen from the gate, its ExecStartPre=
    monkeypatch.setenv("INVOCATION_ID", ENDED)
    server = spawn_holder(
        cli.state, gpus=(0,), mib=4000, children=1, leave_child=True, name="sglang::scheduler"
    )
    monkeypatch.delenv("INVOCATION_ID")
    server.terminate()  # the parent exits, leaving the child behind (reparented)
    server.wait()
    orphan = server.children[0]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _ppid(orphan) != 1:
        time.sleep(0.05)
    if _ppid(orphan) != 1:
        pytest.skip("orphans are not reparented to PID 1 here (a subreaper is in the way)")
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "10", "--grace", "0.5")
    assert result.code == 0, result.err
    assert process_gone(orphan)
    assert f"left over from an earlier run of {unit} (invocation {ENDED[:12]}" in result.err


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_reap_dry_run_signals_nothing(
    cli: Cli, spawn_holder: HolderSpawner, fake_systemd: FakeSystemd
) -> None:
    """`reap --dry-run` prints the plan and leaves every process alive."""
    fake_systemd(unit_name())  # its User= (root): --scope patterns reaps only the unit's uid
    holder = spawn_holder(cli.state, gpus=(0,), mib=1000, name="sglang::scheduler_TP0")
    result = cli("reap", "--dry-run", "--scope", "patterns")
    assert result.code == 0, result.err
    assert f"reap  pid {holder.pid}" in result.out
    assert "scope patterns: matches 'sglang'" in result.out
    assert not process_gone(holder.pid)
    assert "signal" not in result.err


def test_reap_json_and_clean_final_lines(
    cli: Cli, spawn_holder: HolderSpawner, opener: Openers, fake_systemd: FakeSystemd
) -> None:
    """`reap --yes --json` acts, waits for idle and reports each GPU's memory."""
    fake_systemd(unit_name())  # its User= (root): --scope patterns reaps only the unit's uid
    holder = spawn_holder(cli.state, gpus=(1,), mib=1000, name="sglang::scheduler_TP1")
    keep = opener(cli.state, "nvidia-smi", 1)
    doc = cli("reap", "--scope", "patterns", "--yes", "--json", "--grace", "1").json()
    assert doc["idle"] is True
    assert [r["pid"] for r in doc["results"]] == [holder.pid]
    assert doc["results"][0]["outcome"] == "exited"
    spared = next(p for p in doc["plan"] if p["pid"] == keep)
    assert spared["verdict"] == "refuse"
    assert [g["used_mib"] for g in doc["gpus"]] == [0, 0, 0, 0]
    assert not process_gone(keep)


def test_reap_without_terminal_or_yes_does_nothing(
    cli: Cli, spawn_holder: HolderSpawner, fake_systemd: FakeSystemd
) -> None:
    """Without a terminal to ask on and without --yes, nothing is signalled."""
    fake_systemd(unit_name())  # its User= (root): the plan would reap the holder
    holder = spawn_holder(cli.state, gpus=(0,), mib=1000, name="sglang::scheduler_TP0")
    result = cli("reap", "--scope", "patterns")
    assert result.code == 1
    assert "nothing signalled" in result.err
    assert not process_gone(holder.pid)
    lines = result.out.splitlines()
    assert all(len(line) < 200 for line in lines)


def test_unkillable_holder_fails_clearly_without_hanging(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups, frozen_group: Path
) -> None:
    """A holder stuck in D state ends the gate with a clear failure, not a hang."""
    unit = unit_name()
    stuck = spawn_holder(cli.state, gpus=(3,), mib=5000, name="python3 -m sglang.launch_server")
    unit_cgroups.move(stuck.pid, unit)
    (frozen_group / "cgroup.procs").write_text(str(stuck.pid))
    (frozen_group / "freezer.state").write_text("FROZEN")
    started = time.monotonic()
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "3", "--grace", "0.5")
    assert time.monotonic() - started < 30
    assert result.code == 1
    assert "unkillable" in result.err
    assert "state D" in result.err
    assert f"PID {stuck.pid}" in result.err.strip().splitlines()[-1]


def test_gate_verdict_stays_one_line_whatever_holders_are_called(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """A holder's name and cgroup are escaped in the verdict: one journal line, no forged one."""
    unit = unit_name()
    job = spawn_holder(cli.state, gpus=(0,), mib=1000, name="x\nOK: start ok")
    tag = os.getpid()  # the cgroup is this run's alone when several suites run at once
    unit_cgroups.move(job.pid, f"gg-{tag}\x1b]0;pwn\x07\u202e.service")
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "1")
    assert result.code == 1
    assert [ch for ch in result.err if not ch.isprintable() and ch != "\n"] == []
    verdict = [line for line in result.err.splitlines() if line.startswith("gpuguard gate:")]
    assert len(verdict) == 1
    assert not any(line.startswith("OK") for line in result.err.splitlines())
    escaped = f"gg-{tag}\\x1b]0;pwn\\x07\\u202e.service"
    assert f"PID {job.pid} (x\\nOK: start ok, {escaped})" in verdict[0]


def test_gate_timeout_holds_against_hostile_command_lines(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups, hostile: HostileProcesses
) -> None:
    """1.75 MiB of `-a=-a=…` and `…://` arguments on a busy GPU: refused on time, no traceback.

    Such arguments once crashed the gate (RecursionError: every start refused) or kept a gate
    with --timeout 3 busy for 136 s.
    """
    unit = unit_name()
    job = spawn_holder(cli.state, gpus=(0,), mib=1000, name="python3 train.py")
    unit_cgroups.move(job.pid, unit_name().replace("sglang", "training"))
    arg_max = 128 * 1024 - 1
    hostile(cli.state, 0, args=["-a=" * (arg_max // 3), "a" * (arg_max - 3) + "://"] * 7)
    started = time.monotonic()
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "3", timeout=120)
    assert time.monotonic() - started < 20
    assert "Traceback" not in result.err
    assert result.code == 1
    assert result.err.splitlines()[-1].startswith(f"gpuguard gate: GPUs of {unit} still busy")


def test_the_fast_path_hands_over_when_the_daemon_lists_xids_for_the_unit(
    cli: Cli, unit_cgroups: UnitCgroups
) -> None:
    """Idle GPUs, but the daemon's snapshot lists a reset-class Xid for the unit: full path.

    The full path weighs it (only for an automatic restart, which this is not: no systemd
    here says NRestarts), so the start is still allowed; it just is not the light path.
    """
    unit = unit_name()
    assert gate_in_unit(cli, unit_cgroups, unit).code == 0  # full load fills the cache
    watch = snapshots.unit(reset_xids=({"pci_bus_id": "0000:3b:00", "code": 79},))
    snapshot = snapshots.written({unit: watch})
    (cli.config.parent / "run" / "daemon.json").write_text(json.dumps(snapshot.to_json()))
    cli.env["PYTHONPROFILEIMPORTTIME"] = "1"
    try:
        result = gate_in_unit(cli, unit_cgroups, unit)
    finally:
        del cli.env["PYTHONPROFILEIMPORTTIME"]
    assert result.code == 0, result.err
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.err.splitlines() if "|" in line}
    assert "pydantic" in imported
