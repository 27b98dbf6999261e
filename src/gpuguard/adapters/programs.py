"""Programs root runs (systemctl, journalctl, ldconfig): by absolute path, in a fixed environment.

gpuguard's root side can be started from inside a watched unit, whose ``PATH`` may name a
directory the service user writes (a virtualenv): a PATH lookup there runs the user's
``systemctl`` as root. So a program is found only in the system's own directories, and runs
with an environment of two fixed variables, nothing inherited: no ``LD_PRELOAD``, no
``LD_LIBRARY_PATH``, no ``SYSTEMD_*`` or pager settings of the unit reach it.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

SYSTEM_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
ENVIRONMENT = {"PATH": ":".join(SYSTEM_DIRS), "LANG": "C.UTF-8"}


def resolve(name: str) -> str:
    """The absolute path of ``name``: as given when absolute, else from SYSTEM_DIRS only.

    Raises FileNotFoundError (an OSError, like a failed exec) when no system directory has it.
    """
    if name.startswith("/"):
        return name
    if "/" in name or not name:
        raise FileNotFoundError(errno.ENOENT, "neither an absolute path nor a plain name", name)
    for directory in SYSTEM_DIRS:
        candidate = f"{directory}/{name}"
        if os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError(errno.ENOENT, f"not found in {', '.join(SYSTEM_DIRS)}", name)


def argv(command: Sequence[str]) -> list[str]:
    """``command`` with its program resolved (see resolve)."""
    return [resolve(command[0]), *command[1:]]


def run(
    command: Sequence[str],
    *,
    timeout: float,
    **kwargs: Any,  # noqa: ANN401 - subprocess.run's own keywords
) -> subprocess.CompletedProcess[Any]:
    """subprocess.run of ``command`` by absolute path in ENVIRONMENT (exit codes never raise)."""
    return subprocess.run(argv(command), env=ENVIRONMENT, timeout=timeout, check=False, **kwargs)


def popen(command: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:  # noqa: ANN401
    """subprocess.Popen of ``command`` by absolute path in ENVIRONMENT."""
    return subprocess.Popen(argv(command), env=ENVIRONMENT, **kwargs)
