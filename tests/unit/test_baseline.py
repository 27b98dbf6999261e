"""The v1 reserve: learned from idle siblings, plausible, confirmed twice, configured (pure)."""

from __future__ import annotations

from datetime import datetime, timezone

from builders import STATUS_CONTEXT, process, v1_gpu

from gpuguard.core.baseline import (
    CONFIRM_AFTER_S,
    PLAUSIBLE_MAX_BYTES,
    Learned,
    apply,
    learn,
)
from gpuguard.core.idle import is_idle
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.status.judge import assess
from gpuguard.core.status.text import render_text
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
H200 = "NVIDIA H200 143771 MiB"
T0 = 1_800_000_000.0
LATER = T0 + CONFIRM_AFTER_S


def a100(index: int, used_mib: int, *, name: str = "NVIDIA A100-SXM4-80GB") -> GpuReading:
    """An A100 read through the v1 API (reserve included in used)."""
    return v1_gpu(index, used_mib, total_mib=TOTAL // MIB, name=name)


def reading(*gpus: GpuReading) -> NvmlReading:
    """An old driver's reading: process lists unknown."""
    return NvmlReading(NvmlHealth.DRIVER_TOO_OLD, "driver too old", "470.256.02", gpus)


def learned_from(nvml: NvmlReading, known: dict[str, Learned], at: float) -> dict[str, Learned]:
    """What root learns from this reading with nobody holding a GPU."""
    return learn(build_inventory(nvml, ProcScan(()), 16 * MIB), known, (), at)


def test_the_smallest_idle_sibling_teaches_the_reserve_confirmed_on_a_second_occasion() -> None:
    """Four A100s idle at 563 MiB, one leaking 3000 MiB more: 563 MiB, confirmed a minute on."""
    nvml = reading(a100(0, 563), a100(1, 563 + 3000), a100(2, 570), a100(3, 563))
    first = learned_from(nvml, {}, T0)
    assert first == {MODEL: Learned(563 * MIB, T0)}
    shown = build_inventory(apply(nvml, None, first), ProcScan(()), 16 * MIB)
    assert not any(is_idle(g.reading, 16 * MIB) for g in shown.gpus)
    assert shown.gpus[0].reading.memory is not None
    assert shown.gpus[0].reading.memory.reserved_source is ReservedSource.UNCONFIRMED
    again = learned_from(nvml, first, LATER)
    assert again == {MODEL: Learned(563 * MIB, T0, confirmed=True)}
    inventory = build_inventory(apply(nvml, None, again), ProcScan(()), 16 * MIB)
    assert [g.unattributed_bytes for g in inventory.gpus] == [0, 3000 * MIB, 0, 0]
    assert [is_idle(g.reading, 16 * MIB) for g in inventory.gpus] == [True, False, True, True]
    assert inventory.gpus[0].reading.memory is not None
    assert inventory.gpus[0].reading.memory.reserved_source is ReservedSource.LEARNED


def test_a_second_reading_too_soon_or_much_lower_does_not_confirm() -> None:
    """A reading within the minute is the same occasion; a much lower one starts over."""
    first = learned_from(reading(a100(0, 900)), {}, T0)
    soon = learned_from(reading(a100(0, 900)), first, T0 + 5)
    assert soon == {MODEL: Learned(900 * MIB, T0)}
    lower = learned_from(reading(a100(0, 560)), first, LATER)
    assert lower == {MODEL: Learned(560 * MIB, LATER)}


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
    learned = learn(build_inventory(nvml, scan, 16 * MIB), {}, ("nvidia-persistenced",), T0)
    assert learned == {MODEL: Learned(600 * MIB, T0)}


def test_the_minimum_only_falls_and_is_bounded_by_what_drivers_reserve() -> None:
    """A later, lower idle reading lowers it; memory above the plausible bound is never learned."""
    assert learned_from(reading(a100(0, PLAUSIBLE_MAX_BYTES // MIB + 1)), {}, T0) == {}
    known = {MODEL: Learned(600 * MIB, T0, confirmed=True)}
    assert learned_from(reading(a100(0, 700)), known, LATER) == known
    assert learned_from(reading(a100(0, 550)), known, LATER) == {
        MODEL: Learned(550 * MIB, T0, confirmed=True)
    }


def test_a_forged_learned_value_is_capped() -> None:
    """A state file claiming 40 GiB reserved takes out at most the plausible bound."""
    nvml = apply(reading(a100(0, 40000)), None, {MODEL: Learned(40000 * MIB, T0, confirmed=True)})
    memory = nvml.gpus[0].memory
    assert memory is not None
    assert memory.reserved_bytes == PLAUSIBLE_MAX_BYTES
    assert not is_idle(nvml.gpus[0], 16 * MIB)


def test_configured_wins_and_v2_is_untouched() -> None:
    """v1_reserved_mib applies to every v1 GPU; v2 readings keep NVML's own figures."""
    v2 = GpuReading(index=1, memory=GpuMemory(TOTAL, 3 * MIB, 500 * MIB, MemoryApi.V2))
    nvml = apply(
        reading(a100(0, 563), v2), 560 * MIB, {MODEL: Learned(100 * MIB, T0, confirmed=True)}
    )
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


def test_every_gpu_leaking_3000_mib_the_first_time_is_not_called_idle() -> None:
    """v1 API, four H200s each holding 3,000 MiB more than the reserve when gpuguard first looks.

    3,512 MiB is more than any driver reserves: nothing is learned, and status says it cannot
    tell idle from busy rather than "OK - all 4 GPUs idle"; twice changes nothing.
    """
    nvml = reading(*(v1_gpu(i, 3512) for i in range(4)))
    known: dict[str, Learned] = {}
    for at in (T0, LATER, LATER + 3600):
        known = learned_from(nvml, known, at)
    assert known == {}
    inventory = build_inventory(apply(nvml, None, known), ProcScan(()), 16 * MIB)
    report = assess(inventory, STATUS_CONTEXT, datetime(2026, 12, 1, tzinfo=timezone.utc))
    assert report.level is not Level.OK
    assert "idle" not in report.headline
    assert report.idle_gpus == frozenset()
    assert "no estimate of it exists yet" in render_text(report)
    assert H200 not in known


def test_an_unconfirmed_reserve_is_shown_as_such_and_is_no_idle() -> None:
    """One occasion only: the estimate is shown as unconfirmed, with a warning, and not idle."""
    nvml = reading(*(v1_gpu(i, 530) for i in range(2)))
    once = learned_from(nvml, {}, T0)
    inventory = build_inventory(apply(nvml, None, once), ProcScan(()), 16 * MIB)
    report = assess(inventory, STATUS_CONTEXT, datetime(2026, 12, 1, tzinfo=timezone.utc))
    text = render_text(report)
    assert report.level is Level.WARNING
    assert report.idle_gpus == frozenset()
    assert "(estimated: 530 MiB reserved, unconfirmed)" in text
    assert "not confirmed yet" in text
