"""The daemon's snapshot (``runtime_dir/daemon.json``) as the status and gate commands read it.

Root writes it (daemon/loop.py) in a root-only directory; it is still read field by field, a
wrong shape giving "nothing there", never an error. What the gate acts on (Xids, the device of
an out-of-memory line) counts only while the process that wrote it is alive: a dead daemon's
opinion is history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuguard.adapters import state

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.core.status import DaemonView
    from gpuguard.core.xidfaults import XidFault
    from gpuguard.core.xidstuck import XidClaim

SNAPSHOT = "daemon.json"


def daemon_view(runtime_dir: Path) -> DaemonView:
    """The daemon's snapshot and whether the process that wrote it still lives."""
    from gpuguard.adapters import procfs  # noqa: PLC0415 - see the module doc
    from gpuguard.core.status import DaemonView  # noqa: PLC0415
    from gpuguard.core.values import ProcessIdentity  # noqa: PLC0415

    snapshot = state.read_json(runtime_dir / SNAPSHOT)
    if not isinstance(snapshot, dict):
        return DaemonView("absent", {})
    if not snapshot.get("running"):
        return DaemonView("stopped", snapshot)
    pid, start = snapshot.get("pid"), snapshot.get("start_time")
    alive = (
        isinstance(pid, int)
        and isinstance(start, int)
        and procfs.read_identity(pid) == ProcessIdentity(pid, start)
    )
    return DaemonView("running" if alive else "dead", snapshot)


def lists_reset_xids(runtime_dir: Path, unit: str) -> bool:
    """Whether the snapshot lists reset-class Xids for ``unit``: cheap, for the gate's fast path."""
    return bool(_unit(state.read_json(runtime_dir / SNAPSHOT), unit).get("reset_xids"))


def reset_xids(runtime_dir: Path, unit: str) -> tuple[XidFault, ...]:
    """The reset-class Xids the running daemon counts for ``unit`` (xidfaults)."""
    from gpuguard.core.xidfaults import from_records  # noqa: PLC0415

    return from_records(_unit(_running(runtime_dir), unit).get("reset_xids"))


def xid_claims(runtime_dir: Path) -> tuple[XidClaim, ...]:
    """The application Xids naming a process that the running daemon saw (xidstuck)."""
    from gpuguard.core.xidstuck import claims_from_snapshot  # noqa: PLC0415

    xid = _running(runtime_dir).get("xid")
    return tuple(claims_from_snapshot(xid.get("recent") if isinstance(xid, dict) else None))


def oom_device(runtime_dir: Path, unit: str) -> int | None:
    """The CUDA device of the unit's newest out-of-memory line, as the running daemon read it."""
    device = _unit(_running(runtime_dir), unit).get("oom_device")
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        return None
    return device


def _running(runtime_dir: Path) -> dict[str, Any]:
    view = daemon_view(runtime_dir)
    return dict(view.snapshot) if view.state == "running" else {}


def _unit(snapshot: object, unit: str) -> dict[str, Any]:
    units = snapshot.get("units") if isinstance(snapshot, dict) else None
    watch = units.get(unit) if isinstance(units, dict) else None
    return watch if isinstance(watch, dict) else {}
