"""The host-wide breaker's file, ``runtime_dir/breaker.json`` (core.breaker is its one rule).

The daemon reads it before each recovery and writes it after, ``gpuguard breaker --close``
rewrites it closed, ``status`` and the metrics read it. It lives in /run: a reboot closes the
breaker, as it ends every run the breaker counted. Root's file in root's directory, replaced
atomically; a missing, unreadable, malformed or other boot's file reads as a fresh, closed one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.adapters import state
from gpuguard.core.breaker import BREAKER_FILE, BreakerState, parse

if TYPE_CHECKING:
    from pathlib import Path


def path(runtime_dir: Path) -> Path:
    """Where the breaker's state is."""
    return runtime_dir / BREAKER_FILE


def load(runtime_dir: Path, boot_id: str | None) -> BreakerState | None:
    """The breaker of this boot, None when there is none to read."""
    return parse(state.read_json(path(runtime_dir)), boot_id=boot_id)


def save(runtime_dir: Path, breaker: BreakerState) -> None:
    """Replace the file atomically (OSError when it cannot be written)."""
    state.write_json(path(runtime_dir), breaker.to_json())
