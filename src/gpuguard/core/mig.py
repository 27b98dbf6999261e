"""MIG mode: where gpuguard's whole-GPU judgement does not hold, and what it says instead (pure).

With MIG mode on, NVML's memory figures and process lists for the whole GPU are aggregates over
every MIG instance, other tenants' included, and only for a privileged caller (nvml.h, the
notes on nvmlDeviceGetMemoryInfo and the process lists; docs/facts.md §2.5). A start that waits
on them, or a reap chosen by them, could hold one tenant's unit hostage to another's instance.
Until gpuguard reads per-instance figures, a MIG-enabled GPU is left out of every unit's set:
never waited on, never reaped from, and said so - never worse than without gpuguard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gpuguard.core.values import GpuReading

UNJUDGED = (
    "its whole-GPU memory and process lists add up every MIG instance, other tenants' too, "
    "so gpuguard cannot tell whether it is idle or whose memory it holds"
)
"""What gpuguard cannot judge on a MIG-enabled GPU, for status and doctor."""


def mig_on(reading: GpuReading) -> bool:
    """Whether MIG mode is in effect on this GPU now (unknown reads as off, as before MIG)."""
    return reading.mig is not None and reading.mig.current


def mig_indices(readings: Iterable[GpuReading]) -> frozenset[int]:
    """The NVML indices of the GPUs with MIG mode on."""
    return frozenset(r.index for r in readings if mig_on(r))


def indices_text(indices: Iterable[int]) -> str:
    """``0,2`` for GPUs 0 and 2."""
    return ",".join(str(i) for i in sorted(indices))


def pending_change(reading: GpuReading) -> str | None:
    """A MIG mode change that waits for the next GPU reset, in words; None when there is none."""
    mode = reading.mig
    if mode is None or mode.current == mode.pending:
        return None
    return f"MIG mode turns {'on' if mode.pending else 'off'} at the next GPU reset"
