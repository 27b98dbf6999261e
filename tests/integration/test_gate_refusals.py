"""`gpuguard gate` refuses at once what waiting cannot fix and says who blocks it while it waits.

Real processes, real cgroups, the fake NVML through the unmodified pynvml.
"""

from __future__ import annotations

import shlex
import subprocess
import time
import uuid
from typing import TYPE_CHECKING

from clirunner import CliResult
from fakestate import update_gpu, update_state

if TYPE_CHECKING:
    from clirunner import Cli, UnitCgroups
    from fakeholder import HolderSpawner


def unit_name() -> str:
    """A unit name unique to this test."""
    return f"sglang-{uuid.uuid4().hex[:8]}.service"


def gate_in_unit(cli: Cli, cgroups: UnitCgroups, unit: str, *args: str) -> tuple[CliResult, float]:
    """Run the gate inside the unit's cgroup, as ExecStartPre= runs; also how long it took."""
    procs = cgroups.ensure(unit) / "cgroup.procs"
    command = shlex.join(cli.command("gate", "--unit", unit, *args))
    started = time.monotonic()
    done = subprocess.run(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {command}"],
        capture_output=True,
        text=True,
        env={**cli.env, "INVOCATION_ID": uuid.uuid4().hex},
        timeout=120,
        check=False,
    )
    # Without a gate server here the gate runs in-process after a note; the note is about where
    # it runs, not part of its answer.
    err = "".join(
        line
        for line in done.stderr.splitlines(keepends=True)
        if not line.startswith("gpuguard gate: no gate server at ")
    )
    return CliResult(done.returncode, done.stdout, err), time.monotonic() - started


def test_driver_not_loaded_refuses_at_once(cli: Cli, unit_cgroups: UnitCgroups) -> None:
    """NVML cannot answer: exit 1 within seconds of a 300 s timeout, one line with the reason."""
    update_state(cli.state, init_error=9)
    result, took = gate_in_unit(cli, unit_cgroups, unit_name(), "--timeout", "300")
    assert result.code == 1
    assert took < 30
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert "refused at once: NVML unavailable" in lines[0]
    assert "Driver Not Loaded" in lines[0]


def test_lost_gpu_of_the_set_refuses_at_once(cli: Cli, unit_cgroups: UnitCgroups) -> None:
    """GPU 1 of the set fell off the bus: refused now, naming it; GPU 3 lost alone would not."""
    unit = unit_name()
    cli.configure(f'[units."{unit}"]\ngpus = [0, 1]\n')
    update_gpu(cli.state, 3, lost=True)
    passed, _ = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "300")
    assert passed.code == 0, passed.err
    update_gpu(cli.state, 1, lost=True)
    result, took = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "300")
    assert result.code == 1
    assert took < 30
    (line,) = result.err.strip().splitlines()
    assert f"start of {unit} refused at once: GPU 1: GPU is lost" in line
    assert "GPU 3" not in line


def test_gpu_of_the_set_needing_a_reset_refuses_at_once(
    cli: Cli, unit_cgroups: UnitCgroups
) -> None:
    """GPU 0 of the set has a row remap pending: one line naming it and why, within seconds."""
    unit = unit_name()
    cli.configure(f'[units."{unit}"]\ngpus = [0, 1]\n')
    update_gpu(cli.state, 0, remapped_rows_pending=1)
    result, took = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "300")
    assert result.code == 1
    assert took < 30
    (line,) = result.err.strip().splitlines()
    assert f"start of {unit} refused at once: GPU 0 needs a reset: a memory row remap" in line


def test_the_fast_path_refuses_an_idle_gpu_that_needs_a_reset(
    cli: Cli, unit_cgroups: UnitCgroups
) -> None:
    """With the configuration cached (the fast path), an idle GPU needing a reset still refuses."""
    unit = unit_name()
    cli.configure(f'[units."{unit}"]\ngpus = [0, 1]\n')
    first, _ = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "30")
    assert first.code == 0, first.err  # a full load: the cache for the fast path is written
    update_gpu(cli.state, 0, remapped_rows_pending=1)
    result, took = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "300")
    assert result.code == 1, result.out + result.err
    assert took < 30
    assert f"start of {unit} refused at once: GPU 0 needs a reset" in result.err


def test_waiting_gate_says_who_holds_what(
    cli: Cli, unit_cgroups: UnitCgroups, spawn_holder: HolderSpawner
) -> None:
    """A foreign job on the set: after 10 s one line names it; then the refusal at the timeout."""
    unit = unit_name()
    other = unit_name().replace("sglang", "training")
    job = spawn_holder(cli.state, gpus=(0,), mib=8000, name="python3 train.py")
    unit_cgroups.move(job.pid, other)
    result, took = gate_in_unit(cli, unit_cgroups, unit, "--timeout", "12")
    assert result.code == 1
    assert took >= 12
    lines = result.err.strip().splitlines()
    waiting = [line for line in lines if "waiting" in line]
    assert len(waiting) == 1, result.err
    assert waiting[0].startswith(f"gpuguard gate: {unit}: waiting 10 s of 12 s: GPU 0: 8000 MiB")
    assert f"PID {job.pid} (python3 train.p, {other}) - not touched" in waiting[0]
    assert lines[-1].startswith(f"gpuguard gate: GPUs of {unit} still busy after")
