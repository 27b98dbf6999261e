"""Which connections to the gate server come from their unit's control process (adapter).

The server's parent gives a watched unit's request slot and its one waiting place only to the
process systemd runs for the unit's ``ExecStartPre=``/``ExecStopPost=`` (its ``ControlPID=``);
any other process of the unit's cgroup is told so in one line before anything is forked for it
(core/gate/control.py). The parent never waits for systemd: it spawns ``systemctl show UNIT
--property=ControlPID --property=SubState`` (one per unit at a time, ASK_LIMIT_S each, by
absolute path in programs' fixed environment, its own process group), reads the answer when
poll() says it is there, and meanwhile keeps the unit's undecided connections, at most
PENDING_PER_UNIT. The last answer per unit decides at once every process that started before
it was asked; a process started since waits for the next answer, asked as soon as one is due.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from gpuguard.adapters import programs, signals
from gpuguard.adapters.procfs import clock_ticks_per_second, read_stat
from gpuguard.core.gate.control import ControlAnswer, is_control
from gpuguard.core.unitstate import UnitState, parse_show

if TYPE_CHECKING:
    from collections.abc import Callable

#: One ask may take this long; then its systemctl is killed and systemd counts as not answering.
ASK_LIMIT_S = 10.0
#: Undecided connections kept per unit while systemd is asked; more are told the server is busy.
#: Only processes started since the last answer wait (any other is decided at once), so
#: crowding the control process out takes this many fresh processes connecting within one
#: systemctl round trip, again and again.
PENDING_PER_UNIT = 64
#: ``systemctl show`` of two properties prints a few dozen bytes; more is no answer.
_ANSWER_MAX_BYTES = 16384
_PROPERTIES = ("ControlPID", "SubState")

T = TypeVar("T")


def systemctl_show(unit: str) -> list[str]:
    """The ask: systemd's ControlPID= and SubState= of ``unit``."""
    return programs.argv(["systemctl", "show", unit, *(f"--property={p}" for p in _PROPERTIES)])


@dataclass
class _Ask:
    """One systemctl in flight for a unit."""

    unit: str
    pid: int
    fd: int
    asked_ticks: int
    deadline: float
    out: bytearray = field(default_factory=bytearray)


class ControlAsks(Generic[T]):
    """The parent's asks and the connections waiting for them (``T``: what a connection is)."""

    def __init__(self, ask: Callable[[str], list[str]] = systemctl_show) -> None:
        """``ask``: the argv that prints ``systemctl show``'s lines for a unit."""
        self._ask = ask
        self._answers: dict[str, ControlAnswer] = {}
        self._asks: dict[int, _Ask] = {}  # by the read end of its pipe
        self._pending: dict[str, list[tuple[T, int, int]]] = {}  # item, pid, start ticks
        self._hz = clock_ticks_per_second()
        self.poller: select.poll | None = None
        self.unreaped: set[int] = set()
        """Spawned systemctl processes not yet reaped (the parent's reap() reaps them)."""

    def started(self, pid: int, pidfd: int) -> int | None:
        """When ``pid`` (pinned by ``pidfd``) started, in ``/proc/PID/stat`` ticks; None: gone.

        Read by PID, then the pin checked: alive after the read, the PID was still its own.
        """
        stat = read_stat(pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        return None if stat is None or poller.poll(0) else stat.start_time

    def decide(self, unit: str, pid: int, started: int) -> bool | None:
        """From the unit's last answer: whether ``pid`` is its control process; None: ask."""
        answer = self._answers.get(unit)
        return None if answer is None else is_control(answer, pid, started)

    def pend(self, unit: str, item: T, pid: int, started: int) -> bool:
        """Keep ``item`` for the unit's next answer, asking if none is on its way; False: full."""
        waiting = self._pending.setdefault(unit, [])
        if len(waiting) >= PENDING_PER_UNIT:
            return False
        waiting.append((item, pid, started))
        if not any(ask.unit == unit for ask in self._asks.values()):
            self._spawn(unit)
        return True

    def owns(self, fd: int) -> bool:
        """Whether ``fd`` is the pipe of an ask (poll() reported it)."""
        return fd in self._asks

    def read(self, fd: int) -> list[tuple[T, bool]]:
        """Read what the ask on ``fd`` printed; at its end, the connections its answer decides."""
        ask = self._asks[fd]
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return []
        except OSError:
            chunk = b""
        if chunk and len(ask.out) + len(chunk) <= _ANSWER_MAX_BYTES:
            ask.out += chunk
            return []
        complete = not chunk
        return self._finish(ask, self._state(ask) if complete else None)

    def expire(self, now: float) -> list[tuple[T, bool]]:
        """End the asks past ASK_LIMIT_S (systemd did not answer): what that decides."""
        decided: list[tuple[T, bool]] = []
        for ask in [a for a in self._asks.values() if now >= a.deadline]:
            decided += self._finish(ask, None)
        return decided

    def deadline(self) -> float | None:
        """The earliest ask deadline (monotonic), None when nothing is asked."""
        return min((ask.deadline for ask in self._asks.values()), default=None)

    def drop(self) -> list[T]:
        """Every waiting connection (the server is stopping); the asks run out on their own."""
        items = [item for waiting in self._pending.values() for item, _, _ in waiting]
        self._pending.clear()
        return items

    def _state(self, ask: _Ask) -> UnitState | None:
        """The answer's UnitState, None when systemctl printed nothing to read."""
        text = ask.out.decode("utf-8", "backslashreplace")
        state = parse_show(ask.unit, text)
        return state if state.sub_state is not None else None

    def _finish(self, ask: _Ask, state: UnitState | None) -> list[tuple[T, bool]]:
        """Close the ask; decide the unit's waiting connections by its answer (None: none)."""
        del self._asks[ask.fd]
        if self.poller is not None:
            self.poller.unregister(ask.fd)
        os.close(ask.fd)
        if ask.pid in self.unreaped:  # not reaped yet, so the group is still its: none lingers
            signals.signal_own_group(ask.pid, signal.SIGKILL)
        if state is None:
            state = UnitState(ask.unit, error="systemctl show gave no answer")
        answer = ControlAnswer(ask.asked_ticks, state)
        self._answers[ask.unit] = answer
        decided: list[tuple[T, bool]] = []
        undecided: list[tuple[T, int, int]] = []
        for item, pid, started in self._pending.pop(ask.unit, []):
            verdict = is_control(answer, pid, started)
            if verdict is None:
                undecided.append((item, pid, started))
            else:
                decided.append((item, verdict))
        if undecided:
            self._pending[ask.unit] = undecided
            self._spawn(ask.unit)
        return decided

    def _spawn(self, unit: str) -> None:
        """Start the unit's ask (never waits); a failed spawn is an answer of its own."""
        asked = time.clock_gettime_ns(time.CLOCK_BOOTTIME) * self._hz // 1_000_000_000
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            argv = self._ask(unit)
            pid = os.posix_spawn(
                argv[0],
                argv,
                programs.ENVIRONMENT,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, write_fd, 1),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setpgroup=0,
            )
        except OSError:
            os.close(read_fd)
            pid = 0
        finally:
            os.close(write_fd)
        if not pid:  # decided as systemd not answering, on the next turn (no recursion)
            read_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        else:
            self.unreaped.add(pid)
        self._asks[read_fd] = _Ask(unit, pid, read_fd, asked, time.monotonic() + ASK_LIMIT_S)
        if self.poller is not None:
            self.poller.register(read_fd, select.POLLIN)

    def reaped(self, pid: int) -> None:
        """The parent reaped ``pid`` (an ask's systemctl, or not ours)."""
        self.unreaped.discard(pid)
