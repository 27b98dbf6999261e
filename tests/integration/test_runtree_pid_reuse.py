"""The ledger's walk of a run never records a PID reused on the way as the process it was (root).

Each test gives a process's PID to a new process (ns_last_pid) at the very moment the walk
(runtree.run_processes, runtree.descendants) takes the next step, through a profile hook on the
walk's own function: real processes, real /proc, and nothing of the walk replaced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import CGROUP2
from pidreuse import on_entry, reuse_pid

from gpuguard.adapters import procfs, runtree

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

    from clirunner import UnitCgroups

    from gpuguard.core.values import ProcessIdentity

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reusing a PID needs root (ns_last_pid)")

SLEEP = ("sleep", "600")

RUN = "b" * 32
"""The run a recorded process was recorded in."""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, each in a session of its own: killed with it at the end."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def start(started: list[subprocess.Popen[bytes]], *argv: str) -> ProcessIdentity:
    """Start ``argv`` in a session of its own; its identity."""
    process = subprocess.Popen(argv, start_new_session=True)
    started.append(process)
    identity = procfs.read_identity(process.pid)
    assert identity is not None
    return identity


def replace_by(
    started: list[subprocess.Popen[bytes]], identity: ProcessIdentity, *argv: str
) -> subprocess.Popen[bytes]:
    """Kill the process, reap it, and give its PID to a new ``argv`` (started a tick later).

    Identity is the start time in clock ticks (10 ms): a PID reused within its first process's
    tick is beyond it (docs/security.md), so the newcomer starts at least two ticks later.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    while time.clock_gettime(time.CLOCK_BOOTTIME) * ticks < identity.start_time + 2:
        time.sleep(0.005)
    [process] = [p for p in started if p.pid == identity.pid]
    started.remove(process)
    process.kill()
    process.wait()
    newcomer = reuse_pid(identity.pid, argv)
    started.append(newcomer)
    return newcomer


def test_a_recorded_process_whose_pid_is_reused_as_the_walk_begins_is_not_recorded(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """A recorded process alive when the walk was asked for, whose PID is then reused: left out.

    Before, the walk checked that the recorded process was alive, then read the PID afresh: the
    newcomer was recorded as a descendant of the run.
    """
    recorded = start(started, *SLEEP)
    newcomers: list[subprocess.Popen[bytes]] = []

    def reuse(_frame: FrameType) -> bool:
        newcomers.append(replace_by(started, recorded, *SLEEP))
        return True

    with on_entry(runtree.descendants.__code__, reuse):
        seen = runtree.run_processes(None, {recorded: RUN})
    assert [p.pid for p in newcomers] == [recorded.pid]  # the PID now names the newcomer
    assert seen == ()


def test_a_child_listed_under_a_parent_whose_pid_was_reused_is_not_recorded(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """The parent's PID goes to a new process with a child of its own as its children are read.

    The newcomer's child names the old parent's PID as its parent: before, that was enough.
    """
    recorded = start(started, *SLEEP)
    newcomers: list[subprocess.Popen[bytes]] = []

    def reuse(frame: FrameType) -> bool:
        if frame.f_locals.get("pid") != recorded.pid:
            return False
        newcomer = replace_by(started, recorded, "sh", "-c", "sleep 600 & wait")
        newcomers.append(newcomer)
        children = Path(f"/proc/{newcomer.pid}/task/{newcomer.pid}/children")
        deadline = time.monotonic() + 30
        while not children.read_bytes().split():
            assert time.monotonic() < deadline, "the newcomer's child never started"
            time.sleep(0.01)
        return True

    with on_entry(runtree._children_of.__code__, reuse):
        seen = runtree.run_processes(None, {recorded: RUN})
    assert [p.pid for p in newcomers] == [recorded.pid]
    assert [(w.process.pid, w.process.start_time) for w in seen] == [
        (recorded.pid, recorded.start_time)
    ]


def test_a_pid_of_the_cgroup_reused_outside_it_before_it_is_read_is_not_recorded(
    started: list[subprocess.Popen[bytes]], unit_cgroups: UnitCgroups
) -> None:
    """A PID listed in the unit's cgroup.procs that goes to a process outside the unit: left out.

    Its neighbour in the cgroup is recorded. Before, whatever the PID named when read was.
    """
    unit = "pid-reuse-walk.service"
    inside, neighbour = start(started, *SLEEP), start(started, *SLEEP)
    unit_cgroups.move(inside.pid, unit)
    unit_cgroups.move(neighbour.pid, unit)
    newcomers: list[subprocess.Popen[bytes]] = []

    def reuse(_frame: FrameType) -> bool:
        newcomers.append(replace_by(started, inside, *SLEEP))
        return True

    group = f"/system.slice/{unit}"
    with on_entry(runtree.descendants.__code__, reuse):
        seen = runtree.run_processes(group, {}, cgroup_root=CGROUP2)
    assert [p.pid for p in newcomers] == [inside.pid]
    assert [(w.process.pid, w.process.cgroup) for w in seen] == [(neighbour.pid, group)]
