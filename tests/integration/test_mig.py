"""MIG mode over the C fake NVML: status says it, the gate and reap leave such a GPU alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from clirunner import gate_in_unit, unit_name
from fakeholder import process_gone
from fakestate import update_gpu

if TYPE_CHECKING:
    from clirunner import Cli, FakeSystemd, UnitCgroups
    from fakeholder import HolderSpawner


def test_status_reads_mig_mode_and_says_what_it_cannot_judge(cli: Cli) -> None:
    """MIG on is a warning naming what is not judged; NOT_SUPPORTED reads as off, not unknown."""
    update_gpu(cli.state, 1, mig_mode=1)
    update_gpu(cli.state, 2, mig_mode=0, mig_pending=1)
    update_gpu(cli.state, 3, mig_mode=-1)
    result = cli("status", "--json")
    doc = result.json()
    assert [g["mig"] for g in doc["gpus"]] == [
        {"current": False, "pending": False},
        {"current": True, "pending": True},
        {"current": False, "pending": True},
        {"current": False, "pending": False},
    ]
    assert result.code == 1, result.out
    messages = [f["message"] for f in doc["findings"] if f["level"] == "WARNING"]
    assert any(
        m.startswith("GPU 1: MIG mode is on:") and "other tenants'" in m and "nor reap" in m
        for m in messages
    )
    text = cli("status").out
    assert "GPU 1  NVIDIA H200" in text
    assert "MIG (not judged)" in text
    assert "GPU 2: MIG mode turns on at the next GPU reset" in text


def test_gate_lets_a_start_through_on_a_mig_gpu_and_says_why(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """Another tenant's memory on a MIG GPU neither blocks the start nor is touched by it."""
    unit = unit_name()
    tenant = spawn_holder(cli.state, gpus=(1,), mib=8000, name="python3 tenant.py")
    unit_cgroups.move(tenant.pid, unit_name().replace("sglang", "tenant"))
    cli.configure(f'[units."{unit}"]\ngpus = [1]\n')
    refused = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "1", "--grace", "0.2")
    assert refused.code == 1, refused.err  # without MIG the whole-GPU figures block it
    update_gpu(cli.state, 1, mig_mode=1)
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "1", "--grace", "0.2")
    assert result.code == 0, result.err
    line = result.err.strip().splitlines()[-1]
    assert "start allowed" in line
    assert "MIG mode on GPU 1: not judged" in line
    assert not process_gone(tenant.pid)


def test_gate_still_judges_the_gpus_without_mig(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """With MIG on one GPU of the set, a holder of another GPU of the set still blocks."""
    unit = unit_name()
    job = spawn_holder(cli.state, gpus=(2,), mib=8000, name="python3 train.py")
    unit_cgroups.move(job.pid, unit_name().replace("sglang", "training"))
    update_gpu(cli.state, 1, mig_mode=1)
    cli.configure(f'[units."{unit}"]\ngpus = [1, 2]\n')
    result = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "1", "--grace", "0.2")
    assert result.code == 1, result.err
    line = result.err.strip().splitlines()[-1]
    assert f"PID {job.pid}" in line
    assert "MIG mode on GPU 1: not judged" in line


def test_reap_plans_nothing_on_a_mig_gpu(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups, fake_systemd: FakeSystemd
) -> None:
    """A stale holder in the unit's cgroup on a MIG GPU is not planned; the plan says why."""
    unit = unit_name()
    fake_systemd(unit)
    cli.configure(f'[units."{unit}"]\n')
    stale = spawn_holder(cli.state, gpus=(0,), mib=4000, name="sglang::scheduler_TP0")
    unit_cgroups.move(stale.pid, unit)
    planned = cli("reap", "--dry-run", "--unit", unit)
    assert f"reap  pid {stale.pid}" in planned.out, planned.out + planned.err
    update_gpu(cli.state, 0, mig_mode=1)
    result = cli("reap", "--dry-run", "--unit", unit)
    assert f"reap  pid {stale.pid}" not in result.out, result.out
    assert "MIG mode on GPU 0: not judged" in result.out
    assert not process_gone(stale.pid)
