"""The reaper against real processes, real pidfds and real signals on this machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog
from structlog.testing import capture_logs

from gpuguard.adapters import procfs
from gpuguard.adapters.gaterequest import _JournalCopy
from gpuguard.adapters.logs import configure_logging, get_logger
from gpuguard.adapters.reaper import reap
from gpuguard.core import timeline
from gpuguard.core.values import ProcessIdentity, ReapOutcome, ReapTarget

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from structlog.typing import EventDict

# The child process, by mode:
#   term:   default SIGTERM action (it dies);   ignore: ignores SIGTERM (only SIGKILL ends it);
#   record: appends the name of every catchable signal it receives to argv[2], keeps running;
#   tree:   ignores SIGTERM and forks two children that inherit that.
# It prints "ready <pid> <child pids>..." once its signal dispositions are in place.
CHILD = r"""
import os, signal, sys, time
mode, record = sys.argv[1], sys.argv[2]
def note(signum, frame):
    with open(record, "a") as f:
        f.write(signal.Signals(signum).name + "\n")
if mode == "record":
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM):
        signal.signal(sig, note)
elif mode in ("ignore", "tree"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.getpid()]
if mode == "tree":
    for _ in range(2):
        child = os.fork()
        if child == 0:
            while True:
                time.sleep(3600)
        pids.append(child)
print("ready", *pids, flush=True)
while True:
    time.sleep(3600)
"""

# Runs reap() as user nobody against a root-owned process: argv = pid, start time, ppid.
# Everything is imported before privileges are dropped (the interpreter's files may not be
# readable by nobody); logs go to stderr as JSON lines, the results to stdout as JSON.
AS_NOBODY = r"""
import json, os, sys, time
from gpuguard.adapters.logs import configure_logging, get_logger
from gpuguard.adapters.reaper import reap
from gpuguard.core.values import ReapTarget
from gpuguard.core.values import ProcessIdentity
configure_logging(json=True, stream=sys.stderr)
get_logger().bind()  # resolve the configuration now, while the interpreter's files are readable
pid, start_time, ppid = map(int, sys.argv[1:4])
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
target = ReapTarget(ProcessIdentity(pid, start_time), ppid, "sleeper", None, "test: root-owned")
began = time.monotonic()
results = reap([target], grace_s=30.0, kill_wait_s=30.0)
elapsed = time.monotonic() - began
print(json.dumps({"elapsed": elapsed, "results": [
    {"outcome": str(r.outcome), "signals": list(r.signals), "detail": r.detail} for r in results
]}))
"""

FREEZER = Path("/sys/fs/cgroup/freezer")


@dataclass(frozen=True)
class Child:
    """A spawned child process (its own session) and the pids it reported as ready."""

    popen: subprocess.Popen[str]
    pids: tuple[int, ...]
    record: Path

    @property
    def pid(self) -> int:
        """The PID of the process we started (the leader of its session)."""
        return self.pids[0]

    def target(self, pid: int | None = None, reason: str = "test: stale holder") -> ReapTarget:
        """A reap target for one of this child's processes, with its identity read now."""
        pid = self.pid if pid is None else pid
        stat = procfs.read_stat(pid)
        assert stat is not None
        return ReapTarget(
            identity=ProcessIdentity(pid, stat.start_time),
            ppid=stat.ppid,
            command=f"python3 -c CHILD ({pid})",
            unit=None,
            reason=reason,
        )

    def received(self) -> list[str]:
        """The signals a ``record`` child has noted so far."""
        return self.record.read_text().split() if self.record.exists() else []


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[str], Child]]:
    """Start children in their own sessions; kill every session and reap them at teardown."""
    started: list[subprocess.Popen[str]] = []

    def start(mode: str) -> Child:
        record = tmp_path / f"signals-{len(started)}.txt"
        popen = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, str(record)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(popen)
        assert popen.stdout is not None
        with popen.stdout:
            words = popen.stdout.readline().split()
        assert words[:1] == ["ready"], f"child {mode} did not start"
        return Child(popen, tuple(int(word) for word in words[1:]), record)

    try:
        yield start
    finally:
        for popen in started:
            # The session id is the unwaited child's PID, so no other process can hold it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
        for popen in started:
            popen.wait(timeout=10)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    stat = procfs.read_stat(pid)
    return stat is not None and stat.state not in {"Z", "X"}


def _signals(logs: Sequence[EventDict]) -> list[tuple[int, str]]:
    """The (pid, signal) of every "signal" log line, in the order they were logged."""
    return [(entry["pid"], entry["signal"]) for entry in logs if entry["event"] == "signal"]


def _outcomes(logs: Sequence[EventDict]) -> list[tuple[int, str]]:
    """The (pid, outcome) of every outcome log line."""
    return [(entry["pid"], entry["outcome"]) for entry in logs if entry["event"] == "reap outcome"]


def test_a_process_that_exits_on_sigterm_is_reported_exited(
    spawn: Callable[[str], Child],
) -> None:
    """A process that dies of SIGTERM is reported exited, after one logged SIGTERM, at once."""
    child = spawn("term")
    target = child.target(reason="holds GPU 0 after its unit stopped")
    with capture_logs() as logs:
        began = time.monotonic()
        (result,) = reap([target], grace_s=10.0)
        elapsed = time.monotonic() - began
    assert result.outcome is ReapOutcome.EXITED
    assert result.signals == ("SIGTERM",)
    assert elapsed < 2.0  # the grace ends when the process does
    assert child.popen.wait(timeout=5) == -signal.SIGTERM
    (line,) = [entry for entry in logs if entry["event"] == "signal"]
    assert line["pid"] == child.pid
    assert line["start_time"] == target.identity.start_time
    assert line["signal"] == "SIGTERM"
    assert line["reason"] == "holds GPU 0 after its unit stopped"
    assert line["command"] == target.command
    assert _outcomes(logs) == [(child.pid, "exited")]


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(
    spawn: Callable[[str], Child],
) -> None:
    """A process that ignores SIGTERM gets SIGKILL once the grace has passed and is killed."""
    child = spawn("ignore")
    with capture_logs() as logs:
        began = time.monotonic()
        (result,) = reap([child.target()], grace_s=0.5, kill_wait_s=5.0)
        elapsed = time.monotonic() - began
    assert result.outcome is ReapOutcome.KILLED
    assert result.signals == ("SIGTERM", "SIGKILL")
    assert 0.5 <= elapsed < 2.0
    assert child.popen.wait(timeout=5) == -signal.SIGKILL
    assert _signals(logs) == [(child.pid, "SIGTERM"), (child.pid, "SIGKILL")]
    assert _outcomes(logs) == [(child.pid, "killed")]


def test_several_targets_share_one_grace(spawn: Callable[[str], Child]) -> None:
    """Three TERM-ignoring processes wait one shared grace, not one grace each."""
    children = [spawn("ignore") for _ in range(3)]
    with capture_logs() as logs:
        began = time.monotonic()
        results = reap([child.target() for child in children], grace_s=0.5, kill_wait_s=5.0)
        elapsed = time.monotonic() - began
    assert [result.outcome for result in results] == [ReapOutcome.KILLED] * 3
    assert [result.target.identity.pid for result in results] == [c.pid for c in children]
    assert elapsed < 1.2
    terms = [pid for pid, name in _signals(logs) if name == "SIGTERM"]
    kills = [pid for pid, name in _signals(logs) if name == "SIGKILL"]
    assert terms == kills == [child.pid for child in children]
    assert [name for _pid, name in _signals(logs)][:3] == ["SIGTERM"] * 3  # all TERMs first


def test_a_parent_is_signalled_before_its_children(spawn: Callable[[str], Child]) -> None:
    """A TERM-ignoring parent and children, listed children first, are signalled parent first."""
    tree = spawn("tree")
    parent, *children = tree.pids
    targets = [tree.target(pid) for pid in reversed(tree.pids)]
    assert {target.ppid for target in targets[:2]} == {parent}
    with capture_logs() as logs:
        results = reap(targets, grace_s=0.5, kill_wait_s=5.0)
    assert [result.target for result in results] == targets  # results in the order given
    assert {result.outcome for result in results} == {ReapOutcome.KILLED}
    assert all(result.signals == ("SIGTERM", "SIGKILL") for result in results)
    signals = _signals(logs)
    assert len(signals) == 6  # one line per signal sent
    for name in ("SIGTERM", "SIGKILL"):
        sent_to = [pid for pid, sent in signals if sent == name]
        assert sent_to[0] == parent
        assert sorted(sent_to[1:]) == sorted(children)
    assert not any(_alive(pid) for pid in tree.pids)


def test_a_reused_pid_is_never_signalled(spawn: Callable[[str], Child]) -> None:
    """A target whose start time differs from the live process with its PID leaves it untouched."""
    bystander = spawn("record")
    live = bystander.target()
    stale = ReapTarget(
        identity=ProcessIdentity(live.identity.pid, live.identity.start_time - 1),
        ppid=live.ppid,
        command="python3 -m sglang.launch_server",
        unit="sglang.service",
        reason="test: stale identity",
    )
    with capture_logs() as logs:
        (result,) = reap([stale], grace_s=0.5, kill_wait_s=0.5)
    assert result.outcome is ReapOutcome.PID_REUSED
    assert result.signals == ()
    assert _signals(logs) == []
    assert _outcomes(logs) == [(bystander.pid, "pid-reused")]
    # Positive control: the bystander notes a signal we send it, and only that one.
    os.kill(bystander.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not bystander.received() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bystander.received() == ["SIGUSR1"]
    assert _alive(bystander.pid)


def test_a_target_that_already_exited_is_gone(spawn: Callable[[str], Child]) -> None:
    """A target that exited (and was reaped) before the call is reported gone, unsignalled."""
    child = spawn("term")
    target = child.target()
    child.popen.kill()
    child.popen.wait(timeout=5)
    with capture_logs() as logs:
        (result,) = reap([target], grace_s=5.0)
    assert result.outcome is ReapOutcome.GONE
    assert result.signals == ()
    assert _signals(logs) == []
    assert _outcomes(logs) == [(child.pid, "gone")]


def test_a_zombie_target_is_gone(spawn: Callable[[str], Child]) -> None:
    """A target that exited but whose parent has not reaped it yet is gone, unsignalled."""
    child = spawn("term")
    target = child.target()
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    with capture_logs() as logs:
        (result,) = reap([target], grace_s=5.0)
    assert result.outcome is ReapOutcome.GONE
    assert _signals(logs) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to user nobody")
def test_eperm_is_reported_once_without_retrying(spawn: Callable[[str], Child]) -> None:
    """Reaping a root process as user nobody ends promptly in permission-denied, nothing sent."""
    sleeper = spawn("term")
    target = sleeper.target()
    identity = (sleeper.pid, target.identity.start_time, target.ppid)
    done = subprocess.run(
        [sys.executable, "-c", AS_NOBODY, *map(str, identity)],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (result,) = report["results"]
    assert result["outcome"] == "permission-denied"
    assert result["signals"] == []
    assert "EPERM" in result["detail"]
    assert report["elapsed"] < 2.0  # grace 30 s: no waiting, no retry loop
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["reap outcome"]
    assert lines[0]["outcome"] == "permission-denied"
    assert lines[0]["pid"] == sleeper.pid
    assert lines[0]["level"] == "warning"
    assert _alive(sleeper.pid)


@pytest.fixture
def freezer(spawn: Callable[[str], Child]) -> Iterator[Path]:
    """A fresh cgroup v1 freezer group; teardown thaws it, kills its members and removes it.

    It depends on ``spawn`` so that it is torn down first: thawed before the sessions are killed.
    """
    del spawn
    if not (FREEZER / "cgroup.procs").is_file():
        pytest.skip(f"the cgroup v1 freezer hierarchy is not mounted at {FREEZER}")
    group = FREEZER / f"gpuguard-test-{uuid.uuid4()}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a freezer cgroup under {FREEZER}: {error.strerror}")
    try:
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while True:
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def test_a_frozen_process_is_reported_unkillable(
    spawn: Callable[[str], Child], freezer: Path
) -> None:
    """A process frozen in state D survives SIGKILL: unkillable now, dying, never "reset a GPU"."""
    child = spawn("ignore")
    (freezer / "cgroup.procs").write_text(str(child.pid))
    (freezer / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + 5
    while (freezer / "freezer.state").read_text().strip() != "FROZEN":
        assert time.monotonic() < deadline, "the freezer did not freeze the child"
        time.sleep(0.01)
    stat = procfs.read_stat(child.pid)
    assert stat is not None
    assert stat.state == "D"
    with capture_logs() as logs:
        began = time.monotonic()
        (result,) = reap([child.target()], grace_s=0.5, kill_wait_s=0.5)
        elapsed = time.monotonic() - began
    assert result.outcome is ReapOutcome.UNKILLABLE
    assert result.signals == ("SIGTERM", "SIGKILL")
    assert result.detail is not None
    assert result.detail.startswith("state D, wchan ")
    # The freezer's wait is not the NVIDIA driver's: SIGKILL lands when it ends, no reset helps.
    assert "reset or reboot is needed" not in result.detail
    assert "dying: its wait is outside the NVIDIA driver" in result.detail
    assert elapsed < 0.5 + 0.5 + 1.0
    assert _signals(logs) == [(child.pid, "SIGTERM"), (child.pid, "SIGKILL")]
    (outcome,) = [entry for entry in logs if entry["event"] == "reap outcome"]
    assert outcome["outcome"] == "unkillable"
    assert outcome["log_level"] == "warning"
    assert outcome["detail"] == result.detail


def _target_for(pid: int, command: str) -> ReapTarget:
    """A target for ``pid`` as the policy would hand it over, identity read now."""
    identity = procfs.read_identity(pid)
    assert identity is not None
    return ReapTarget(identity, 0, command, None, "test: should be refused")


# In a container's own PID namespace the test itself or its parent may be PID 1 or 2, which are
# refused first, for being 1 or 2.
_LOW = pytest.mark.skipif(
    min(os.getpid(), os.getppid()) <= 2, reason="assumes the host's PID namespace (PID > 2)"
)


@pytest.mark.parametrize(
    ("pid", "what"),
    [
        pytest.param(1, "PID 1 is never signalled", id="init"),
        pytest.param(os.getpid(), "gpuguard itself or one of its ancestors", id="self", marks=_LOW),
        pytest.param(
            os.getppid(), "gpuguard itself or one of its ancestors", id="parent", marks=_LOW
        ),
    ],
)
def test_init_ourselves_and_our_ancestors_are_refused(pid: int, what: str) -> None:
    """PID 1, our own process and our parent are refused with ValueError before anything is sent."""
    with capture_logs() as logs, pytest.raises(ValueError, match=what):
        reap([_target_for(pid, "protected")], grace_s=0.1, kill_wait_s=0.1)
    assert logs == []


def test_a_process_listed_twice_is_signalled_once(spawn: Callable[[str], Child]) -> None:
    """A process listed twice (two GPUs) gets one SIGTERM and both entries report its exit."""
    child = spawn("term")
    first, second = child.target(reason="holds GPU 0"), child.target(reason="holds GPU 1")
    with capture_logs() as logs:
        results = reap([first, second], grace_s=5.0)
    assert [result.target for result in results] == [first, second]
    assert [result.outcome for result in results] == [ReapOutcome.EXITED] * 2
    assert _signals(logs) == [(child.pid, "SIGTERM")]
    assert _outcomes(logs) == [(child.pid, "exited")]


def test_one_pid_with_two_start_times_is_refused(spawn: Callable[[str], Child]) -> None:
    """A plan naming one PID with two start times is refused before any signal; it lives on."""
    child = spawn("record")
    live = child.target()
    older = replace(live, identity=ProcessIdentity(child.pid, live.identity.start_time - 1))
    with capture_logs() as logs, pytest.raises(ValueError, match="two start times"):
        reap([live, older])
    assert logs == []
    assert _alive(child.pid)
    assert child.received() == []


def test_a_kernel_thread_is_refused(spawn: Callable[[str], Child]) -> None:
    """A kernel thread (kthreadd's child) is refused and the other targets are not signalled."""
    kthreads = [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdecimal()
        and int(entry.name) > 2
        and (stat := procfs.read_stat(int(entry.name))) is not None
        and stat.kernel_thread
    ]
    if not kthreads:
        pytest.skip("no kernel thread is visible in this PID namespace")
    child = spawn("record")
    targets = [child.target(), _target_for(kthreads[0], "[kworker]")]
    with capture_logs() as logs, pytest.raises(ValueError, match="kernel thread"):
        reap(targets)
    assert _signals(logs) == []
    assert _alive(child.pid)
    assert child.received() == []


def test_importing_the_reaper_does_not_import_structlog() -> None:
    """Importing the reaper leaves structlog unloaded (it costs ~120 ms on the gate's path)."""
    code = "import sys, gpuguard.adapters.reaper; print('structlog' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=20
    )
    assert done.stdout.strip() == "False"


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """Put structlog's default configuration back after a test that configures it."""
    try:
        yield
    finally:
        structlog.reset_defaults()


@pytest.mark.usefixtures("restore_structlog")
def test_console_logging_names_pid_signal_and_reason(
    spawn: Callable[[str], Child], tmp_path: Path
) -> None:
    """The operator's console form prints one readable line per signal with pid, signal, reason."""
    child = spawn("term")
    out = tmp_path / "console.log"
    with out.open("w") as stream:
        configure_logging(json=False, stream=stream)
        (result,) = reap([child.target(reason="stale after stop")], logger=get_logger())
    assert result.outcome is ReapOutcome.EXITED
    lines = out.read_text().splitlines()
    (line,) = [line for line in lines if " signal " in line]
    assert f"pid={child.pid}" in line
    assert "signal=SIGTERM" in line
    assert "stale after stop" in line
    assert not line.lstrip().startswith("{")


@pytest.mark.usefixtures("restore_structlog")
def test_explain_reads_the_outcome_the_reaper_logged_whatever_cgroup_name_its_reason_holds(
    spawn: Callable[[str], Child], tmp_path: Path
) -> None:
    """A cgroup named to read as another outcome and PID leaves explain the true one.

    A delegated subtree may name a cgroup anything, and a moved worker's reason names its cgroup.
    The gate server copies the reaper's readable line into its journal; explain reads the
    outcome back from there. Before, the last "outcome=… pid=… " on the line counted, and the
    reason, which comes after the reaper's own pair, could say "gone" for PID 1.
    """
    child = spawn("term")
    hostile = "/system.slice/sglang.service/w outcome=gone pid=1 x"
    reason = (
        "left over from an earlier run of sglang.service (the ledger saw it descend from run "
        f"b115846fd5c4, uid 0; it moved to {hostile})"
    )
    out = tmp_path / "console.log"
    with out.open("w") as stream:
        configure_logging(json=False, stream=stream)
        (result,) = reap([child.target(reason=reason)], logger=get_logger())
    assert result.outcome is ReapOutcome.EXITED
    journal = io.StringIO()
    copy = _JournalCopy(journal, "reap for sglang.service from PID 291: ")
    for line in out.read_text().splitlines():
        copy.line(line)
    entries = [
        {
            "__MONOTONIC_TIMESTAMP": str(1_000_000 + step),
            "__REALTIME_TIMESTAMP": str(1_700_000_000_000_000 + step),
            "_BOOT_ID": "b" * 32,
            "MESSAGE": message,
            "_SYSTEMD_UNIT": "gpuguard-gate.service",
            "_TRANSPORT": "stdout",
            "_PID": "77",
            "_UID": "0",
        }
        for step, message in enumerate(journal.getvalue().splitlines())
    ]
    assert any(hostile in entry["MESSAGE"] for entry in entries)  # the name reached the line
    found = timeline.build(entries, "sglang.service")
    [row] = [row for row in found.rows if row.kind == "reap-outcome"]
    assert row.text.startswith(f"reap outcome: pid={child.pid} outcome=exited; ")
    assert found.story.survivors == (f"PID {child.pid}: reaped by gpuguard",)
