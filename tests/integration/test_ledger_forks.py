"""The ledger keeper's skipped records over a real process tree in a PID namespace of its own.

In a fresh namespace (``unshare --pid --fork --mount-proc``) nothing forks but the test's own
processes, so whether a periodic record re-read the run is exact: no fork, no re-read; a fork
or a thread in between, a re-read that records the new child. Root (a PID namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpuguard.adapters import runtree

# Runs as PID 1 of the new namespace: the worker, its child and its thread go with it.
_SCRIPT = r"""
import json, subprocess, sys
from gpuguard.adapters import runtree
from gpuguard.core.ledger import Ledger
from gpuguard.daemon.ledgerkeeper import LedgerKeeper, LedgerPorts

WORKER = '''
import os, sys, threading, time
for line in sys.stdin:
    if line.startswith("fork"):
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        print(pid, flush=True)
    else:
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        print(0, flush=True)
'''
UNIT, RUN = "sglang.service", "1" * 32
worker = subprocess.Popen(
    [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
walks = []

def read(group, recorded):
    walks.append(len(walks))
    return runtree.run_processes(group, recorded)

def ask(command):
    worker.stdin.write(command + "\n")
    worker.stdin.flush()
    return int(worker.stdout.readline())

ports = LedgerPorts(
    run_processes=read, alive=runtree.alive, save=lambda ledger: ledger, every_s=30.0,
    last_pid=runtree.last_pid,
)
known = Ledger().record(UNIT, RUN, [w.process for w in runtree.descendants([worker.pid])], 0.0)
keeper = LedgerKeeper(ports, known, lambda: 0.0)
keeper.run_up(UNIT, RUN, None, 0.0)
after = {}
keeper.record(UNIT, 1.0, periodic=True)
after["nothing"] = len(walks)
child = ask("fork")
keeper.record(UNIT, 2.0, periodic=True)
after["fork"] = len(walks)
recorded = sorted(p.pid for p in keeper.ledger.runs[0].processes)
keeper.record(UNIT, 3.0, periodic=True)
after["nothing again"] = len(walks)
ask("thread")
keeper.record(UNIT, 4.0, periodic=True)
after["thread"] = len(walks)
print(json.dumps({"after": after, "worker": worker.pid, "child": child, "recorded": recorded}))
"""


def in_new_namespace(code: str, *, mount_proc: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as PID 1 of a new PID namespace (with its own /proc unless told not to)."""
    argv = ["unshare", "--pid", "--fork", *(["--mount-proc"] if mount_proc else [])]
    return subprocess.run(
        [*argv, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def namespaces() -> None:
    """Skip without root or without unshare (a PID namespace needs both)."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace of its own needs root")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")


@pytest.mark.usefixtures("namespaces")
def test_no_fork_no_reread_and_a_fork_or_a_thread_in_between_is_read_and_recorded() -> None:
    """Periodic records skip the walk until the namespace's last PID moves; then they re-read."""
    done = in_new_namespace(_SCRIPT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["after"] == {"nothing": 1, "fork": 2, "nothing again": 2, "thread": 3}
    assert found["recorded"] == sorted([found["worker"], found["child"]])


@pytest.mark.usefixtures("namespaces")
def test_the_counter_is_not_trusted_below_the_namespace_proc_shows() -> None:
    """A reader in a namespace nested below /proc's gets None (unsure: read in full)."""
    code = "from gpuguard.adapters import runtree; print(runtree.last_pid())"
    assert in_new_namespace(code).stdout.split() != ["None"]
    assert in_new_namespace(code, mount_proc=False).stdout.split() == ["None"]
    assert runtree.last_pid() is not None  # this test's own namespace is /proc's
