"""Find out whether gpuguard runs inside a container (adapter; the judgement is containment.py).

Asked once per process: a container does not become a host while gpuguard runs, and the gate
gathers an inventory ten times a second.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from gpuguard.adapters import files, programs
from gpuguard.core.containment import Containment, judge

MARKER = Path("/run/systemd/container")
_MARKER_LIMIT = 4096
_DETECT_TIMEOUT_S = 5.0


@functools.cache
def probe() -> Containment:
    """Where this process runs (cached for its life)."""
    return judge(
        marker=_marker(),
        detect_virt=_detect_virt(),
        proc_namespace=_namespace_inode("/proc/1/ns/pid"),
        own_namespace=_namespace_inode("/proc/self/ns/pid"),
    )


def _marker() -> str | None:
    """The marker /run/systemd/container, written by the container manager; None if absent.

    Read through files (root-owned, not writable by others), so a tenant cannot plant it.
    """
    try:
        return files.read_file(MARKER, max_bytes=_MARKER_LIMIT).decode("ascii", "replace")
    except OSError:
        return None


def _detect_virt() -> str | None:
    """``systemd-detect-virt --container``'s answer ("none" outside one); None if it failed."""
    try:
        done = programs.run(
            ["systemd-detect-virt", "--container"],
            timeout=_DETECT_TIMEOUT_S,
            capture_output=True,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    output: bytes = done.stdout
    return output.decode("ascii", "replace")[:_MARKER_LIMIT]


def _namespace_inode(path: str) -> int | None:
    """The inode of a PID namespace link; None where it may not be read (another user's)."""
    try:
        return Path(path).stat().st_ino
    except OSError:
        return None
