"""cuda:N of a failure line → the GPU the unit sees as N, with who holds it; the gate's view."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import snapshots
from builders import gpu, inventory, nvml, training_job

from gpuguard.adapters import daemonsnapshot
from gpuguard.adapters.procfs import read_identity
from gpuguard.adapters.state import write_json
from gpuguard.core.gpuset import CudaView
from gpuguard.core.oomdevice import describe_device, device_phrases

if TYPE_CHECKING:
    from pathlib import Path


INVENTORY = inventory(
    nvml(gpu(2), gpu(3, (77, 20480))),
    training_job(77, 3, comm="py\x1b[2Jthon3", state="R"),
)
"""GPU 2 idle; GPU 3 held by another unit's live job (20 GiB), whose name needs escaping."""


def test_each_visible_device_names_its_gpu_and_holders_escaped() -> None:
    """CUDA_VISIBLE_DEVICES=2,3,5: cuda:1 is GPU 3 held by another unit's job; 5 is absent."""
    phrases = device_phrases(CudaView((2, 3, 5)), INVENTORY)
    assert phrases == (
        "GPU 2 (0 MiB used), held by no process now",
        "GPU 3 (20480 MiB used), held by PID 77 (py\\x1b[2Jthon3, training.service)",
        "GPU 5, which NVML does not list now",
    )
    assert describe_device(1, phrases) == f"cuda:1 = {phrases[1]}"


def test_a_number_past_the_visible_gpus_or_an_unknown_numbering_is_said_not_used() -> None:
    """The unit's output never reaches another GPU: out of range is ignored, with a note."""
    phrases = device_phrases(CudaView((2,)), INVENTORY)
    assert describe_device(1, phrases) == (
        "cuda:1 names no GPU the unit sees (1 visible to it): ignored, the unit's output is "
        "not evidence for other GPUs"
    )
    assert device_phrases(CudaView(None, "mixed"), INVENTORY) is None
    assert describe_device(0, None, "mixed") == "cuda:0 cannot be placed: mixed"


def test_the_gate_maps_the_daemons_oom_device_through_the_units_own_environment(
    tmp_path: Path,
) -> None:
    """cuda:1 with CUDA_VISIBLE_DEVICES=2,3 is GPU 3; past the unit's GPUs, or no daemon: none.

    The snapshot is a real file read through the adapter, written as this (live) process, so
    the daemon counts as running.
    """
    from gpuguard.commands.gate import oom_gpu  # noqa: PLC0415 - the gate's mapping under test

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o755)
    found = inventory(nvml(*(gpu(i) for i in range(4))))
    environment = {"CUDA_VISIBLE_DEVICES": "2,3"}

    def snapshot(device: object, *, running: bool = True) -> None:
        identity = read_identity(os.getpid())
        written = replace(
            snapshots.QUIET,
            running=running,
            pid=os.getpid(),
            start_time=identity.start_time if identity else None,
            units={"sglang.service": snapshots.QUIET_UNIT},
        ).to_json()
        written["units"]["sglang.service"]["oom_device"] = device  # odd ones too
        write_json(daemonsnapshot.snapshot_path(runtime), written)

    def gpu_of(unit: str = "sglang.service") -> tuple[int, int] | None:
        return oom_gpu(daemonsnapshot.oom_device(runtime, unit), environment, found)

    assert gpu_of() is None  # no daemon
    snapshot(1)
    assert gpu_of() == (1, 3)
    assert gpu_of("other.service") is None
    snapshot(1, running=False)
    assert gpu_of() is None  # a stopped daemon's opinion is history
    for device in (2, -1, True, "1", None, 10**30):
        snapshot(device)
        assert gpu_of() is None
