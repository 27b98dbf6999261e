"""Drivers with only the v1 memory API: idle is idle, and status says it is estimating.

The fake's old-driver build (no memory v2, no *_v3 process lists) through the unmodified pynvml.
Its v1 ``used`` is the GPU's ``used_mib`` plus allocations: ``used_mib = 530`` is what an idle
GPU reads on a driver whose v1 call counts its reserved carve-out as used (A100/H100: ~0.5 GiB).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import uuid
from typing import TYPE_CHECKING

import pytest
from asnobody import public_dir, run_as_nobody
from clirunner import Cli, CliResult
from fakestate import FakeGpu, fake_library, update_gpu, write_state
from hostpids import HOST_PIDS

from gpuguard.core.baseline import CONFIRM_AFTER_S

if TYPE_CHECKING:
    from pathlib import Path

    from clirunner import UnitCgroups
    from fakeholder import HolderSpawner
    from fakestate import NvmlEnv

IDLE_V1_MIB = 530


@pytest.fixture
def old_cli(tmp_path: Path, nvml_env: NvmlEnv, fake_nvml_old_dir: Path) -> Cli:
    """The CLI over four idle H200s behind an old driver whose idle v1 used is 530 MiB."""
    del fake_nvml_old_dir  # built up front
    if os.geteuid() != 0:
        pytest.skip("the v1 reserve is learned by root alone")
    state = write_state(tmp_path / "nvml-state", [FakeGpu(used_mib=IDLE_V1_MIB)] * 4)
    runner = Cli(
        state, tmp_path / "gpuguard.toml", nvml_env(state, old=True), fake_library(old=True)
    )
    runner.configure()
    a_minute_later(runner)
    return runner


def a_minute_later(cli: Cli) -> None:
    """Root's first look at the idle GPUs, its learned reserve's first occasion then a minute back.

    The next look is the second occasion, which confirms it (core/baseline.py).
    """
    first = cli("status")
    assert "is not confirmed yet" in first.out, first.out
    path = cli.config.parent / "lib" / "v1-reserved.json"
    learned = json.loads(path.read_text())
    for value in learned.values():
        value["first_s"] -= CONFIRM_AFTER_S
    path.write_text(json.dumps(learned))


def gate_in_unit(cli: Cli, cgroups: UnitCgroups, unit: str, *args: str) -> CliResult:
    """Run the gate inside the unit's cgroup, as ExecStartPre= runs."""
    procs = cgroups.ensure(unit) / "cgroup.procs"
    command = shlex.join(cli.command("gate", "--unit", unit, *args))
    done = subprocess.run(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {command}"],
        capture_output=True,
        text=True,
        env={**cli.env, "INVOCATION_ID": uuid.uuid4().hex},
        timeout=120,
        check=False,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


@pytest.mark.skipif(os.geteuid() != 0, reason="the v1 reserve is learned by root alone")
def test_idle_gpus_are_idle_and_status_says_it_estimates(old_cli: Cli) -> None:
    """Not "4 of 4 GPUs in use": all idle, the reserve learned and shown as an estimate."""
    result = old_cli("status")
    assert "in use by live processes" not in result.out
    assert sum(line.endswith(" idle") for line in result.out.splitlines()) == 4
    assert f"0 MiB / 143771 MiB (estimated: {IDLE_V1_MIB} MiB reserved, learned) idle" in result.out
    assert (
        "OK: memory use is estimated: the v1 memory API counts the driver's reserved" in result.out
    )
    assert result.code == 1  # WARNING only for "driver too old"; nothing CRITICAL
    doc = old_cli("status", "--json").json()
    assert all(g["idle"] for g in doc["gpus"])
    assert {g["memory"]["reserved_source"] for g in doc["gpus"]} == {"learned"}
    assert {g["memory"]["reserved_mib"] for g in doc["gpus"]} == {IDLE_V1_MIB}
    learned = json.loads((old_cli.config.parent / "lib" / "v1-reserved.json").read_text())
    (model,) = learned
    assert model == "NVIDIA H200 143771 MiB"
    assert learned[model]["bytes"] == IDLE_V1_MIB << 20
    assert learned[model]["confirmed"] is True


def test_gate_passes_idle_gpus(old_cli: Cli, unit_cgroups: UnitCgroups) -> None:
    """The gate no longer refuses idle GPUs on an old driver."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    result = gate_in_unit(old_cli, unit_cgroups, unit, "--timeout", "3")
    assert result.code == 0, result.err
    assert "start allowed" in result.err


def test_memory_no_process_explains_is_reported(old_cli: Cli, unit_cgroups: UnitCgroups) -> None:
    """3000 MiB on GPU 2 with no holder: unattributed (CRITICAL), and the gate waits on it.

    Its idle siblings teach the reserve, so the leak is not learned as GPU 2's reserve.
    """
    update_gpu(old_cli.state, 2, unattributed_mib=3000)
    result = old_cli("status")
    assert result.code == 2, result.out
    assert "Unattributed: GPU 2: 3000 MiB" in result.out
    assert old_cli("status", "--json").json()["gpus"][2]["unattributed_mib"] == 3000
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    old_cli.configure(f'[units."{unit}"]\ngpus = [2]\n')
    gate = gate_in_unit(old_cli, unit_cgroups, unit, "--timeout", "2")
    assert gate.code == 1
    assert "GPU 2: 3000 MiB used" in gate.err


@HOST_PIDS
@pytest.mark.skipif(os.geteuid() != 0, reason="the v1 reserve is learned by root alone")
def test_a_holder_keeps_its_gpu_busy(old_cli: Cli, spawn_holder: HolderSpawner) -> None:
    """A real holder of 1000 MiB on GPU 0: busy, its memory shown, not called unattributed."""
    holder = spawn_holder(old_cli.state, gpus=(0,), mib=1000)
    doc = old_cli("status", "--json").json()
    gpu0 = doc["gpus"][0]
    assert not gpu0["idle"]
    assert gpu0["memory"]["used_mib"] == 1000
    assert gpu0["unattributed_mib"] is None  # sizes unknown without the v3 process lists
    assert gpu0["holder_pids"] == [holder.pid]
    assert all(g["idle"] for g in doc["gpus"][1:])


def test_configured_reserve_wins(old_cli: Cli) -> None:
    """v1_reserved_mib set: it is what is taken out, shown as configured."""
    old_cli.configure("v1_reserved_mib = 520\n")
    doc = old_cli("status", "--json").json()
    assert {g["memory"]["reserved_source"] for g in doc["gpus"]} == {"configured"}
    assert {g["memory"]["used_mib"] for g in doc["gpus"]} == {IDLE_V1_MIB - 520}
    assert all(g["idle"] for g in doc["gpus"])  # 10 MiB, within idle_threshold_mib (16)
    old_cli.configure("v1_reserved_mib = 100\n")
    doc = old_cli("status", "--json").json()
    assert not any(g["idle"] for g in doc["gpus"])  # the operator's word, even when too small


def test_without_root_nothing_is_learned_but_roots_estimate_is_used(nvml_env: NvmlEnv) -> None:
    """As nobody: no estimate yet → WARNING, not "busy"; after root's run → the estimate."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to user nobody")
    with public_dir() as public:
        state = write_state(public / "nvml-state", [FakeGpu(used_mib=IDLE_V1_MIB)] * 4)
        cli = Cli(
            state, public / "gpuguard.toml", nvml_env(state, old=True), fake_library(old=True)
        )
        cli.configure()
        unprivileged = run_as_nobody(["--config", str(cli.config), "status"], cli.env)
        assert "in use by live processes" not in unprivileged.out
        assert "no estimate of it exists yet" in unprivileged.out
        assert not (public / "lib" / "v1-reserved.json").exists()
        a_minute_later(cli)  # root learns (and stores) the reserve, on its first occasion
        assert cli("status").code == 1  # and confirms it on its second
        (public / "lib").chmod(0o755)
        unprivileged = run_as_nobody(["--config", str(cli.config), "status"], cli.env)
        assert unprivileged.out.count("reserved, learned) idle") == 4, unprivileged.out
