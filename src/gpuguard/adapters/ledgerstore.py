"""The provenance ledger's file: ``runtime_dir/ledger.json``, root's, through the safe writer.

The daemon writes it (core.ledger says what it holds); the root gate server and ``reap`` read
it for their plans. It lives in /run: processes do not outlive a boot, and neither does it.
Mode 0600: it names processes of every watched unit, and only root acts on it. A file that is
missing, not safely ours (files.read_file) or malformed reads as an empty ledger: no evidence.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from gpuguard.adapters import files, state
from gpuguard.core.ledger import Ledger, UnitLedger

if TYPE_CHECKING:
    from pathlib import Path


def ledger_path(runtime_dir: Path) -> Path:
    """Where the ledger lives."""
    return runtime_dir / "ledger.json"


def load(runtime_dir: Path) -> tuple[Ledger, tuple[str, ...]]:
    """The ledger on disk and what of it was skipped (empty and no problem when there is none)."""
    path = ledger_path(runtime_dir)
    if not path.exists():
        return Ledger(), ()
    return Ledger.parse(state.read_json(path))


def save(runtime_dir: Path, ledger: Ledger) -> None:
    """Replace the file atomically (root-only: 0600), compact and within the read limit.

    Should the whole outgrow what a reader accepts, the oldest runs go first: a file too large
    to read would lose every unit's evidence at once.
    """
    while len(encoded := json.dumps(ledger.to_json(), separators=(",", ":"))) >= state.READ_MAX:
        # Runs are of a size, near enough: drop the share that is too much, and one more.
        ledger = ledger.without_oldest(
            len(ledger.runs) * (len(encoded) - state.READ_MAX) // len(encoded) + 1
        )
    files.write_file(ledger_path(runtime_dir), encoded.encode(), mode=0o600)


def evidence(runtime_dir: Path, unit: str) -> UnitLedger:
    """What the ledger recorded of ``unit``'s runs, and of every other unit's, for a plan."""
    return load(runtime_dir)[0].for_unit(unit)
