"""The v1 reserve: learned from idle siblings, bounded, configured when known (pure)."""

from __future__ import annotations

from builders import process, v1_gpu

from gpuguard.core.baseline import LEARNED_CAP_DIVISOR, apply, learn
from gpuguard.core.idle import is_idle
from gpuguard.core.inventory import build_inventory
from gpuguard.core.values import (
    MIB,
    GpuMemory,
    GpuReading,
    MemoryApi,
    NvmlHealth,
    NvmlReading,
    ProcScan,
    ReservedSource,
)

TOTAL = 81920 * MIB
MODEL = "NVIDIA A100-SXM4-80GB 81920 MiB"


def a100(index: int, used_mib: int, *, name: str = "NVIDIA A100-SXM4-80GB") -> GpuReading:
    """An A100 read through the v1 API (reserve included in used)."""
    return v1_gpu(index, used_mib, total_mib=TOTAL // MIB, name=name)


def reading(*gpus: GpuReading) -> NvmlReading:
    """An old driver's reading: process lists unknown."""
    return NvmlReading(NvmlHealth.DRIVER_TOO_OLD, "driver too old", "470.256.02", gpus)


def test_the_smallest_idle_sibling_teaches_the_reserve() -> None:
    """Four A100s idle at 563 MiB but one leaking 3000 MiB more: the reserve is 563 MiB."""
    nvml = reading(a100(0, 563), a100(1, 563 + 3000), a100(2, 570), a100(3, 563))
    learned = learn(build_inventory(nvml, ProcScan(()), 16 * MIB), {}, ())
    assert learned == {MODEL: 563 * MIB}
    inventory = build_inventory(apply(nvml, None, learned), ProcScan(()), 16 * MIB)
    assert [g.unattributed_bytes for g in inventory.gpus] == [0, 3000 * MIB, 0, 0]
    assert [is_idle(g.reading, 16 * MIB) for g in inventory.gpus] == [True, False, True, True]
    assert inventory.gpus[0].reading.memory is not None
    assert inventory.gpus[0].reading.memory.reserved_source is ReservedSource.LEARNED


def test_only_protected_holders_do_not_stop_learning() -> None:
    """nvidia-persistenced on GPU 0 holds no memory; a job on GPU 1 may: GPU 1 teaches nothing."""
    nvml = reading(a100(0, 600), a100(1, 500))
    persistenced = process(
        10,
        0,
        cgroup="/system.slice/nvidia-persistenced.service",
        comm="nvidia-persistenced",
        cmdline=("nvidia-persistenced",),
    )
    scan = ProcScan((persistenced, process(11, 1)))
    learned = learn(build_inventory(nvml, scan, 16 * MIB), {}, ("nvidia-persistenced",))
    assert learned == {MODEL: 600 * MIB}


def test_the_minimum_only_falls_and_is_bounded() -> None:
    """A later, lower idle reading lowers it; memory above total/32 is never learned."""
    cap_mib = TOTAL // LEARNED_CAP_DIVISOR // MIB
    nvml = reading(a100(0, cap_mib + 1))
    assert learn(build_inventory(nvml, ProcScan(()), 0), {}, ()) == {}
    known = {MODEL: 600 * MIB}
    assert learn(build_inventory(reading(a100(0, 700)), ProcScan(()), 0), known, ()) == known
    assert learn(build_inventory(reading(a100(0, 550)), ProcScan(()), 0), known, ()) == {
        MODEL: 550 * MIB
    }


def test_a_forged_learned_value_is_capped() -> None:
    """A state file claiming 40 GiB reserved takes out at most total/32."""
    nvml = apply(reading(a100(0, 40000)), None, {MODEL: 40000 * MIB})
    memory = nvml.gpus[0].memory
    assert memory is not None
    assert memory.reserved_bytes == TOTAL // LEARNED_CAP_DIVISOR
    assert not is_idle(nvml.gpus[0], 16 * MIB)


def test_configured_wins_and_v2_is_untouched() -> None:
    """v1_reserved_mib applies to every v1 GPU; v2 readings keep NVML's own figures."""
    v2 = GpuReading(index=1, memory=GpuMemory(TOTAL, 3 * MIB, 500 * MIB, MemoryApi.V2))
    nvml = apply(reading(a100(0, 563), v2), 560 * MIB, {MODEL: 100 * MIB})
    first, second = nvml.gpus
    assert first.memory == GpuMemory(
        TOTAL, 3 * MIB, 560 * MIB, MemoryApi.V1, ReservedSource.CONFIGURED
    )
    assert second == v2


def test_without_any_estimate_nothing_is_guessed() -> None:
    """Nothing configured or learned: the reading stays raw, unattributed stays unknown."""
    nvml = apply(reading(a100(0, 563)), None, {})
    assert nvml.gpus[0].memory is not None
    assert nvml.gpus[0].memory.reserved_bytes is None
    assert build_inventory(nvml, ProcScan(()), 16 * MIB).gpus[0].unattributed_bytes is None
