"""The state store: small JSON documents written atomically through the files adapter.

A reader (``gpuguard status``) never sees half a file, and a crash mid-write loses at most the
newest record. Files are readable by operators (0644 whatever the umask); command lines in them
are already redacted, and every record is size-bounded (records.py) before it is kept.
"""

from __future__ import annotations

import errno
import json
import os
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import files
from gpuguard.core.records import bound_record

if TYPE_CHECKING:
    from pathlib import Path

GATE_HISTORY = 20
# A state document is at most GATE_HISTORY bounded records; anything larger is not ours.
READ_MAX = 4 * 1024 * 1024


def write_json(path: Path, document: object, *, mode: int = 0o644, durable: bool = False) -> None:
    """Replace ``path`` with ``document`` atomically, creating its directory if needed.

    ``durable``: fsync (persistent state under state_dir); /run's files need not survive a crash.
    """
    data = json.dumps(document, indent=1, sort_keys=True) + "\n"
    files.write_file(path, data.encode(), mode=mode, durable=durable)


def check_writable(directory: Path) -> None:
    """Create ``directory`` if it is missing; OSError unless this process may write there."""
    os.close(files.open_directory(directory, create_mode=0o755))
    if not os.access(directory, os.W_OK, effective_ids=True):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))


def read_json(path: Path) -> Any:  # noqa: ANN401 - JSON is untyped until the caller checks it
    """The document at ``path``, or None when it is missing, unreadable or not safely ours."""
    try:
        return json.loads(files.read_file(path, max_bytes=READ_MAX))
    except (OSError, ValueError, RecursionError):  # deep nesting raises RecursionError
        return None


def unit_state_path(state_dir: Path, unit: str) -> Path:
    """Where a unit's recovery history, planner state and learned starts survive reboots.

    The daemon writes it; ``gpuguard doctor`` reads the learned starts from it.
    """
    return state_dir / "units" / f"{unit}.json"


def gate_log_path(runtime_dir: Path, unit: str) -> Path:
    """Where a unit's recent gate decisions live."""
    return runtime_dir / "gate" / f"{unit}.json"


def record_gate_decision(runtime_dir: Path, unit: str, decision: dict[str, Any]) -> None:
    """Append one size-bounded decision to the unit's history, keeping the newest GATE_HISTORY."""
    path = gate_log_path(runtime_dir, unit)
    history = read_json(path)
    entries = history if isinstance(history, list) else []
    recent = entries[-GATE_HISTORY + 1 :]
    kept = [bound_record(entry) for entry in recent if isinstance(entry, dict)]
    write_json(path, [*kept, bound_record(decision)])


def gate_decisions(runtime_dir: Path, unit: str) -> list[dict[str, Any]]:
    """The unit's recorded gate decisions, oldest first (empty when none or unreadable)."""
    history = read_json(gate_log_path(runtime_dir, unit))
    return (
        [entry for entry in history if isinstance(entry, dict)] if isinstance(history, list) else []
    )
