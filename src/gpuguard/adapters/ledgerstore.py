"""The provenance ledger's file: ``runtime_dir/ledger.json``, root's, through the safe writer.

The daemon writes it (core.ledger says what it holds); the root gate server and ``reap`` read
it for their plans. It lives in /run: processes do not outlive a boot, and neither does it.
Mode 0600: it names processes of every watched unit, and only root acts on it. A file that is
missing, not safely ours (files.read_file) or malformed reads as an empty ledger: no evidence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.adapters import state
from gpuguard.core.ledger import Ledger

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.core.values import ProcessIdentity


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
    """Replace the file atomically (root-only: 0600)."""
    state.write_json(ledger_path(runtime_dir), ledger.to_json(), mode=0o600)


def claims(runtime_dir: Path, unit: str) -> frozenset[tuple[ProcessIdentity, str]]:
    """What the ledger recorded of ``unit``'s runs, for a plan's provenance."""
    return load(runtime_dir)[0].claims(unit)
