"""The gate with a container stopper, over the real /proc scan and an NVML stand-in.

Shared by the stand-in engine's tests and the real dockerd's. NVML is a stand-in (values, not
the library): a fake GPU file has no fake-NVML memory behind it, so the reading lists each live
holder of ``nvidia0`` with 1 GiB, as the driver lists a container's processes by host PID.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import builders
from builders import gpu, nvml

from gpuguard.adapters import procfs
from gpuguard.core.gate import GateOutcome, GateSettings, run_gate
from gpuguard.core.inventory import Inventory, build_inventory
from gpuguard.core.values import UnitProvenance

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.adapters.containerstop import ContainerStopper
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.values import ReapResult, ReapTarget

UNIT = "sglang.service"


class Log:
    """Collects the stopper's log lines (event, fields)."""

    def __init__(self) -> None:
        """No lines yet."""
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **kw: object) -> object:
        """Record an info line."""
        self.lines.append((event, kw))
        return None

    def warning(self, event: str, **kw: object) -> object:
        """Record a warning line."""
        self.lines.append((event, kw))
        return None

    def events(self) -> list[str]:
        """The events logged, in order."""
        return [event for event, _ in self.lines]


def gather_for(glob: str) -> Inventory:
    """An inventory from the real /proc scan and the NVML stand-in."""
    scan = procfs.scan_device_holders(glob)
    stand_in = gpu(0, *((p.identity.pid, 1024) for p in scan.processes))
    return build_inventory(nvml(stand_in), scan, 0)


def plan_request() -> PlanRequest:
    """The gate's plan request for the unit on GPU 0, as at its ExecStartPre=."""
    request = builders.plan_request(
        gpu_set=frozenset({0}), provenance=UnitProvenance(None, frozenset(), 0)
    )
    return replace(request, untouchable_pids=frozenset({os.getpid()}))


def gate(glob: str, stopper: ContainerStopper, timeout_s: float = 5.0) -> GateOutcome:
    """One gate run with the stopper; the process reaper must never be called."""

    def no_reap(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        raise AssertionError(f"nothing in a container is signalled by the reaper: {targets}")

    return run_gate(
        GateSettings(plan_request(), 0, timeout_s, poll_s=0.05),
        lambda: gather_for(glob),
        no_reap,
        time.monotonic,
        time.sleep,
        containers=stopper,
    )
