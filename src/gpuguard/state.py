"""The state store: small JSON documents written atomically (temp file + rename).

A reader (``gpuguard status``) never sees half a file, and a crash mid-write loses at most the
newest record. Files are readable by operators; command lines in them are already redacted.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

GATE_HISTORY = 20


def write_json(path: Path, document: object) -> None:
    """Replace ``path`` with ``document`` atomically, creating its directory if needed."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    # One writer per process at a time; the PID keeps concurrent writers (two gates) apart.
    # Not tempfile: importing it costs the gate's fast path ~5 ms.
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temp.open("w", encoding="utf-8") as out:
            json.dump(document, out, indent=1, sort_keys=True)
            out.write("\n")
        temp.chmod(0o644)
        temp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def read_json(path: Path) -> Any:  # noqa: ANN401 - JSON is untyped until the caller checks it
    """The document at ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def gate_log_path(runtime_dir: Path, unit: str) -> Path:
    """Where a unit's recent gate decisions live."""
    return runtime_dir / "gate" / f"{unit}.json"


def record_gate_decision(runtime_dir: Path, unit: str, decision: dict[str, Any]) -> None:
    """Append one decision to the unit's history, keeping the newest GATE_HISTORY."""
    path = gate_log_path(runtime_dir, unit)
    history = read_json(path)
    entries = history if isinstance(history, list) else []
    write_json(path, [*entries, decision][-GATE_HISTORY:])


def gate_decisions(runtime_dir: Path, unit: str) -> list[dict[str, Any]]:
    """The unit's recorded gate decisions, oldest first (empty when none or unreadable)."""
    history = read_json(gate_log_path(runtime_dir, unit))
    return (
        [entry for entry in history if isinstance(entry, dict)] if isinstance(history, list) else []
    )
