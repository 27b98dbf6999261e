"""A forked child that runs one NVML snapshot, and that the caller abandons past a deadline.

After an Xid 45 class fault the driver can leave an NVML call blocked in the kernel forever
(docs/facts.md §2.4): a thread in an ioctl cannot be cancelled, a child process can be left
behind. The abandoned ones are reaped later, so none stays a zombie.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import time
from typing import TYPE_CHECKING

from gpuguard.adapters import signals
from gpuguard.core.values import NvmlHealth, NvmlReading

if TYPE_CHECKING:
    from collections.abc import Callable


def run_abandonable(
    work: Callable[[], NvmlReading],
    timeout_s: float,
    on_timeout: Callable[[float], NvmlReading],
) -> NvmlReading:
    """Run ``work`` in a forked child and return its result, or ``on_timeout`` past the deadline.

    A thread blocked in an ioctl cannot be cancelled; a child process can be abandoned. The
    result travels back pickled over a pipe from our own child, never from outside input.
    """
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child; its result is what the parent checks
        os.close(read_end)
        status = 0
        try:
            payload = pickle.dumps(work())
        except BaseException as err:  # noqa: BLE001 - anything must become a reading, not a hang
            payload = pickle.dumps(
                NvmlReading(NvmlHealth.ERROR, f"NVML query failed: {type(err).__name__}: {err}")
            )
            status = 1
        with contextlib.suppress(OSError):
            _write_all(write_end, payload)
        os._exit(status)
    os.close(write_end)
    try:
        answer = _read_until(read_end, time.monotonic() + timeout_s)
    finally:
        os.close(read_end)
    if answer is None:
        # SIGKILL may not take while the child is blocked in the driver; it is reaped later by
        # _reap_abandoned, never waited for here.
        signals.kill_own_child(child)
        _abandoned.add(child)
        _reap_abandoned()
        return on_timeout(timeout_s)
    os.waitpid(child, 0)
    _reap_abandoned()
    try:
        result = pickle.loads(answer)  # noqa: S301 - bytes from our own forked child
    except (pickle.UnpicklingError, EOFError, ValueError) as err:
        return NvmlReading(NvmlHealth.ERROR, f"NVML worker died before answering ({err})")
    if not isinstance(result, NvmlReading):
        return NvmlReading(NvmlHealth.ERROR, "NVML worker answered nonsense")
    return result


_abandoned: set[int] = set()


def _reap_abandoned() -> None:
    """Collect earlier timed-out children that have since died, so none stays a zombie."""
    for pid in list(_abandoned):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _abandoned.discard(pid)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Read to EOF, or return None when the deadline passes first."""
    chunks: list[bytes] = []
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
