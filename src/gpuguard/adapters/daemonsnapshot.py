"""The daemon's snapshot (``runtime_dir/daemon.json``) as the status and gate commands read it.

daemon/publishing.py writes it in a root-only directory; ``core.snapshot.parse`` reads it whole or
says why it cannot: status reports an unreadable snapshot (a daemon older or newer than this
gpuguard, a field missing), the gate then acts as without a daemon. What the gate acts on (Xids,
the device of an out-of-memory line) counts only while the process that wrote it is alive: a
dead daemon's opinion is history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.adapters import files, procfs, state
from gpuguard.core.snapshot import SNAPSHOT_FILE, DaemonView, Problem, Snapshot, Unreadable, parse
from gpuguard.core.values import ProcessIdentity
from gpuguard.core.xid.faults import from_records
from gpuguard.core.xid.stuck import claims_from_snapshot

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.core.snapshot import UnitSnapshot
    from gpuguard.core.xid.faults import XidFault
    from gpuguard.core.xid.stuck import XidClaim


def snapshot_path(runtime_dir: Path) -> Path:
    """Where the daemon writes its snapshot."""
    return runtime_dir / SNAPSHOT_FILE


def read(runtime_dir: Path) -> Snapshot | Unreadable | None:
    """The snapshot, why it cannot be read, or None when there is none (no daemon ever ran)."""
    try:
        data = files.read_file(snapshot_path(runtime_dir), max_bytes=state.READ_MAX)
    except FileNotFoundError:
        return None
    except PermissionError as err:
        return Unreadable(Problem.MALFORMED, f"{err.strerror or err} (run as root to read it)")
    except OSError as err:  # too large, or not safely root's (adapters/files.py)
        return Unreadable(Problem.MALFORMED, err.strerror or str(err))
    return parse(data)


def daemon_view(runtime_dir: Path) -> DaemonView:
    """The daemon's snapshot and whether the process that wrote it still lives."""
    found = read(runtime_dir)
    if not isinstance(found, Snapshot) or not found.running:
        return DaemonView.of(found)
    pid, start = found.pid, found.start_time
    alive = start is not None and procfs.read_identity(pid) == ProcessIdentity(pid, start)
    return DaemonView.of(found, alive=alive)


def lists_reset_xids(runtime_dir: Path, unit: str) -> bool:
    """Whether the snapshot lists reset-class Xids for ``unit``: cheap, for the gate's fast path."""
    found = read(runtime_dir)
    watch = found.units.get(unit) if isinstance(found, Snapshot) else None
    return bool(watch and watch.reset_xids)


def reset_xids(runtime_dir: Path, unit: str) -> tuple[XidFault, ...]:
    """The reset-class Xids the running daemon counts for ``unit`` (xid.faults)."""
    watch = _running_unit(runtime_dir, unit)
    return from_records(list(watch.reset_xids)) if watch else ()


def xid_claims(runtime_dir: Path) -> tuple[XidClaim, ...]:
    """The application Xids naming a process that the running daemon saw (xid.stuck)."""
    running = _running(runtime_dir)
    return tuple(claims_from_snapshot(running.xids)) if running else ()


def oom_device(runtime_dir: Path, unit: str) -> int | None:
    """The CUDA device of the unit's newest out-of-memory line, as the running daemon read it."""
    watch = _running_unit(runtime_dir, unit)
    device = watch.oom_device if watch else None
    return device if device is not None and device >= 0 else None


def _running(runtime_dir: Path) -> Snapshot | None:
    view = daemon_view(runtime_dir)
    return view.snapshot if view.state == "running" else None


def _running_unit(runtime_dir: Path, unit: str) -> UnitSnapshot | None:
    running = _running(runtime_dir)
    return running.units.get(unit) if running else None
