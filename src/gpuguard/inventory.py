"""Gather one inventory from the world: NVML first, then /proc, merged by the pure core."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard import nvml, procfs
from gpuguard.holders import Inventory, build_inventory
from gpuguard.values import MIB

if TYPE_CHECKING:
    from gpuguard.config import Settings
    from gpuguard.values import NvmlReading


def gather(settings: Settings, reading: NvmlReading | None = None) -> Inventory:
    """Read NVML (bounded by its deadline) unless a fresh reading is given, then walk /proc.

    The full walk, not the NVML-first shortcut: a worker left behind by a dead parent holds the
    device but is named by nobody, and status must show it. PIDs NVML names that the walk missed
    are then read one by one: without root a live job of another user is merely uninspectable.
    """
    if reading is None:
        reading = nvml.read_gpus(settings.nvml_timeout_s)
    scan = procfs.scan_device_holders(settings.device_glob)
    found = {facts.identity.pid for facts in scan.processes}
    listed = {p.pid for gpu in reading.gpus for p in gpu.processes} - found
    if listed:
        extra = procfs.read_listed(listed, settings.device_glob)
        scan = replace(
            scan,
            processes=tuple(
                sorted((*scan.processes, *extra.processes), key=lambda f: f.identity.pid)
            ),
            hidden=extra.hidden,
        )
    return build_inventory(reading, scan, settings.idle_threshold_mib * MIB)
