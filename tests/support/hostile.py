"""Processes that hold NVIDIA device files under names and command lines an attacker chose.

Anyone who can open ``/dev/nvidia*`` (mode 0666 by default) becomes a GPU holder that gpuguard
reads, redacts and prints: these processes do exactly that, with a ``comm`` set through
``prctl(PR_SET_NAME)`` (any byte but NUL, newlines included), optionally an argv area overwritten
with NULs (``/proc/PID/cmdline`` then reads empty, so gpuguard falls back to the name), and any
extra arguments (up to the kernel's 128 KiB per argument).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

# Reads its settings from the environment (the argv area may be blanked), opens the devices,
# renames itself, blanks its argv if asked, says "1" and sleeps.
_CODE = """
import ctypes, os, sys, time
files = [open(p) for p in os.environ["HOSTILE_DEVICES"].split(os.pathsep)]
libc = ctypes.CDLL(None)
name = os.environ.get("HOSTILE_COMM")
if name is not None:
    libc.prctl(15, ctypes.c_char_p(name.encode("utf-8", "surrogateescape")), 0, 0, 0)
if os.environ.get("HOSTILE_BLANK") == "1":
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rpartition(b")")[2].split()
    start, end = int(fields[45]), int(fields[46])
    ctypes.memset(start, 0, end - start)
print(1, flush=True)
time.sleep(600)
"""


@dataclass
class HostileProcesses:
    """Starts hostile device holders; ``stop()`` kills and reaps them all."""

    processes: list[subprocess.Popen[bytes]]

    def __call__(
        self,
        state: Path,
        *minors: int,
        comm: str | None = None,
        blank_cmdline: bool = False,
        args: Sequence[str] = (),
    ) -> int:
        """Start one holding ``state/dev/nvidia<minor>`` for each minor; its PID once ready."""
        env = dict(os.environ)
        env["HOSTILE_DEVICES"] = os.pathsep.join(str(state / "dev" / f"nvidia{m}") for m in minors)
        env["HOSTILE_BLANK"] = "1" if blank_cmdline else "0"
        if comm is not None:
            env["HOSTILE_COMM"] = comm
        process = subprocess.Popen(
            [sys.executable, "-c", _CODE, *args], stdout=subprocess.PIPE, env=env
        )
        self.processes.append(process)
        assert process.stdout is not None  # a PIPE
        if process.stdout.readline() != b"1\n":
            raise RuntimeError(f"hostile holder {process.pid} did not start")
        process.stdout.close()
        return process.pid

    def stop(self) -> None:
        """Kill and reap every process started."""
        while self.processes:
            process = self.processes.pop()
            process.kill()
            process.wait()
