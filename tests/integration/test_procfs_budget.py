"""The /proc walk's budgets against real flooding processes: bounded, and never read as clean."""

from __future__ import annotations

import tracemalloc
from typing import TYPE_CHECKING

import pytest
from floods import Flood

from gpuguard.adapters.procdevices import ScanBudget
from gpuguard.adapters.procfs import read_listed, scan_device_holders

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture
def device(tmp_path: Path) -> Path:
    """A fake GPU device file (4 KiB, so it can be mapped)."""
    (tmp_path / "dev").mkdir()
    path = tmp_path / "dev" / "nvidia0"
    path.write_bytes(b"\0" * 4096)
    return path


@pytest.fixture
def floods() -> Iterator[list[Flood]]:
    """The floods a test starts, killed at its end."""
    started: list[Flood] = []
    yield started
    for flood in started:
        flood.kill()


def _found(scan_glob: str, pid: int, budget: ScanBudget) -> tuple[str | None, frozenset[str]]:
    """What a full walk under ``budget`` says of ``pid``: why partial, and its device files."""
    facts = next(
        f for f in scan_device_holders(scan_glob, budget=budget).processes if f.identity.pid == pid
    )
    return facts.partial, facts.device_files


def test_a_descriptor_flood_is_not_walked_and_marked_not_fully_inspected(
    device: Path, floods: list[Flood]
) -> None:
    """A table larger than the budget (the kernel counts it) is not read: partial, device unseen."""
    flood = Flood("fds", 5000, device)
    floods.append(flood)
    partial, files = _found(
        str(device.parent / "nvidia*"), flood.pid, ScanBudget(fds_per_process=1000)
    )
    assert partial is not None
    assert partial.endswith("open descriptors, more than the 1,000 read")
    assert files == frozenset()


def test_a_flooding_process_that_maps_its_device_is_seen_on_that_gpu(
    device: Path, floods: list[Flood]
) -> None:
    """Its mappings, read within their own budget, still show the GPU it uses (as CUDA maps it)."""
    flood = Flood("fds", 5000, device, where="mapped")
    floods.append(flood)
    partial, files = _found(
        str(device.parent / "nvidia*"), flood.pid, ScanBudget(fds_per_process=1000)
    )
    assert partial is not None
    assert files == {str(device)}


def test_the_scans_descriptor_budget_reads_small_tables_first(
    device: Path, floods: list[Flood]
) -> None:
    """Two floods spend the scan's budget after the small holder was read in full."""
    floods.extend(Flood("fds", 3000) for _ in range(2))
    holder = Flood("fds", 10, device)
    floods.append(holder)
    budget = ScanBudget(fds_per_process=4000, fds_per_scan=4000)
    scan = scan_device_holders(str(device.parent / "nvidia*"), budget=budget)
    by_pid = {f.identity.pid: f for f in scan.processes}
    assert by_pid[holder.pid].partial is None
    assert by_pid[holder.pid].device_files == {str(device)}
    cut = [by_pid[flood.pid].partial for flood in floods[:2] if flood.pid in by_pid]
    assert cut, "the floods come last and the budget ends within them"
    assert set(cut) == {"the scan's budget of 4,000 descriptors was spent"}


def test_a_huge_maps_is_read_only_to_its_budget(
    device: Path, tmp_path: Path, floods: list[Flood]
) -> None:
    """20,000 mappings of a file with a long path: read to 256 KiB, marked, memory bounded."""
    deep = tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200)
    deep.mkdir(parents=True)
    backing = deep / "backing"
    backing.write_bytes(b"\0" * 4096 * 20_000)
    flood = Flood("maps", 20_000, device, path=backing)
    floods.append(flood)
    assert (
        size := len((tmp_path / "x").parent.joinpath(f"/proc/{flood.pid}/maps").read_bytes())
    ) > 8 << 20
    tracemalloc.start()
    try:
        scan = read_listed(
            [flood.pid], str(device.parent / "nvidia*"), budget=ScanBudget(maps_bytes=256 << 10)
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (facts,) = scan.processes
    assert facts.partial == "a maps file larger than 256 KiB"
    assert facts.device_files == frozenset()  # mapped first, so at the top: past the budget
    assert peak < 2 << 20, (peak, size)
