"""Start a gate server the way systemd starts a socket-activated service with Accept=no.

sd_listen_fds(3): the listening socket is fd 3 of the server, ``LISTEN_FDS=1`` and
``LISTEN_PID`` its own PID (set between fork and exec, here by re-exec'ing this script). Used
by the integration tests and bench/gate.py in place of gpuguard-gate.socket.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import IO


def listen(path: Path) -> socket.socket:
    """A listening socket at ``path`` that every user may connect to (0666, as the unit's)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o666)
    listener.listen(128)
    return listener


def activate(
    listener: socket.socket,
    argv: Sequence[str],
    env: Mapping[str, str],
    log: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Run ``argv`` with ``listener`` as its fd 3 and the LISTEN_* variables naming it."""
    fd = listener.fileno()
    return subprocess.Popen(
        [sys.executable, __file__, str(fd), *argv],
        pass_fds=(fd,),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )


def await_sigterm_handler(process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Wait until ``process`` catches SIGTERM (its /proc status's SigCgt), or has ended.

    A server terminated before it set its handler dies of the signal instead of stopping
    cleanly (exit 0): a test that skips at once must not make its fixture's check fail.
    """
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{process.pid}/status").read_text()
            caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
            if int(caught.split()[1], 16) & bit:
                return
        time.sleep(0.01)


if __name__ == "__main__":
    os.dup2(int(sys.argv[1]), 3)  # dup2 leaves the copy inheritable
    if int(sys.argv[1]) != 3:
        os.close(int(sys.argv[1]))
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
    os.execvp(sys.argv[2], sys.argv[2:])  # noqa: S606 - the test's own argv, as systemd execs
