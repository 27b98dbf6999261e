"""One incident read four ways: `status`, its metrics, `explain` and `doctor` must tell it alike.

The incident is issue 22's: a stop timed out and SIGKILL landed; one worker of that run stayed in
the unit's cgroup (systemd logged it), another had moved to a transient scope of its own with its
own INVOCATION_ID (nothing proves it the unit's); every next start dies on CUDA OOM, the server
naming that worker as the holder. A tenant's own ``python -m sglang`` of another uid shares the
unit's GPUs and is nobody's left-over. The journal is recorded from a real systemd 252
(tests/journal_samples), renamed to this test's unit and its real processes; the daemon runs
in-process over it (its journal and systemctl are the twins of test_daemon.py); the four
commands run as subprocesses with ``systemctl``/``journalctl`` stand-ins (root only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from clirunner import unit_name
from daemontwins import JournaledRecorder, ReplayFollower, UnitTwin
from fakeholder import process_gone
from fakestate import add_alloc
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.adapters import inventory, reaper, state
from gpuguard.config import Settings
from gpuguard.core.gate.refusal import last_refusal
from gpuguard.core.values import UnitProvenance
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli, UnitCgroups
    from fakeholder import HolderSpawner

SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples" / "bookworm"
NOBODY = 65534
STOPPED_RUN = "61fb7cdcf750460bb7b6a7da661d6d95"
"""The run of stop-sigkill-survivor.jsonl: its stop timed out, PID 57 remained running."""
SHOW = """\
LoadState=loaded
ActiveState=activating
SubState=auto-restart
MainPID=0
InvocationID={last}
Environment=
NRestarts=5
User=
DynamicUser=no
Type=simple
KillMode=process
TimeoutStopUSec=2s
Restart=always
RestartUSec=100ms
StartLimitIntervalUSec=10s
StartLimitBurst=5
DropInPaths=
"""
# A process of another uid that opens fake device files, detaches (PPID 1) and waits.
_TENANT = """\
import os, sys, time
state, paths = sys.argv[1], sys.argv[2].split(",")
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
files = [open(os.path.join(state, "dev", p)) for p in paths]
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
print(os.getpid(), flush=True)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
time.sleep(600)
"""


@dataclass
class Tenants:
    """Another user's detached servers, killed at teardown."""

    pids: list[int] = field(default_factory=list)

    def __call__(self, state: Path, gpu: int, mib: int) -> int:
        """Start one on ``gpu`` holding ``mib`` (the fake NVML's allocation)."""
        env = {k: v for k, v in os.environ.items() if k != "INVOCATION_ID"}
        argv = ["python3", "-c", _TENANT, str(state), f"nvidia{gpu}", "-m", "sglang"]
        done = subprocess.run(
            argv, executable=sys.executable, env=env, capture_output=True, check=True, timeout=10
        )
        pid = int(done.stdout)
        self.pids.append(pid)
        add_alloc(state, pid=pid, minor=gpu, mib=mib)
        return pid

    def stop(self) -> None:
        """SIGKILL every one still alive."""
        for pid in self.pids:
            if not process_gone(pid):
                os.kill(pid, 9)


@pytest.fixture
def tenants() -> Iterator[Tenants]:
    """Factory for another user's GPU servers."""
    made = Tenants()
    yield made
    made.stop()


def _renamed(name: str, unit: str, *, survivor: int, holder: int) -> list[dict[str, Any]]:
    """A recorded journal for ``unit``: PID 57 is ``survivor``; the OOM names ``holder``."""
    entries = []
    for line in (SAMPLES / name).read_text().splitlines():
        entry = json.loads(line.replace("sglang.service", unit))
        message = entry.get("MESSAGE")
        if isinstance(message, str):
            message = message.replace("process 57 (", f"process {survivor} (")
            if message == "sglang: CUDA error: out of memory":
                # PyTorch's own message (2.1+) on the device the left-over worker holds.
                message = (
                    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                    "GPU 1 has a total capacity of 139.81 GiB of which 1.19 GiB is free. "
                    f"Process {holder} has 30.00 GiB memory in use. Including non-PyTorch "
                    "memory, this process has 108.50 GiB memory in use."
                )
            entry["MESSAGE"] = message
        entries.append(entry)
    return entries


def incident_journal(unit: str, survivor: int, holder: int) -> list[dict[str, Any]]:
    """The stop that left ``survivor`` behind, then the OOM restart loop, on one boot."""
    stop = _renamed("stop-sigkill-survivor.jsonl", unit, survivor=survivor, holder=holder)
    loop = _renamed("restart-loop-start-limit.jsonl", unit, survivor=survivor, holder=holder)
    first = loop[0]
    last = stop[-1]
    mono = int(first["__MONOTONIC_TIMESTAMP"]) - int(last["__MONOTONIC_TIMESTAMP"]) - 5_000_000
    real = int(first["__REALTIME_TIMESTAMP"]) - int(last["__REALTIME_TIMESTAMP"]) - 5_000_000
    for entry in stop:  # moved to just before the loop, on the loop's boot
        entry["__MONOTONIC_TIMESTAMP"] = str(int(entry["__MONOTONIC_TIMESTAMP"]) + mono)
        entry["__REALTIME_TIMESTAMP"] = str(int(entry["__REALTIME_TIMESTAMP"]) + real)
        entry["_BOOT_ID"] = first["_BOOT_ID"]
    return stop + loop


@dataclass
class DaemonRun:
    """What the in-process daemon left: its snapshot and its log as journal entries."""

    snapshot: dict[str, Any]
    lines: list[tuple[str, str, dict[str, object]]]
    journal: list[dict[str, Any]]
    calls: list[str]


def run_daemon(cli: Cli, unit: str, entries: list[dict[str, Any]]) -> DaemonRun:
    """The daemon over ``entries`` (live), as root would run it: real inventory and reaper."""
    settings = Settings(
        units={unit: UnitSettings()},
        allow_plain_device_files=True,
        nvml_library=cli.library,
        device_glob=f"{cli.state}/dev/nvidia*",
        runtime_dir=cli.config.parent / "run",
        state_dir=cli.config.parent / "lib",
        reap_grace_s=1.0,
    )
    newest_mono = max(int(e["__MONOTONIC_TIMESTAMP"]) for e in entries) / 1e6
    newest_real = max(int(e["__REALTIME_TIMESTAMP"]) for e in entries) / 1e6
    shift = newest_mono + 1.0 - time.monotonic()
    log = JournaledRecorder(
        clock=lambda: time.monotonic() + shift,
        realtime_s=lambda monotonic_s: newest_real + monotonic_s - newest_mono,
        boot_id=str(entries[-1]["_BOOT_ID"]),
    )
    twin = UnitTwin(invocation=str(entries[-1]["INVOCATION_ID"]))
    snapshots: list[dict[str, Any]] = []
    turns = [0]
    held: list[Daemon] = []
    runs = frozenset(str(e["INVOCATION_ID"]) for e in entries if e.get("INVOCATION_ID"))

    def sleep(seconds: float) -> None:
        del seconds
        turns[0] += 1
        if turns[0] > 3:
            held[0].request_stop()

    ports = Ports(
        gather=lambda: inventory.gather(settings),
        show_unit=twin.show,
        control=twin.control,
        reap=lambda _unit, targets: reaper.reap(targets, grace_s=settings.reap_grace_s, logger=log),
        notifier=log,
        log=log,
        wall=lambda: newest_real + 1.0,
        monotonic=lambda: time.monotonic() + shift,
        sleep=sleep,
        write_snapshot=snapshots.append,
        load_unit_state=lambda _unit: None,
        save_unit_state=lambda _unit, _state: None,
        untouchable=frozenset({os.getpid()}),
        provenance=lambda state: UnitProvenance(None, runs - {state.invocation_id or ""}, 0),
        boot_id=str(entries[-1]["_BOOT_ID"]),
        gate_refusal=lambda u: last_refusal(state.gate_decisions(settings.runtime_dir, u)),
    )
    daemon = Daemon(settings, ReplayFollower(entries, live=True), ports)
    held.append(daemon)
    assert daemon.run() == 0
    running = [s for s in snapshots if s.get("running")]
    return DaemonRun(running[-1], log.lines, log.entries, twin.calls)


@pytest.fixture
def stand_ins(cli: Cli, tmp_path: Path) -> Iterator[Path]:
    """Stand-ins of systemctl and journalctl; the journal they print is ``journal.jsonl``."""
    if os.geteuid() != 0:
        pytest.skip("binding the stand-ins needs root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    printed = tmp_path / "journal.jsonl"
    printed.write_text("")
    (bin_dir / "journalctl").write_text(f"#!/bin/sh\ncat {printed}\n")
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\n[ "$1" = show ] || exit 1\ncat {tmp_path}/unit.show\n'
    )
    for script in bin_dir.iterdir():
        script.chmod(0o755)
        cli.doubles[script.name] = script
    yield printed
    cli.doubles.clear()


def _samples(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            found[key] = sample.value
    return found


def _write_journal(path: Path, entries: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def test_status_metrics_explain_and_doctor_tell_one_incident_alike(  # noqa: PLR0915 - four views
    cli: Cli,
    stand_ins: Path,
    tmp_path: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    tenants: Tenants,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same left-overs (PIDs), same command, CRITICAL: the four views agree.

    The worker in the cgroup is proven (the daemon or `gpuguard reap --unit U` frees it), the
    escaped one is only suspected (a blocker: `--scope patterns` after checking it), the
    tenant's server is nobody's left-over in any view, and the named command, dry run, plans
    exactly the two left-overs. Doctor counts only the one systemd saw: the server's word for the
    other is shown, not counted (the unit's own output can name any PID).
    """
    unit = unit_name()
    monkeypatch.setenv("INVOCATION_ID", STOPPED_RUN)
    stayed = spawn_holder(cli.state, gpus=(0,), mib=30000, name="sglang::scheduler")
    monkeypatch.setenv("INVOCATION_ID", uuid.uuid4().hex)  # its transient scope's own run
    escaped = spawn_holder(cli.state, gpus=(1,), mib=30000, name="sglang::scheduler_TP1")
    monkeypatch.delenv("INVOCATION_ID")
    unit_cgroups.move(stayed.pid, unit)
    unit_cgroups.move(escaped.pid, f"run-u{uuid.uuid4().hex[:6]}.scope")
    tenant = tenants(cli.state, 1, 20000)
    left = {stayed.pid, escaped.pid}

    entries = incident_journal(unit, stayed.pid, escaped.pid)
    cli.configure(f'[units."{unit}"]\n')
    (tmp_path / "unit.show").write_text(SHOW.format(last=entries[-1]["INVOCATION_ID"]))
    monkeypatch.setenv("FAKENVML_STATE", str(cli.state))  # the in-process daemon's NVML
    ran = run_daemon(cli, unit, entries)
    assert ran.calls == []  # it cannot free what it cannot prove: the unit is left as it was
    watch = ran.snapshot["units"][unit]
    assert watch["looping"], watch
    assert watch["cause"] == "stale-gpu-holders"
    assert watch["action"] == "needs-operator"
    state.write_json(cli.config.parent / "run" / "daemon.json", ran.snapshot)
    _write_journal(stand_ins, entries)

    # status: CRITICAL (exit 2), the two left-overs named, the blocker and the command.
    status = cli("status")
    report = cli("status", "--json").json()
    assert status.code == 2, status.out + status.err
    lines = status.out.splitlines()
    assert lines[0].startswith("gpuguard status: CRITICAL"), status.out
    command = f"gpuguard reap --unit {unit} --scope patterns"
    critical = next(line for line in lines if line.startswith("CRITICAL: ") and command in line)
    assert f"{unit} needs an operator: gpuguard leaves its restart loop alone" in critical
    assert f"PID {escaped.pid} (" in critical, critical
    assert f"run `{command}`" in critical
    # The tenant holds GPU 1 too: named, as its owner's to stop (the command spares it).
    assert f"PID {tenant} (python, no unit) on GPU 1: runs as uid 65534/65534/65534/65534" in (
        critical
    )
    assert "its owner's to stop" in critical
    named = {
        pid
        for pid in (stayed.pid, escaped.pid, tenant)
        for line in lines
        if f"PID {pid} (" in line and "left-over of" in line
    }
    assert named == left, status.out
    assert f"is a left-over of {unit}" in next(
        line for line in lines if f"PID {stayed.pid} (" in line and "left-over" in line
    )
    assert report["exit_code"] == 2

    # metrics: the same left-overs, per GPU; the tenant's GPU 1 memory counts for no one.
    metrics = _samples(cli("status", "--prometheus").out)
    stale = {gpu: metrics[f"gpuguard_gpu_stale_holders,gpu={gpu}"] for gpu in ("0", "1", "2", "3")}
    assert stale == {"0": 1, "1": 1, "2": 0, "3": 0}, stale
    assert metrics["gpuguard_gpu_suspected_stale_holders,gpu=1"] == 1
    assert metrics["gpuguard_gpu_suspected_stale_holders,gpu=0"] == 0
    assert metrics[f"gpuguard_unit_restart_loop,unit={unit}"] == 1

    # the command status names, dry run: it plans exactly the two left-overs, spares the tenant.
    plan = cli("reap", "--unit", unit, "--scope", "patterns", "--dry-run")
    verbs = {
        pid: line.split()[0]
        for line in plan.out.splitlines()
        for pid in (stayed.pid, escaped.pid, tenant)
        if f" pid {pid} " in line
    }
    assert verbs == {stayed.pid: "reap", escaped.pid: "reap", tenant: "spare"}, plan.out

    # explain, the journal alone (gpuguard not there then): the same two PIDs, and a replay
    # that frees only what the ownership rule allows, naming the same command. As doctor does,
    # it counts the one systemd saw, and shows the one only the server's out-of-memory line
    # names as its word.
    doc = cli("explain", "--unit", unit, "--json").json()
    story = doc["story"]
    assert story["survivor_pids"] == 1, story["survivors"]
    told = {int(x.split()[1].rstrip(":")) for x in story["survivors"] if x.startswith("PID ")}
    assert told == left
    assert any(
        x.startswith(f"PID {escaped.pid}: named by the server's") and "(its word)" in x
        for x in story["survivors"]
    ), story["survivors"]
    [would] = story["would"]
    assert would.startswith("gpuguard would have acted: needs-operator (stale-gpu-holders)")
    assert str(stayed.pid) in would
    assert str(escaped.pid) in would
    assert str(tenant) not in would
    assert command in would

    # explain with the daemon's lines: its verdicts, row by row, are the replay's.
    _write_journal(stand_ins, entries + ran.journal)
    doc = cli("explain", "--unit", unit, "--json").json()
    assert doc["gpuguard_seen"]
    assert doc["story"]["disagreements"] == [], doc["story"]["disagreements"]
    assert doc["story"]["survivor_pids"] == 1

    # doctor: the survivors of past stops are the same two PIDs, with the same way out; the one
    # only the server's out-of-memory line names is its word, shown but not counted.
    doctor = cli("doctor", "--unit", unit, "--json").json()
    [found] = [f for f in doctor["units"][0]["findings"] if f["code"] == "survivors"]
    assert found["title"] == "1 process survived a stop or was left over at a start", found
    assert f"PIDs: {stayed.pid}" in found["evidence"]
    assert any(
        line.startswith(f"the server's out-of-memory lines name PID {escaped.pid} ")
        and "(its word, not counted)" in line
        for line in found["evidence"]
    ), found["evidence"]
    assert f"`gpuguard reap --unit {unit}`" in found["advice"]
    assert "`--scope patterns`" in found["advice"]


def test_a_loop_the_gate_refuses_is_one_story_in_every_view(  # noqa: PLR0915 - five views
    cli: Cli,
    stand_ins: Path,
    tmp_path: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36's incident read five ways: the same loop, the same blocker, never "no loop".

    The gate refused the unit's last start (its record names a PID long gone); today a worker
    that escaped into a scope of its own holds GPU 0, which nothing proves the unit's. The
    journal is systemd 252's restart loop that ended at the start limit. The daemon, status,
    its metrics, explain and doctor must each say: a restart loop (systemd ended it), needs an
    operator, today's holder with the one command, and nothing that contradicts it.
    """
    unit = unit_name()
    monkeypatch.setenv("INVOCATION_ID", uuid.uuid4().hex)  # its transient scope's own run
    escaped = spawn_holder(cli.state, gpus=(0,), mib=30000, name="sglang::scheduler_TP0")
    monkeypatch.delenv("INVOCATION_ID")
    unit_cgroups.move(escaped.pid, f"run-u{uuid.uuid4().hex[:6]}.scope")
    entries = _renamed("restart-loop-start-limit.jsonl", unit, survivor=0, holder=0)
    cli.configure(f'[units."{unit}"]\n')
    (tmp_path / "unit.show").write_text(SHOW.format(last=entries[-1]["INVOCATION_ID"]))
    old = {"time": "2026-12-01T03:00:00+00:00", "result": "refused", "waited_s": 300.0}
    old["blockers"] = ["GPU 0: 30000 MiB used, held by PID 4194301 (gone, long since)"]
    state.record_gate_decision(cli.config.parent / "run", unit, old)
    monkeypatch.setenv("FAKENVML_STATE", str(cli.state))
    ran = run_daemon(cli, unit, entries)
    command = f"gpuguard reap --unit {unit} --scope patterns"

    # the daemon: needs operator with today's blocker and the command, never "no GPU cause".
    assert ran.calls == []
    events = [event for _, event, _ in ran.lines]
    assert "restart loop" not in events, ran.lines
    [critical] = [fields for level, _, fields in ran.lines if level == "critical"]
    assert critical["command"] == command
    blockers = critical["blockers"]
    assert isinstance(blockers, list)
    assert [str(b).split(" (")[0] for b in blockers] == [f"PID {escaped.pid}"]
    watch = ran.snapshot["units"][unit]
    assert (watch["looping"], watch["action"]) == (True, "needs-operator")
    assert "start limit" in watch["verdict"]
    state.write_json(cli.config.parent / "run" / "daemon.json", ran.snapshot)
    _write_journal(stand_ins, entries)

    # status: CRITICAL, exit 2; the headline one line naming today's holder once and the command.
    status = cli("status")
    assert status.code == 2, status.out + status.err
    headline = status.out.splitlines()[0]
    assert headline.startswith("gpuguard status: CRITICAL - ")
    assert len(headline) <= len("gpuguard status: CRITICAL - ") + 180, headline
    assert headline.count(f"PID {escaped.pid}") == 1, headline
    assert command in headline
    assert "4194301" not in headline
    assert "None" not in status.out
    assert "recoveries did not break" not in status.out  # none was tried: nothing to free

    # metrics: the same loop, a GPU cause, an operator needed.
    metrics = _samples(cli("status", "--prometheus").out)
    assert metrics[f"gpuguard_unit_restart_loop,unit={unit}"] == 1
    assert metrics[f"gpuguard_unit_restart_loop_gpu_cause,unit={unit}"] == 1
    assert metrics[f"gpuguard_unit_needs_operator,unit={unit}"] == 1

    # explain: the journal alone, then with the daemon's lines: a loop systemd ended, no
    # "no loop", nothing healthy, and no disagreement with what the daemon logged.
    story = cli("explain", "--unit", unit, "--json").json()["story"]
    assert story["verdict"].startswith("restart loop: "), story["verdict"]
    assert story["start_limit"]
    assert story["healthy"] is None
    _write_journal(stand_ins, entries + ran.journal)
    text = cli("explain", "--unit", unit).out
    assert "no loop" not in text
    assert "no restart loop" not in text
    told = cli("explain", "--unit", unit, "--json").json()["story"]
    assert told["disagreements"] == [], told["disagreements"]

    # doctor: the start limit ended the recorded loop; its title never says "never" above it.
    doctor = cli("doctor", "--unit", unit, "--json").json()
    [restart] = [f for f in doctor["units"][0]["findings"] if f["code"] == "restart"]
    said = " ".join([restart["title"], *restart["evidence"]])
    assert "1 start-limit hits" in said, said
    assert "never hits the start limit" not in said
