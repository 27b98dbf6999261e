"""Signal the stale GPU holders the policy chose, through the signals adapter and their pidfds.

What is at risk: a signal that reaches an unrelated process which reused a PID, a supervisor
that respawns a worker we just killed, and an endless retry against a process the kernel will
not let die. So each process is pinned with a pidfd *before* its identity (PID + start time)
is checked again, and every later signal goes through that pidfd (earlyoom: "Open the pidfd
before calling kill()"); parents are signalled before their children; SIGTERM goes to all,
one shared grace, SIGKILL to the survivors, one bounded wait; whoever is still alive is
reported as unkillable with its state and kernel wait (a GPU reset or reboot is needed only
when that wait is in the NVIDIA driver; elsewhere it is dying), never retried. EPERM is
reported once, never retried. Every signal sent is one log line.
"""

from __future__ import annotations

import math
import os
import select
import signal
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpuguard.adapters import procfs, signals
from gpuguard.adapters.logs import get_logger
from gpuguard.core.driverwait import in_driver
from gpuguard.core.escaping import escape
from gpuguard.core.protection import never_signal_pid
from gpuguard.core.values import ProcessIdentity, ReapOutcome, ReapResult, ReapTarget

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from pathlib import Path

    from gpuguard.core.logger import Logger


@dataclass(slots=True)
class _Tracked:
    """The reaper's bookkeeping for one target while it works (internal, mutable)."""

    target: ReapTarget
    fd: int | None = None
    state_before: str | None = None
    signals: list[str] = field(default_factory=list)
    outcome: ReapOutcome | None = None
    detail: str | None = None
    last_signal_s: float | None = None

    def result(self) -> ReapResult:
        """The frozen result of a settled target."""
        if self.outcome is None:
            raise RuntimeError(f"internal error: PID {self.target.identity.pid} is not settled")
        signals = tuple(self.signals)
        return ReapResult(self.target, self.outcome, signals, self.detail, self.last_signal_s)

    def pidfd(self) -> int:
        """The open pidfd of a pinned target that is not settled yet."""
        if self.fd is None:
            raise RuntimeError(f"internal error: PID {self.target.identity.pid} is not pinned")
        return self.fd


_WARN = frozenset({ReapOutcome.UNKILLABLE, ReapOutcome.PERMISSION_DENIED, ReapOutcome.ERROR})


def signal_order(targets: Sequence[ReapTarget]) -> tuple[ReapTarget, ...]:
    """Return ``targets`` parents first: a target's ancestors among the targets come before it.

    Targets are sorted by their depth in the parent links among themselves, then by input
    order. A ppid cycle (impossible among live processes, possible in stale data) is broken
    where the walk from the earliest target in it first closes the loop.
    """
    index_of = {target.identity.pid: index for index, target in enumerate(targets)}
    depth: dict[int, int] = {}
    for start in range(len(targets)):
        path: list[int] = []
        on_path: set[int] = set()
        current: int | None = start
        while current is not None and current not in depth and current not in on_path:
            path.append(current)
            on_path.add(current)
            current = index_of.get(targets[current].ppid)
        level = -1 if current is None or current in on_path else depth[current]
        for index in reversed(path):
            level += 1
            depth[index] = level
    ranked = sorted(range(len(targets)), key=lambda index: (depth[index], index))
    return tuple(targets[index] for index in ranked)


def _refuse(targets: Sequence[ReapTarget]) -> None:
    """Raise ValueError for a target no policy may choose: PID 1/2, ourselves, our ancestors.

    A PID listed with two start times is a contradictory plan and refused too.

    Our ancestry is read from the real /proc whatever ``proc_root`` says: ``os.getpid()`` and
    pidfd_open both speak this PID namespace. The gate runs inside the watched unit's cgroup,
    so its own parents are exactly the processes a careless plan would include.
    """
    spared = procfs.lineage(os.getpid())
    seen: dict[int, int] = {}
    for target in targets:
        pid = target.identity.pid
        what = f"PID {pid} ({escape(target.command, 200)})"
        if reason := never_signal_pid(pid, spared):
            raise ValueError(f"refusing to signal {what}: {reason}")
        if seen.setdefault(pid, target.identity.start_time) != target.identity.start_time:
            raise ValueError(f"refusing to reap {what}: it is listed with two start times")


def _fields(target: ReapTarget) -> dict[str, object]:
    """The log fields that identify a target to an operator."""
    return {
        "pid": target.identity.pid,
        "start_time": target.identity.start_time,
        "command": target.command,
        "unit": target.unit,
        "reason": target.reason,
    }


def _settle(item: _Tracked, outcome: ReapOutcome, detail: str | None, log: Logger) -> None:
    """Record the outcome of a target, close its pidfd, and log its one outcome line."""
    item.outcome = outcome
    item.detail = detail
    if item.fd is not None:
        os.close(item.fd)
        item.fd = None
    emit = log.warning if outcome in _WARN else log.info
    emit(
        "reap outcome",
        outcome=str(outcome),
        signals=list(item.signals),
        detail=detail,
        **_fields(item.target),
    )


def _has_exited(fd: int) -> bool:
    """Whether the process behind a pidfd has exited (the pidfd polls readable)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _pin(item: _Tracked, proc_root: Path, log: Logger) -> None:
    """Open a pidfd on the target, then check that it still is the process the policy chose.

    Order matters: the target was seen before this call, so if the identity read *after*
    pidfd_open matches, the pidfd names that process and no later PID reuse can redirect it.
    """
    target = item.target
    pid = target.identity.pid
    try:
        item.fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _settle(item, ReapOutcome.GONE, "no such process", log)
        return
    except OSError as error:  # ENOSYS before Linux 5.3, EMFILE, …
        _settle(item, ReapOutcome.ERROR, f"pidfd_open failed: {error.strerror}", log)
        return
    stat = procfs.read_stat(pid, proc_root=proc_root)
    if stat is None:
        _settle(item, ReapOutcome.GONE, "no such process", log)
    elif stat.start_time != target.identity.start_time:
        detail = f"PID {pid} now names a process started at {stat.start_time} ({escape(stat.comm)})"
        _settle(item, ReapOutcome.PID_REUSED, detail, log)
    elif stat.kernel_thread:
        name = escape(stat.comm)
        raise ValueError(f"refusing to signal PID {pid} ({name}): it is a kernel thread")
    elif _has_exited(item.fd):
        _settle(item, ReapOutcome.GONE, "already exited (a zombie its parent has not reaped)", log)
    else:
        item.state_before = stat.state


def _send(item: _Tracked, sig: signal.Signals, log: Logger) -> bool:
    """Send ``sig`` through the pidfd; False when the process had already been reaped (ESRCH).

    EPERM and other refusals settle the target: it gets no further signal.
    """
    sent_s = time.monotonic()  # before the send: the process may exit before this thread runs on
    try:
        signals.send_pinned(item.pidfd(), sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        detail = f"{sig.name} refused (EPERM): run gpuguard as root or as the process's user"
        _settle(item, ReapOutcome.PERMISSION_DENIED, detail, log)
        return True
    except OSError as error:
        _settle(item, ReapOutcome.ERROR, f"{sig.name} failed: {error.strerror}", log)
        return True
    item.signals.append(sig.name)
    item.last_signal_s = sent_s
    log.info("signal", signal=sig.name, **_fields(item.target))
    return True


def _wait(items: list[_Tracked], seconds: float, outcome: ReapOutcome, log: Logger) -> None:
    """Wait up to ``seconds`` for the pidfds of ``items`` to poll readable (their exit)."""
    poller = select.poll()
    by_fd: dict[int, _Tracked] = {}
    for item in items:
        if item.outcome is None and item.fd is not None:
            poller.register(item.fd, select.POLLIN)
            by_fd[item.fd] = item
    deadline = time.monotonic() + seconds
    while by_fd:
        remaining = deadline - time.monotonic()
        ready = poller.poll(max(0, math.ceil(remaining * 1000)))
        for fd, _events in ready:
            poller.unregister(fd)
            _settle(by_fd.pop(fd), outcome, None, log)
        if remaining <= 0:
            break


def _unkillable_detail(item: _Tracked, kill_wait_s: float, proc_root: Path) -> str:
    """Say where a survivor waits, and what that means: only a wait in the driver needs a reset.

    A process SIGKILLed in an uninterruptible wait elsewhere (a FUSE or NFS read, a disk) is
    dying: the signal takes effect when the wait ends (core.driverwait).
    """
    pid = item.target.identity.pid
    stat = procfs.read_stat(pid, proc_root=proc_root)
    state = "?" if stat is None else stat.state
    wait = procfs.read_kernel_wait(pid, proc_root=proc_root)
    where = wait[0] if wait else "unknown"
    before = f" (state {item.state_before} before SIGTERM)" if item.state_before == "D" else ""
    said = f"state {state}, wchan {where}{before}; still alive {kill_wait_s:g} s after SIGKILL"
    driver = in_driver(wait)
    if driver is not None:
        return f"{said}; stuck in the NVIDIA driver ({driver}): a GPU reset or reboot is needed"
    if wait:
        return (
            f"{said}; dying: its wait is outside the NVIDIA driver, and SIGKILL takes effect "
            "when that wait ends (no GPU reset helps)"
        )
    return (
        f"{said}; where it waits is not visible (root reads it): if it stays, `gpuguard status` "
        "as root tells a wait in the NVIDIA driver (a GPU reset) from one that ends by itself"
    )


def _terminate(
    tracked: list[_Tracked], grace_s: float, kill_wait_s: float, proc_root: Path, log: Logger
) -> None:
    """Pin, TERM, wait, KILL, wait, and settle every target (given in signal order)."""
    # Pin every target before the first signal, so that a child whose parent takes it down on
    # SIGTERM is still ours to account for (exited), not an unexplained "gone".
    for item in tracked:
        _pin(item, proc_root, log)
    for item in tracked:
        if item.outcome is None and not _send(item, signal.SIGTERM, log):
            _settle(item, ReapOutcome.GONE, "exited before SIGTERM", log)
    _wait(tracked, grace_s, ReapOutcome.EXITED, log)
    for item in tracked:
        # Through the still-open pidfd: a process that exited meanwhile cannot be confused with
        # a newcomer that took its PID, and ESRCH means it has been reaped.
        if item.outcome is None and (
            _has_exited(item.pidfd()) or not _send(item, signal.SIGKILL, log)
        ):
            _settle(item, ReapOutcome.EXITED, None, log)
    _wait(tracked, kill_wait_s, ReapOutcome.KILLED, log)
    for item in tracked:
        if item.outcome is None:
            detail = _unkillable_detail(item, kill_wait_s, proc_root)
            _settle(item, ReapOutcome.UNKILLABLE, detail, log)


KILL_WAIT_S = 5.0
"""How long reap waits for the survivors of its SIGKILL, unless told otherwise."""


def reap(
    targets: Iterable[ReapTarget],
    *,
    grace_s: float = 10.0,
    kill_wait_s: float = KILL_WAIT_S,
    proc_root: Path = procfs.PROC,
    logger: Logger | None = None,
) -> tuple[ReapResult, ...]:
    """Terminate ``targets`` safely and return one result per target, in the order given.

    SIGTERM goes to every target (parents first), then one shared grace of ``grace_s``,
    SIGKILL to the survivors, a wait of at most ``kill_wait_s``: the whole call is bounded by
    about ``grace_s + kill_wait_s`` even for processes stuck in state D. Raises ValueError,
    before anything is sent, for PID 1/2, gpuguard itself or its ancestors, a kernel thread, or
    one PID with two start times: the policy should have refused those. A process listed twice
    is reaped once. There is no dry run here: a command that only plans never calls the reaper.
    """
    given = tuple(targets)
    if grace_s < 0 or kill_wait_s < 0:
        raise ValueError(f"grace_s and kill_wait_s must not be negative: {grace_s}, {kill_wait_s}")
    _refuse(given)
    if not given:
        return ()  # nothing to do; and structlog stays unimported on the gate's fast path
    log = get_logger() if logger is None else logger
    # A process listed twice (it holds two GPUs, say) is signalled once; both share the outcome.
    unique: dict[ProcessIdentity, ReapTarget] = {}
    for target in given:
        unique.setdefault(target.identity, target)
    # Parents first: a supervisor (SGLang's launcher, a torchrun) that is still alive when its
    # worker dies may start a new worker, which would hold the GPU and escape this plan.
    order = signal_order(tuple(unique.values()))
    tracked = [_Tracked(target) for target in order]
    try:
        _terminate(tracked, grace_s, kill_wait_s, proc_root, log)
    finally:
        for item in tracked:
            if item.fd is not None:
                os.close(item.fd)
                item.fd = None
    by_identity = {item.target.identity: item.result() for item in tracked}
    return tuple(replace(by_identity[target.identity], target=target) for target in given)
