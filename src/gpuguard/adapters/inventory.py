"""Gather one inventory from the world: NVML first, then /proc, merged by the pure core."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard.adapters import containerprobe, nvml, procfs, state
from gpuguard.core import baseline
from gpuguard.core.inventory import Inventory, build_inventory
from gpuguard.core.values import MIB, MemoryApi

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.config import Settings
    from gpuguard.core.values import NvmlReading, ProcScan

V1_RESERVED_FILE = "v1-reserved.json"


def gather(settings: Settings, reading: NvmlReading | None = None) -> Inventory:
    """Read NVML (bounded by its deadline) unless a fresh reading is given, then walk /proc.

    The full walk, not only the PIDs NVML names: a worker left behind by a dead parent holds the
    device but is named by nobody, and status must show it. PIDs NVML names that the walk missed
    are then read one by one: without root a live job of another user is merely uninspectable.
    """
    if reading is None:
        reading = nvml.read_gpus(settings.nvml_timeout_s, settings.nvml_library)
    scan = procfs.scan_device_holders(settings.device_glob)
    # A process a budget cut short that showed no device file was only named: read it in full
    # when NVML lists it.
    found = {f.identity.pid for f in scan.processes if f.device_files or f.partial is None}
    listed = {p.pid for gpu in reading.gpus for p in gpu.processes} - found
    if listed:
        extra = procfs.read_listed(listed, settings.device_glob)
        again = {facts.identity.pid for facts in extra.processes}
        kept = (facts for facts in scan.processes if facts.identity.pid not in again)
        scan = replace(
            scan,
            processes=tuple(sorted((*kept, *extra.processes), key=lambda f: f.identity.pid)),
            hidden=extra.hidden,
        )
    threshold = settings.idle_threshold_mib * MIB
    if any(g.memory is not None and g.memory.api is MemoryApi.V1 for g in reading.gpus):
        reading = _without_v1_reserve(settings, reading, scan)
    return build_inventory(reading, scan, threshold, containerprobe.probe())


def _without_v1_reserve(settings: Settings, reading: NvmlReading, scan: ProcScan) -> NvmlReading:
    """Learn the v1 reserve from this reading (root only), remember it, take it out of ``used``.

    Without root another user's job is invisible in /proc, so other users only use what root
    learned and stored in state_dir.
    """
    path = settings.state_dir / V1_RESERVED_FILE
    known = _load_learned(path)
    learned = known
    if os.geteuid() == 0:
        raw = build_inventory(
            reading, scan, settings.idle_threshold_mib * MIB, containerprobe.probe()
        )
        learned = baseline.learn(raw, known, settings.protected_processes, time.time())
    if learned != known:
        with contextlib.suppress(OSError):
            state.write_json(path, {model: _document(value) for model, value in learned.items()})
    configured = None if settings.v1_reserved_mib is None else settings.v1_reserved_mib * MIB
    return baseline.apply(reading, configured, learned)


def _document(learned: baseline.Learned) -> dict[str, object]:
    return {"bytes": learned.bytes, "first_s": learned.first_s, "confirmed": learned.confirmed}


def _load_learned(path: Path) -> dict[str, baseline.Learned]:
    """The learned reserves (GPU model → reserve); anything malformed is dropped, not trusted.

    A bare number is a reserve an older gpuguard learned once, at an unknown time: one occasion,
    which the next plausible reading confirms.
    """
    document = state.read_json(path)
    if not isinstance(document, dict):
        return {}
    learned = {}
    for model, value in document.items():
        if not isinstance(model, str):
            continue
        if type(value) is int and value >= 0:
            learned[model] = baseline.Learned(value, 0.0)
        elif isinstance(value, dict):
            found, first, confirmed = (
                value.get("bytes"),
                value.get("first_s"),
                value.get("confirmed"),
            )
            if (
                type(found) is int
                and found >= 0
                and isinstance(first, (int, float))
                and math.isfinite(first)
                and isinstance(confirmed, bool)
            ):
                learned[model] = baseline.Learned(found, float(first), confirmed)
    return learned
