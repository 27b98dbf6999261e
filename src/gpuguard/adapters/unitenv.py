"""The GPU-relevant part of a unit's real environment, as its gate last saw it (adapter).

The gate learns a unit's ``CUDA_VISIBLE_DEVICES`` from the unit's own process (its real
environment, ``EnvironmentFile=`` values included). The daemon's recoveries must use the same
GPU set, but ``systemctl show -p Environment`` knows only ``Environment=`` lines, and during a
restart loop the unit has no main process to read. So the root gate records the variables that
decide the set under ``runtime_dir/unit-env/`` and the daemon reads them back — trusting a
record only when root wrote it and nobody else can change it.
"""

from __future__ import annotations

import stat
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from gpuguard.adapters import state

if TYPE_CHECKING:
    from pathlib import Path

#: What gpuset.resolve_gpu_set reads from an environment.
GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def record_path(runtime_dir: Path, unit: str) -> Path:
    """Where the unit's record lives (``unit`` is a validated service name)."""
    return runtime_dir / "unit-env" / f"{unit}.json"


def record(runtime_dir: Path, unit: str, environment: dict[str, str], pid: int) -> None:
    """Remember the GPU variables of ``unit``'s environment (read from process ``pid``)."""
    document = {
        "unit": unit,
        "environment": {k: environment[k] for k in GPU_VARIABLES if k in environment},
        "pid": pid,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    state.write_json(record_path(runtime_dir, unit), document)


def recorded(runtime_dir: Path, unit: str) -> dict[str, str] | None:
    """The GPU variables the gate last saw for ``unit``; None when there is no trusted record."""
    path = record_path(runtime_dir, unit)
    try:
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        return None
    document = state.read_json(path)
    if not isinstance(document, dict) or document.get("unit") != unit:
        return None
    environment = document.get("environment")
    if not isinstance(environment, dict):
        return None
    return {
        key: value
        for key, value in environment.items()
        if key in GPU_VARIABLES and isinstance(value, str)
    }
