"""Start ``gpu_hold.py`` processes from tests and make sure none outlives the test.

``HolderSpawner`` is what the ``spawn_holder`` fixture returns. Each holder runs in its own
session, so its process group also contains the children it forks (and a child it leaves
behind); cleanup SIGKILLs that group while the holder is still our unreaped child (its PID, the
group id, cannot have been reused), then every recorded PID whose start time still matches.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

from fakestate import GPU_HOLD

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

HoldKind = Literal["compute", "graphics", "mps"]


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def process_gone(pid: int) -> bool:
    """True when ``pid`` has exited: no such process, or a zombie nobody reaped yet.

    A zombie holds no file descriptors and no GPU context; where PID 1 does not reap orphans
    (some containers) exited orphans stay zombies forever, so they count as gone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> bool:
    """Wait until every PID is gone (see ``process_gone``); False on timeout."""
    waiting = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        waiting = {pid for pid in waiting if not process_gone(pid)}
        if not waiting:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


@dataclass(frozen=True)
class Holder:
    """A running ``gpu_hold.py``: what its JSON line said, plus its ``Popen``."""

    pid: int
    children: tuple[int, ...]
    allocs: tuple[Path, ...]
    watcher: int
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)

    def terminate(self) -> None:
        """Send SIGTERM to the holder (not its children), if it has not been reaped."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL to the holder alone: its children survive, reparented."""
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float = 10.0) -> int:
        """Wait for the holder itself to exit; its return code (negative: killed by signal)."""
        return self.process.wait(timeout)

    def released(self) -> bool:
        """Whether the watcher has marked every allocation of this holder released."""
        return all("released_at_ms=" in path.read_text(encoding="ascii") for path in self.allocs)

    def wait_released(self, timeout: float = 10.0) -> None:
        """Wait until the watcher has marked the allocations released (every holder gone)."""
        deadline = time.monotonic() + timeout
        while not self.released():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"allocations of holder {self.pid} not released in {timeout}s")
            time.sleep(0.01)

    def _signal(self, signum: signal.Signals) -> None:
        if self.process.poll() is None:  # not reaped yet: the PID is still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    """One line from a pipe, or what arrived before EOF or the deadline."""
    data = b""
    fd = stream.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data


class HolderSpawner:
    """Starts ``gpu_hold.py`` holders; ``cleanup()`` kills every process they started."""

    def __init__(self, python: str = sys.executable) -> None:
        """Use ``python`` to run the holder script (any Python >= 3.11 works)."""
        self._python = python
        self._holders: list[Holder] = []
        self._others: list[tuple[int, int | None]] = []  # (pid, start time) of non-children

    def __call__(
        self,
        state: Path,
        *,
        gpus: Sequence[int] = (0,),
        mib: int = 1000,
        kind: HoldKind = "compute",
        name: str | None = None,
        children: int = 0,
        child_name: str | None = None,
        leave_child: bool = False,
        child_invocation: str | None = None,
        ignore_sigterm: bool = False,
        drain: float | None = None,
        no_usage: bool = False,
        timeout: float = 10.0,
    ) -> Holder:
        """Start a holder and return once it has allocated (its JSON line arrived)."""
        argv = [
            self._python,
            str(GPU_HOLD),
            "--state",
            str(state),
            "--gpus",
            ",".join(str(gpu) for gpu in gpus),
            "--mib",
            str(mib),
            "--kind",
            kind,
            "--children",
            str(children),
        ]
        argv += ["--name", name] if name is not None else []
        argv += ["--child-name", child_name] if child_name is not None else []
        argv += ["--drain", str(drain)] if drain is not None else []
        argv += ["--leave-child"] if leave_child else []
        argv += ["--child-invocation", child_invocation] if child_invocation is not None else []
        argv += ["--ignore-sigterm"] if ignore_sigterm else []
        argv += ["--no-usage"] if no_usage else []
        with tempfile.TemporaryFile() as stderr:
            process = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True
            )
            assert process.stdout is not None  # a PIPE, narrowed for mypy
            line = _read_line(process.stdout, time.monotonic() + timeout)
            process.stdout.close()
            try:
                info = json.loads(line)
            except ValueError:
                self._kill_group(process)
                stderr.seek(0)
                message = stderr.read().decode(errors="replace")
                raise RuntimeError(
                    f"gpu_hold.py did not report within {timeout}s "
                    f"(exit {process.returncode}): {line!r}\n{message}"
                ) from None
        holder = Holder(
            pid=int(info["pid"]),
            children=tuple(int(pid) for pid in info["children"]),
            allocs=tuple(Path(path) for path in info["allocs"]),
            watcher=int(info["watcher"]),
            process=process,
        )
        self._holders.append(holder)
        for pid in (*holder.children, holder.watcher):
            self._others.append((pid, start_time(pid)))
        return holder

    @property
    def holders(self) -> tuple[Holder, ...]:
        """Every holder started so far."""
        return tuple(self._holders)

    @staticmethod
    def _kill_group(process: subprocess.Popen[bytes]) -> None:
        """SIGKILL the holder's process group, then reap the holder."""
        if process.returncode is None:
            # Not reaped yet, so its PID, which is the group id, cannot have been reused.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)

    def cleanup(self, timeout: float = 10.0) -> None:
        """SIGKILL every process any holder started and wait until all are gone."""
        for holder in self._holders:
            self._kill_group(holder.process)
        for pid, started in self._others:
            if started is not None and start_time(pid) == started:  # still the same process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        leftovers = [pid for pid, _ in self._others]
        if not wait_gone(leftovers, timeout):
            alive = [pid for pid in leftovers if not process_gone(pid)]
            raise RuntimeError(f"holder processes survived SIGKILL: {alive}")
        self._holders.clear()
        self._others.clear()
