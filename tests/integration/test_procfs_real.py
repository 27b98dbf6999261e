"""The /proc adapter against real child processes holding fake device files on this machine."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from builders import gpu, inventory, nvml

from gpuguard.adapters.procfs import (
    ancestor_pids,
    lineage,
    read_identity,
    read_listed,
    read_stat,
    scan_device_holders,
)
from gpuguard.adapters.reaper import reap
from gpuguard.adapters.runtree import descendants
from gpuguard.core.policy import matching_pattern
from gpuguard.core.redaction import REDACTED
from gpuguard.core.values import ProcessFacts, ReapOutcome, ReapTarget
from gpuguard.unitsettings import SERVER_PATTERNS

if TYPE_CHECKING:
    from collections.abc import Iterator

INVOCATION = "fedcba9876543210fedcba9876543210"

# The helper process: opens the files named in argv[2] (comma-separated), then by mode
#   hold: keeps them open;  mmap: maps them and closes the fds;
#   fork: forks a child that keeps them and forks a grandchild that keeps them too, plus a
#         child that closes them;  exit: exits when a line arrives on stdin;
#   leader-exit: its main thread exits (pthread_exit) while a second thread keeps running, so
#         the process is a zombie under its PID while it still holds the files.
# It prints "ready <pid> <pid>..." (itself first, then its descendants) and waits.
HELPER = r"""
import ctypes, os, sys, threading, time
mode, paths = sys.argv[1], sys.argv[2].split(",")
files = [open(p, "r+b") for p in paths]
if mode == "mmap":
    # Python's mmap module keeps a dup of the fd; map with libc so that no fd remains.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    for f in files:
        assert libc.mmap(None, 4096, 3, 1, f.fileno(), 0) not in (None, ctypes.c_void_p(-1).value)
        f.close()
pids = [os.getpid()]
if mode == "fork":
    r, w = os.pipe()
    def child(then):
        pid = os.fork()
        if pid == 0:
            then()
            os.write(w, b"%d\n" % os.getpid())
            while True:
                time.sleep(3600)
        return pid
    def grandparent_side():
        child(lambda: None)
    child(grandparent_side)
    child(lambda: [f.close() for f in files])
    got = b""
    while got.count(b"\n") < 3:
        got += os.read(r, 100)
    pids += [int(x) for x in got.split()]
if os.environ.get("HELPER_COMM"):  # a name set as setproctitle sets it, not in the cmdline
    with open("/proc/self/comm", "w") as comm:
        comm.write(os.environ["HELPER_COMM"])
print("ready", *pids, flush=True)
if mode == "leader-exit":
    threading.Thread(target=time.sleep, args=(3600,)).start()
    ctypes.CDLL(None).pthread_exit(None)
if mode == "exit":
    sys.stdin.readline()
    sys.exit(0)
while True:
    time.sleep(3600)
"""


class Helper:
    """A running helper process tree, killed as a whole process group at teardown."""

    def __init__(
        self, mode: str, files: list[Path], *extra_args: str, comm: str | None = None
    ) -> None:
        """Start the helper in its own session and wait for it to be ready (named ``comm``)."""
        self.argv = [sys.executable, "-c", HELPER, mode, ",".join(map(str, files)), *extra_args]
        env = {**os.environ, "INVOCATION_ID": INVOCATION}
        if comm is not None:
            env["HELPER_COMM"] = comm
        self.started_after = time.time()
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().split()
        self.started_before = time.time()
        assert line[:1] == ["ready"], line
        self.pids = [int(pid) for pid in line[1:]]

    @property
    def pid(self) -> int:
        """The helper's own PID."""
        return self.popen.pid

    def kill(self) -> None:
        """Kill the whole tree and reap the helper."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def devices(tmp_path: Path) -> list[Path]:
    """Create fake device files (4 KiB each, so they can be mapped)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    paths = [dev / "nvidia0", dev / "nvidiactl"]
    for path in paths:
        path.write_bytes(b"\0" * 4096)
    (dev / "other").write_bytes(b"\0" * 4096)
    return paths


@pytest.fixture
def glob(devices: list[Path]) -> str:
    """The device glob matching the fake device files."""
    return str(devices[0].parent / "nvidia*")


@pytest.fixture
def helpers() -> Iterator[list[Helper]]:
    """Collect helpers started by a test and kill them all afterwards."""
    started: list[Helper] = []
    yield started
    for helper in started:
        helper.kill()


def read_one(pid: int, glob: str) -> ProcessFacts | None:
    """The facts of ``pid`` as ``read_listed`` reads a PID NVML named; None when it is gone."""
    found = read_listed([pid], glob).processes
    return found[0] if found else None


def boot_time() -> int:
    """Return the boot time in seconds since the epoch (``btime`` in /proc/stat)."""
    for line in Path("/proc/stat").read_text(encoding="ascii").splitlines():
        if line.startswith("btime "):
            return int(line.split()[1])
    raise AssertionError("no btime in /proc/stat")


def test_holder_is_found_with_its_real_identity(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """A child holding the fake devices is found with its start time, parent, argv and owner."""
    helper = Helper("hold", devices, "--api-key", "sk-do-not-leak")
    helpers.append(helper)
    scan = scan_device_holders(glob)
    [facts] = [p for p in scan.processes if p.identity.pid == helper.pid]
    assert facts.device_files == frozenset(map(str, devices))
    assert facts.ppid == os.getpid()
    assert facts.state in {"S", "R"}
    assert facts.comm == Path(sys.executable).name[:15]
    assert facts.cmdline == (*helper.argv[:-1], REDACTED)
    assert all("sk-do-not-leak" not in arg for arg in facts.cmdline)
    assert facts.uid == os.getuid()
    assert facts.user == pwd.getpwuid(os.getuid()).pw_name
    assert facts.invocation_id == INVOCATION
    assert not facts.kernel_thread
    assert read_identity(helper.pid) == facts.identity
    started = boot_time() + facts.identity.start_time / os.sysconf("SC_CLK_TCK")
    assert helper.started_after - 2 <= started <= helper.started_before + 2
    own = read_identity(os.getpid())
    assert own is not None
    assert facts.identity.start_time >= own.start_time
    assert facts.cgroup is not None
    assert facts.cgroup in Path(f"/proc/{helper.pid}/cgroup").read_text(encoding="utf-8")


def test_holder_that_only_maps_the_device_is_found(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """A child that mmapped the device and closed the fd still shows as a holder."""
    helper = Helper("mmap", devices)
    helpers.append(helper)
    targets = {str(fd.readlink()) for fd in Path(f"/proc/{helper.pid}/fd").iterdir()}
    assert not targets & set(map(str, devices))
    [facts] = [p for p in scan_device_holders(glob).processes if p.identity.pid == helper.pid]
    assert facts.device_files == frozenset(map(str, devices))


def test_forked_heirs_of_the_fds_are_descendants_and_holders(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """From the parent's PID alone the ledger's walk finds every child; the walk, the holders."""
    helper = Helper("fork", devices)
    helpers.append(helper)
    parent, *children = helper.pids
    assert {w.process.pid for w in descendants([parent])} == {parent, *children}
    found = {p.identity.pid: p for p in scan_device_holders(glob).processes}
    holders = {pid for pid in children if pid in found}
    # Of the three descendants, the one that closed its copies is not a holder.
    assert len(holders) == 2
    assert parent in found
    for pid in holders:
        assert found[pid].device_files == frozenset(map(str, devices))


def test_exited_processes_are_not_reported(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """A holder that exits, first as a zombie and then reaped, is no longer reported."""
    helper = Helper("exit", devices)
    helpers.append(helper)
    assert helper.pid in {p.identity.pid for p in scan_device_holders(glob).processes}
    assert helper.popen.stdin is not None
    helper.popen.stdin.write("bye\n")
    helper.popen.stdin.flush()
    deadline = time.monotonic() + 10
    while (facts := read_one(helper.pid, glob)) is not None and facts.state != "Z":
        assert time.monotonic() < deadline, "helper did not exit"
        time.sleep(0.01)
    assert helper.pid not in {p.identity.pid for p in scan_device_holders(glob).processes}
    helper.popen.wait(timeout=10)
    assert helper.pid not in {p.identity.pid for p in scan_device_holders(glob).processes}
    assert read_one(helper.pid, glob) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_unprivileged_scan_counts_what_it_cannot_read(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """Without root, other users' processes are counted as unreadable instead of failing."""
    helper = Helper("hold", devices)
    helpers.append(helper)
    script = (
        "import json, os, sys\n"
        "from gpuguard.adapters.procfs import scan_device_holders\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "scan = scan_device_holders(sys.argv[1])\n"
        "print(json.dumps([scan.unreadable, [p.identity.pid for p in scan.processes]]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, glob], capture_output=True, text=True, check=True
    )
    unreadable, pids = json.loads(out.stdout)
    assert helper.pid not in pids
    assert unreadable >= 1


def test_lineage_is_each_pid_with_all_its_ancestors() -> None:
    """Gpuguard and whoever asked it are spared together with every ancestor (real /proc)."""
    own = os.getpid()
    child = subprocess.Popen(["sleep", "30"])
    try:
        spared = lineage(own, child.pid)
    finally:
        child.kill()
        child.wait()
    assert spared == frozenset({own, child.pid, *ancestor_pids(own)})
    assert os.getppid() in spared
    assert lineage() == frozenset()


def wait_for_state(pid: int, state: str) -> None:
    """Wait until /proc shows ``pid`` in ``state`` (a thread's exit is asynchronous)."""
    deadline = time.monotonic() + 10
    while (stat := read_stat(pid)) is None or stat.state != state:
        assert time.monotonic() < deadline, f"PID {pid} never reached state {state}"
        time.sleep(0.01)


def test_a_zombie_is_read_as_a_zombie_not_as_gone_or_hidden(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """An exited child its parent has not reaped is read with state Z, until it is reaped.

    The kernel answers ESRCH for the environment of a process without an address space; that
    is not vanishing (the process still exists), so NVML naming it gives a zombie, not "hidden".
    """
    helper = Helper("exit", devices)
    helpers.append(helper)
    assert helper.popen.stdin is not None
    helper.popen.stdin.write("bye\n")
    helper.popen.stdin.flush()
    wait_for_state(helper.pid, "Z")
    facts = read_one(helper.pid, glob)
    assert facts is not None
    assert (facts.state, facts.cmdline, facts.device_files) == ("Z", (), frozenset())
    assert facts.invocation_id is None
    assert facts.identity == read_identity(helper.pid)
    listed = read_listed([helper.pid], glob)
    assert [p.identity.pid for p in listed.processes] == [helper.pid]
    assert listed.hidden == frozenset()
    helper.popen.wait(timeout=10)
    assert read_one(helper.pid, glob) is None
    assert read_listed([helper.pid], glob) == read_listed([], glob)


def test_a_process_whose_main_thread_exited_still_holds_its_files(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """Its PID shows state Z and no fds, but a live thread holds them: it is found and reaped.

    Both walks see its device files (through the thread), with the command line and
    environment its address space still has; the reaper ends it through its pidfd.
    """
    helper = Helper("leader-exit", devices, "--api-key", "sk-do-not-leak")
    helpers.append(helper)
    wait_for_state(helper.pid, "Z")
    try:
        assert not list(Path(f"/proc/{helper.pid}/fd").iterdir())
    except PermissionError:  # the kernel's answer to its owner for a dead leader; root sees []
        assert os.geteuid() != 0
    [facts] = [p for p in scan_device_holders(glob).processes if p.identity.pid == helper.pid]
    assert facts.state == "Z"
    assert facts.device_files == frozenset(map(str, devices))
    assert facts.cmdline == (*helper.argv[:-1], REDACTED)
    assert facts.invocation_id == INVOCATION
    assert read_listed([helper.pid], glob).processes == (facts,)
    target = ReapTarget(facts.identity, facts.ppid, "leader-exit helper", None, "test: stale")
    (result,) = reap([target], grace_s=5.0, kill_wait_s=5.0)
    assert result.outcome is ReapOutcome.EXITED
    assert result.signals == ("SIGTERM",)
    assert helper.popen.wait(timeout=10) == -signal.SIGTERM


def test_an_engine_core_is_known_by_the_name_the_kernel_cut(
    devices: list[Path], glob: str, helpers: list[Helper]
) -> None:
    """A process that named itself VLLM::EngineCore reads VLLM::EngineCor: vLLM's pattern matches.

    The kernel keeps 15 bytes of a name (real vLLM 0.32.0's engine showed so, issue 34); its
    command line (a multiprocessing child's) names no vLLM at all.
    """
    helper = Helper("hold", devices, comm="VLLM::EngineCore")
    helpers.append(helper)
    [facts] = [p for p in scan_device_holders(glob).processes if p.identity.pid == helper.pid]
    assert facts.comm == "VLLM::EngineCor"
    assert not any("VLLM" in arg or "vllm" in arg for arg in facts.cmdline)
    on_gpu_0 = replace(facts, device_files=frozenset({"/dev/nvidia0"}))
    holder = inventory(nvml(gpu(0, (helper.pid, 30000))), on_gpu_0).holder(helper.pid)
    assert holder is not None
    assert matching_pattern(holder, SERVER_PATTERNS["vllm"]) == "VLLM::EngineCore"
    assert matching_pattern(holder, SERVER_PATTERNS["sglang"]) is None
