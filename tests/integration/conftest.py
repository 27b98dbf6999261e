"""Fixtures for integration tests: the gpuguard CLI over the fake NVML, and real cgroups."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CGROUP2, Cli, FakeSystemd, Openers, UnitCgroups
from fakestate import fake_library
from hostile import HostileProcesses

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fakestate import NvmlEnv


FREEZER = Path("/sys/fs/cgroup/freezer")
"""The cgroup v1 freezer: a frozen process is in state D and survives SIGKILL until thawed."""


@pytest.fixture
def cli(fake_state: Path, nvml_env: NvmlEnv, tmp_path: Path) -> Cli:
    """The CLI over four fake idle H200s (its runtime_dir, config cache included, in tmp_path)."""
    runner = Cli(fake_state, tmp_path / "gpuguard.toml", nvml_env(fake_state), fake_library())
    runner.configure()
    return runner


@pytest.fixture
def unit_cgroups() -> Iterator[UnitCgroups]:
    """Real cgroups so /proc/PID/cgroup names a unit; teardown kills members and removes them."""
    if not os.access(CGROUP2, os.W_OK) or not (CGROUP2 / "cgroup.procs").exists():
        pytest.skip(f"needs a writable cgroup v2 hierarchy at {CGROUP2} (root)")
    cgroups = UnitCgroups([])
    yield cgroups
    for path in reversed(cgroups.made):
        for _ in range(50):
            members = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            if not members:
                break
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            path.rmdir()
    for parent in {p.parent for p in cgroups.made}:
        if parent != CGROUP2:
            with contextlib.suppress(OSError):
                parent.rmdir()


@pytest.fixture
def opener() -> Iterator[Openers]:
    """Factory for processes that hold device files without GPU memory (killed at teardown)."""
    openers = Openers([])
    yield openers
    openers.stop()


@pytest.fixture
def fake_systemd(cli: Cli, tmp_path: Path) -> FakeSystemd:
    """Test doubles of systemctl and journalctl in place of the real ones (see Cli.command)."""
    if os.geteuid() != 0:
        pytest.skip("binding test doubles over /usr/bin/systemctl needs root")
    doubles = FakeSystemd(tmp_path / "fake-systemd-bin")
    doubles.bin_dir.mkdir()
    cli.doubles.update({name: doubles.bin_dir / name for name in ("systemctl", "journalctl")})
    return doubles


@pytest.fixture
def hostile() -> Iterator[HostileProcesses]:
    """Factory for device holders with attacker-chosen names and command lines (killed after)."""
    processes = HostileProcesses([])
    yield processes
    processes.stop()


@pytest.fixture
def frozen_group() -> Iterator[Path]:
    """A cgroup v1 freezer group: a frozen member is in state D and survives SIGKILL."""
    if not (FREEZER / "freezer.state").exists() and not (FREEZER / "tasks").exists():
        pytest.skip(f"the cgroup v1 freezer is not mounted at {FREEZER}")
    group = FREEZER / f"gpuguard-gate-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as err:
        pytest.skip(f"cannot create a freezer cgroup: {err.strerror}")
    yield group
    (group / "freezer.state").write_text("THAWED")
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.05)
    group.rmdir()
