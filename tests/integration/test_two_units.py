"""Two watched units on disjoint GPUs: status names no live process a left-over (real processes).

Real processes in real cgroups with real environments and the fake NVML; what systemd would
say about the two units comes from a ``systemctl`` double (systemd cannot run here): both run,
each with its own invocation and its own ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import shlex
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest
    from clirunner import Cli, FakeSystemd, UnitCgroups
    from fakeholder import HolderSpawner

LIVE_A, LIVE_B = uuid.uuid4().hex, uuid.uuid4().hex


def two_running_units(fake_systemd: FakeSystemd) -> tuple[str, str]:
    """Units A (GPUs 0,1) and B (GPUs 2,3), both running, as systemctl would describe them."""
    tag = uuid.uuid4().hex[:8]
    a, b = f"sglang-a-{tag}.service", f"sglang-b-{tag}.service"
    cases = "".join(
        f"  {unit}) printf %s {shlex.quote(_show(live, gpus))} ;;\n"
        for unit, live, gpus in ((a, LIVE_A, "0,1"), (b, LIVE_B, "2,3"))
    )
    (fake_systemd.bin_dir / "systemctl").write_text(
        f'#!/bin/sh\n[ "$1" = show ] || exit 1\ncase "$2" in\n{cases}  *) exit 1 ;;\nesac\n'
    )
    (fake_systemd.bin_dir / "journalctl").write_text("#!/bin/sh\nexit 0\n")
    for name in ("systemctl", "journalctl"):
        (fake_systemd.bin_dir / name).chmod(0o755)
    return a, b


def _show(invocation: str, gpus: str) -> str:
    return (
        "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=0\n"
        f"InvocationID={invocation}\nEnvironment=CUDA_VISIBLE_DEVICES={gpus}\n"
        "NRestarts=0\nUser=\nDynamicUser=no\n"
    )


def test_another_units_live_workers_are_nobodys_left_over(
    cli: Cli,
    fake_systemd: FakeSystemd,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B serves on GPUs 2,3 (one worker escaped into a scope of its own); A's GPUs are idle.

    On main status warned that B's workers "look like a left-over" of A (and of B) and that the
    units "set no gpus" although both set CUDA_VISIBLE_DEVICES; the metrics said 0 left-overs.
    """
    a, b = two_running_units(fake_systemd)
    cli.configure(f'[units."{a}"]\npatterns = ["sglang"]\n[units."{b}"]\npatterns = ["sglang"]\n')
    monkeypatch.setenv("INVOCATION_ID", LIVE_B)
    server = spawn_holder(cli.state, gpus=(2,), mib=40000, name="sglang::scheduler_TP0")
    worker = spawn_holder(cli.state, gpus=(3,), mib=40000, name="sglang::scheduler_TP1")
    monkeypatch.delenv("INVOCATION_ID")
    unit_cgroups.move(server.pid, b)
    unit_cgroups.move(worker.pid, f"run-u{uuid.uuid4().hex[:6]}.scope")

    result = cli("status")

    assert result.code == 0, result.out + result.err
    assert result.out.startswith("gpuguard status: OK - 2 of 4 GPUs in use by live processes")
    assert "left-over" not in result.out
    assert "set no gpus" not in result.err
    assert "share GPUs" not in result.out
    assert f"Unit {a}: active (running); GPUs 0,1 (CUDA_VISIBLE_DEVICES=0,1)" in result.out
    assert f"Unit {b}: active (running); GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3)" in result.out
    scrape = cli("status", "--prometheus").out
    assert 'gpuguard_gpu_stale_holders{gpu="2"} 0.0' in scrape
    assert 'gpuguard_gpu_stale_holders{gpu="3"} 0.0' in scrape


def test_an_ended_runs_escaped_worker_is_named_and_counted_alike(
    cli: Cli,
    fake_systemd: FakeSystemd,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker of A's ended run escaped into its own scope on GPU 0: named, and counted alike.

    Status names it with the operator's command; the metrics count it on GPU 0.
    """
    a, _ = two_running_units(fake_systemd)
    cli.configure(f'[units."{a}"]\npatterns = ["sglang"]\n')
    monkeypatch.setenv("INVOCATION_ID", uuid.uuid4().hex)  # its scope's own, no run of A
    stale = spawn_holder(cli.state, gpus=(0,), mib=70000, name="sglang::scheduler_TP0")
    monkeypatch.delenv("INVOCATION_ID")
    unit_cgroups.move(stale.pid, f"run-u{uuid.uuid4().hex[:6]}.scope")

    result = cli("status")

    assert result.code == 1, result.out + result.err
    lines = result.out.splitlines()
    line = next(line for line in lines if line.startswith("WARNING: ") and "left-over" in line)
    assert f"PID {stale.pid} " in line
    assert f"`gpuguard reap --unit {a} --scope patterns`" in line
    scrape = cli("status", "--prometheus").out
    assert 'gpuguard_gpu_stale_holders{gpu="0"} 1.0' in scrape
    assert 'gpuguard_gpu_suspected_stale_holders{gpu="0"} 1.0' in scrape
