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
    from collections.abc import Callable, Sequence

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


def run(  # noqa: PLR0913 - subprocess.run's keywords that gpuguard uses, each typed
    command: Sequence[str],
    *,
    timeout: float,
    capture_output: bool = False,
    text: bool = False,
    errors: str | None = None,
    stdin: int | None = None,
) -> subprocess.CompletedProcess[Any]:
    """subprocess.run of ``command`` by absolute path in ENVIRONMENT (exit codes never raise).

    Each keyword is spelled out, none passed through ``**kwargs``: mypy then checks every call
    against the oldest Python the package supports (3.10), whose subprocess lacks some.
    """
    return subprocess.run(
        argv(command),
        env=ENVIRONMENT,
        timeout=timeout,
        check=False,
        capture_output=capture_output,
        text=text,
        errors=errors,
        stdin=stdin,
    )


def popen(  # noqa: PLR0913 - subprocess.Popen's keywords that gpuguard uses, each typed
    command: Sequence[str],
    *,
    stdin: int,
    stdout: int,
    stderr: int,
    start_new_session: bool = False,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.Popen[bytes]:
    """subprocess.Popen of ``command`` by absolute path in ENVIRONMENT (keywords as for run)."""
    return subprocess.Popen(
        argv(command),
        env=ENVIRONMENT,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=start_new_session,
        preexec_fn=preexec_fn,  # noqa: PLW1509 - the caller's is async-signal-safe (journal.py)
    )
