"""Attacks by a service user on gpuguard's root side (issue 9): each test is one attack.

They run as root, as gpuguard's gate and reap do; the attacker is uid 65534 (nobody), owner of
everything it plants. Without root there is nothing to attack, so every test skips.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CGROUP2, Cli
from fakestate import fake_library

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fakestate import NvmlEnv


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test here ``adversarial`` and skip it without root."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.adversarial)
            if os.geteuid() != 0:
                item.add_marker(pytest.mark.skip(reason="attacks on root's side need root"))


@pytest.fixture
def cli(fake_state: Path, nvml_env: NvmlEnv, tmp_path: Path) -> Cli:
    """The CLI over four fake idle H200s (its runtime_dir, config cache included, in tmp_path)."""
    runner = Cli(fake_state, tmp_path / "gpuguard.toml", nvml_env(fake_state), fake_library())
    runner.configure()
    return runner


@pytest.fixture
def unit_cgroup() -> Iterator[tuple[str, Path]]:
    """A unique unit name and its real cgroup; members are killed and it is removed at the end."""
    if not (CGROUP2 / "cgroup.procs").exists():
        pytest.skip(f"needs a cgroup v2 hierarchy at {CGROUP2}")
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    path = CGROUP2 / "system.slice" / unit
    path.mkdir(parents=True)
    yield unit, path
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
