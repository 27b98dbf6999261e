"""`gpuguard status` says what is true: real processes, the fake NVML, real privilege drops."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from asnobody import public_dir, run_as_nobody
from clirunner import Cli
from fakestate import add_alloc, fake_library, write_state
from hostpids import HOST_PIDS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fakeholder import HolderSpawner
    from fakestate import NvmlEnv


VFORK_C = Path(__file__).resolve().parent.parent / "support" / "vfork_parent.c"


@pytest.fixture
def public_cli(nvml_env: NvmlEnv) -> Iterator[Cli]:
    """The CLI over four idle fake H200s, with state and config that user nobody can read."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to user nobody")
    with public_dir() as public:
        state = write_state(public / "nvml-state")
        runner = Cli(state, public / "gpuguard.toml", nvml_env(state), fake_library())
        runner.configure()
        yield runner


def test_root_job_seen_without_root_is_not_inspectable_not_vanished(
    public_cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """A root job on GPU 1, status as nobody: named, sized, "not inspectable", not CRITICAL."""
    cli = public_cli
    job = spawn_holder(cli.state, gpus=(1,), mib=4000, name="python3 train.py")
    result = run_as_nobody(["--config", str(cli.config), "status"], cli.env)
    assert "no such process" not in result.out
    assert "CRITICAL" not in result.out
    assert result.code == 0, result.out + result.err
    assert result.out.startswith("gpuguard status: OK - 1 of 4 GPUs in use by live processes")
    line = next(line for line in result.out.splitlines() if f"pid {job.pid} " in line)
    assert "4000 MiB" in line
    assert "python3 train.py" in line
    assert line.endswith("(open files not inspectable without root)")
    doc = run_as_nobody(["--config", str(cli.config), "status", "--json"], cli.env)
    report = doc_json(doc.out)
    assert report["vanished"] == []
    holder = next(h for h in report["holders"] if h["pid"] == job.pid)
    assert holder["files_readable"] is False
    assert holder["gpus"][0]["used_mib"] == 4000
    as_root = cli("status", "--json").json()
    assert next(h for h in as_root["holders"] if h["pid"] == job.pid)["files_readable"] is True


@HOST_PIDS
def test_a_pid_that_is_really_gone_is_still_vanished_without_root(
    public_cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """The other side: NVML naming a dead PID stays CRITICAL "no such process" as nobody."""
    cli = public_cli
    server = spawn_holder(cli.state, gpus=(2,), mib=1500, children=1, leave_child=True)
    server.kill()
    server.wait()
    result = run_as_nobody(["--config", str(cli.config), "status"], cli.env)
    assert result.code == 2, result.out + result.err
    assert f"NVML lists PID {server.pid} (1500 MiB) but /proc has no such process" in result.out


def doc_json(text: str) -> Any:
    """Parse a --json document."""
    return json.loads(text)


@pytest.fixture(scope="session")
def vfork_parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/support/vfork_parent.c, compiled once."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    binary = tmp_path_factory.mktemp("vfork") / "vfork_parent"
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(VFORK_C)], check=True
    )
    return binary


def test_a_vfork_parent_in_state_d_is_not_stuck_in_the_driver(cli: Cli, vfork_parent: Path) -> None:
    """A real vfork() parent holding GPU 0 sleeps in state D in kernel_clone: not a driver hang.

    It is killable (SIGKILL takes), so "GPU reset or reboot" would be a false alarm.
    """
    process = subprocess.Popen(
        [str(vfork_parent), str(cli.state / "dev" / "nvidia0")], stdout=subprocess.PIPE
    )
    assert process.stdout is not None  # a PIPE
    parent, child = map(int, process.stdout.readline().split())
    process.stdout.close()
    try:
        add_alloc(cli.state, pid=parent, minor=0, mib=2000)
        assert wait_for_state(parent, "D")
        result = cli("status")
        doc = cli("status", "--json").json()
    finally:
        os.kill(parent, signal.SIGKILL)
        process.wait(timeout=10)  # the SIGKILL took: it was never stuck
        os.kill(child, signal.SIGKILL)
    assert "stuck in the" not in result.out
    assert "reset or reboot" not in result.out
    assert (
        f"PID {parent} (vfork_parent) holding GPU 0 is in uninterruptible sleep (state D, in "
        in result.out
    )
    assert "not the NVIDIA driver" in result.out
    assert result.code == 0, result.out
    assert next(h for h in doc["holders"] if h["pid"] == parent)["state"] == "D"
    assert process.returncode == -signal.SIGKILL


def wait_for_state(pid: int, letter: str, timeout: float = 5.0) -> bool:
    """Wait until /proc/PID/stat shows the state ``letter``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == letter:
            return True
        time.sleep(0.05)
    return False
