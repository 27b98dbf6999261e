"""`gpuguard status` with a flooding process: named as not fully inspected, never read as clean."""

from __future__ import annotations

import os
import pwd
from typing import TYPE_CHECKING

import pytest
from fakestate import add_alloc
from floods import Flood, fd_ceiling

from gpuguard.adapters.procdevices import DEFAULT_BUDGET

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from clirunner import Cli

# More than one process's budget, within this host's limit where it allows that many.
DESCRIPTORS = DEFAULT_BUDGET.fds_per_process + 1000


@pytest.fixture
def flooding(fake_state: Path) -> Iterator[Flood]:
    """A process with more descriptors than the budget reads, mapping fake GPU 0 (as CUDA does)."""
    if fd_ceiling() < DESCRIPTORS + 64:
        pytest.skip(f"one process may hold only {fd_ceiling()} descriptors here")
    device = fake_state / "dev" / "nvidia0"
    os.truncate(device, 4096)
    flood = Flood("fds", DESCRIPTORS, device, where="mapped")
    yield flood
    flood.kill()


def test_a_descriptor_flood_mapping_gpu_0_keeps_it_from_reading_idle(
    cli: Cli, flooding: Flood
) -> None:
    """GPU 0 has no memory used, but its holder was not fully read: not idle, and named."""
    result = cli("status")
    assert result.code == 1, result.err
    assert f"PID {flooding.pid} (" in result.out
    assert f", {pwd.getpwuid(os.getuid()).pw_name}) not fully inspected: " in result.out
    assert "; GPU 0 not reported idle" in result.out
    doc = cli("status", "--json").json()
    assert [g["idle"] for g in doc["gpus"]] == [False, True, True, True]
    (entry,) = [p for p in doc["scan"]["partial"] if p["pid"] == flooding.pid]
    assert entry["gpus"] == [0]
    assert entry["reason"].endswith(
        f"open descriptors, more than the {DEFAULT_BUDGET.fds_per_process:,} read"
    )


def test_a_flooding_process_nvml_lists_is_read_in_full(
    cli: Cli, fake_state: Path, flooding: Flood
) -> None:
    """NVML lists the flood on GPU 1: it is that GPU's holder, with its command line."""
    add_alloc(fake_state, pid=flooding.pid, minor=1, mib=500)
    doc = cli("status", "--json").json()
    (holder,) = [h for h in doc["holders"] if h["pid"] == flooding.pid]
    assert holder["cmdline"][:2] == [holder["cmdline"][0], "-c"]
    assert doc["foreign"] == []
    (entry,) = [p for p in doc["scan"]["partial"] if p["pid"] == flooding.pid]
    assert entry["gpus"] == [0, 1]
