"""The release log's file (``runtime_dir/releases.json``): appended by every reaper, read by all.

The daemon, the gate server (a process per request) and the operator's ``reap`` each append
the releases they measured (``core.releaselog``); ``status``, ``explain`` and the metrics read
them. Two writers at once are serialised by an exclusive flock of ``releases.lock`` beside it,
so neither loses the other's record; a writer that cannot have the lock in time, or cannot
write, raises OSError and its caller says so (the measurement is still printed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.adapters import files, state
from gpuguard.core.releaselog import Logged, appended, parse

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gpuguard.core.release import Release

_LOCK_WAIT_S = 2.0
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def log_path(runtime_dir: Path) -> Path:
    """Where the release log lives (0644: operators read it)."""
    return runtime_dir / "releases.json"


def read(runtime_dir: Path) -> tuple[Logged, ...]:
    """The logged releases, oldest first (empty when none or unreadable)."""
    return parse(state.read_json(log_path(runtime_dir)))


def record(runtime_dir: Path, records: Iterable[Logged]) -> None:
    """Append ``records`` under the lock; OSError (TimeoutError too) when that fails."""
    new = list(records)
    if not new:
        return
    with files.exclusive_lock(runtime_dir / "releases.lock", wait_s=_LOCK_WAIT_S):
        path = log_path(runtime_dir)
        state.write_json(path, appended(state.read_json(path), new))


def logged(
    releases: Iterable[tuple[Release, float]], *, by: str, unit: str | None
) -> tuple[Logged, ...]:
    """Each (release, monotonic moment of the reading that showed it) as a record, dated now."""
    boot = boot_id()
    wall_minus_mono = time.time() - time.monotonic()
    return tuple(
        Logged(release, by, unit, at_s + wall_minus_mono, boot, at_s if boot else None)
        for release, at_s in releases
    )


def boot_id() -> str | None:
    """The running boot's ID as the journal writes ``_BOOT_ID`` (no dashes); None: unreadable."""
    try:
        text = _BOOT_ID.read_bytes().decode("ascii").strip()  # no codec module to import
    except (OSError, ValueError):
        return None
    return text.replace("-", "") or None
