"""The daemon's loop with real processes, real cgroups, the fake NVML and real journal entries.

systemd itself cannot run here outside a container, so two adapters are in-memory twins, passed
in (never patched): the journal follower replays entries recorded from a real systemd 252
(tests/journal_samples), and the unit's systemctl is a small state machine. Everything else is
real: the inventory (unmodified pynvml over the C fake, the /proc walk), the policy, the reaper
with pidfds and signals, the detector, the recovery planner. The end-to-end suite runs the same
daemon against a real systemd.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from subprocess import PIPE
from typing import TYPE_CHECKING, Any, cast

import pytest
import snapshots
from clirunner import CGROUP2
from containergate import FakeEngine
from daemontwins import Recorder, ReplayFollower, UnitTwin, loop_entries
from fakeholder import process_gone
from fakestate import fake_library, fake_pci_bus_id, update_gpu, update_state
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.adapters import inventory, ledgerstore, reaper, runtree, state, systemd
from gpuguard.adapters.containerstop import for_unit
from gpuguard.adapters.engineapi import SOCKETS
from gpuguard.adapters.metricsio import Exporter, serve
from gpuguard.adapters.state import gate_decisions
from gpuguard.config import Settings
from gpuguard.core import values
from gpuguard.core.gate.refusal import last_refusal
from gpuguard.core.ledger import Ledger, SeenProcess
from gpuguard.core.levels import Level
from gpuguard.core.metrics import Latest
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext, StatusReport
from gpuguard.core.status.text import render_text
from gpuguard.core.unitcontainers import Engine
from gpuguard.core.values import MIB
from gpuguard.daemon import wiring
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
from gpuguard.daemonsettings import DEFAULT_TEXTFILE, DaemonSettings, MetricsSettings
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from clirunner import Openers, UnitCgroups

    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ReapResult, ReapTarget

    Entry = dict[str, object]
    from fakeholder import Holder, HolderSpawner

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.unitcontainers import ContainerResult, ContainerVerdict
    from gpuguard.daemon.ports import UnitContainers

SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples" / "bookworm"
OLD_INVOCATION = "0" * 32


@pytest.fixture
def in_process_nvml(fake_nvml_dir: Path, fake_state: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake NVML's state for this process's NVML workers (build names the library)."""
    del fake_nvml_dir  # requested so the build happens (and fails) once, up front
    monkeypatch.setenv("FAKENVML_STATE", str(fake_state))
    return fake_state


def run_worker(
    spawn_holder: HolderSpawner,
    state: Path,
    monkeypatch: pytest.MonkeyPatch,
    invocation: str,
    *gpus: int,
    children: int = 0,
    ignore_sigterm: bool = True,
) -> Holder:
    """A TP worker of run ``invocation`` (its INVOCATION_ID) holding 30000 MiB of each GPU.

    It ignores SIGTERM unless told, as a worker stuck in a drain does.
    """
    monkeypatch.setenv("INVOCATION_ID", invocation)
    worker = spawn_holder(
        state,
        gpus=gpus,
        mib=30000,
        children=children,
        name="sglang::scheduler",
        ignore_sigterm=ignore_sigterm,
    )
    monkeypatch.delenv("INVOCATION_ID")
    return worker


def earlier_run_worker(
    spawn_holder: HolderSpawner,
    state: Path,
    cgroups: UnitCgroups,
    unit: str,
    gpu: int,
    monkeypatch: pytest.MonkeyPatch,
) -> Holder:
    """A worker of an earlier run of ``unit``: in its cgroup, with the old INVOCATION_ID."""
    worker = run_worker(spawn_holder, state, monkeypatch, OLD_INVOCATION, gpu, ignore_sigterm=False)
    cgroups.move(worker.pid, unit)
    return worker


@dataclass
class Harness:
    """One daemon wired to real adapters and the twins, plus what it produced."""

    daemon: Daemon
    unit: UnitTwin
    log: Recorder
    snapshots: list[dict[str, Any]]
    saved: dict[str, dict[str, Any]]


BOOT = "b" * 32
UPTIME_S = 100_000.0
"""Added to time.monotonic() when there are no entries: a host up long enough for old records."""


def build(
    tmp_path: Path,
    state: Path,
    unit: str,
    entries: list[dict[str, object]],
    *,
    dry_run: bool,
    live: bool = True,
    reap_grace_s: float = 1.0,
    watchdog_interval_s: float | None = None,
    recorder: Recorder | None = None,
    gate_environment: dict[str, str] | None = None,
    reap_stopped_survivors: bool = False,
    containers: Callable[[PlanRequest], UnitContainers | None] = lambda _r: None,
    wrap: Callable[[Settings, Ports], Ports] | None = None,
    gate_timeout_s: float = 20.0,
    saved: dict[str, dict[str, Any]] | None = None,
    reaper_twin: Callable[[Sequence[ReapTarget]], tuple[ReapResult, ...]] | None = None,
    kill_mode: str | None = None,
    adopt: tuple[str, ...] = (),
    before_first_read: Callable[[], None] | None = None,
) -> Harness:
    """A daemon for ``unit`` that stops itself after a few idle turns of its loop."""
    settings = Settings(
        units={unit: UnitSettings(adopt=adopt)},
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        device_glob=f"{state}/dev/nvidia*",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        reap_grace_s=reap_grace_s,
        gate_timeout_s=gate_timeout_s,
        daemon=DaemonSettings(dry_run=dry_run, reap_stopped_survivors=reap_stopped_survivors),
    )
    newest = max((int(str(e["__REALTIME_TIMESTAMP"])) for e in entries), default=0) / 1e6
    # The daemon's monotonic clock is the journal's: a second after the newest recorded entry.
    newest_mono = max((int(str(e["__MONOTONIC_TIMESTAMP"])) for e in entries), default=None)
    shift = UPTIME_S if newest_mono is None else newest_mono / 1e6 + 1.0 - time.monotonic()
    twin = UnitTwin(
        invocation=str(entries[-1]["INVOCATION_ID"]) if entries else "a" * 32, kill_mode=kill_mode
    )
    recorder = recorder or Recorder()
    snapshots: list[dict[str, Any]] = []
    saved = {} if saved is None else saved
    turns = [0]
    holder: list[Daemon] = []

    def sleep(seconds: float) -> None:
        turns[0] += 1
        if turns[0] > 3:
            holder[0].request_stop()
        del seconds

    def reap(_unit: str, targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        if reaper_twin is not None:
            return reaper_twin(targets)
        return reaper.reap(targets, grace_s=settings.reap_grace_s, logger=recorder)

    ports = Ports(
        gather=lambda: inventory.gather(settings),
        show_unit=twin.show,
        control=twin.control,
        reap=reap,
        notifier=recorder,
        log=recorder,
        wall=lambda: newest + 1.0,
        monotonic=lambda: time.monotonic() + shift,
        sleep=sleep,
        write_snapshot=snapshots.append,
        load_unit_state=saved.get,
        save_unit_state=saved.__setitem__,
        untouchable=frozenset({os.getpid()}),
        provenance=systemd.provenance,
        boot_id=BOOT,
        watchdog_interval_s=watchdog_interval_s,
        gate_environment=lambda _unit: gate_environment,
        gate_refusal=lambda unit: last_refusal(gate_decisions(settings.runtime_dir, unit)),
        containers=containers,
    )
    follower = ReplayFollower(entries, live=live, before_first_read=before_first_read)
    daemon = Daemon(settings, follower, wrap(settings, ports) if wrap else ports)
    holder.append(daemon)
    return Harness(daemon, twin, recorder, snapshots, saved)


def test_loop_with_stale_holders_is_recovered(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    opener: Openers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart loop while an earlier run's workers hold the GPUs: stop, reap, start."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    for gpu in range(4):
        update_gpu(in_process_nvml, gpu, release_delay_ms=300)
    stale = run_worker(
        spawn_holder, in_process_nvml, monkeypatch, OLD_INVOCATION, 0, 1, 2, 3, children=2
    )
    for pid in (stale.pid, *stale.children):
        unit_cgroups.move(pid, unit)
    bystander = opener(in_process_nvml, "gpu-exporter", 1)
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {unit}", f"reset-failed {unit}", f"start {unit}"]
    assert all(process_gone(pid) for pid in (stale.pid, *stale.children))
    assert not process_gone(bystander)
    warning = next(f for level, event, f in harness.log.lines if event == "restart loop")
    assert warning["cause"] == "stale-gpu-holders"
    assert warning["action"] == "recover"
    finished = next(f for _, event, f in harness.log.lines if event == "recovery finished")
    assert finished["result"] == "restarted"
    signals = [f for _, event, f in harness.log.lines if event == "signal"]
    assert {f["pid"] for f in signals} == {stale.pid, *stale.children}
    last = harness.snapshots[-1]["units"][unit]
    assert last["recoveries"][-1]["result"] == "restarted"
    assert harness.saved[unit]["in_progress"] is None
    assert harness.log.notes[0].startswith("READY")


def test_recovery_asks_the_units_container_stopper_before_the_start(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recovery's gate runs the unit's container stopper (containerstop) after the stop.

    The stopper itself is tested against an engine in test_container_engine.py; here it is a
    recorder, to show that the daemon hands it the stopped unit (no live run) and its GPUs,
    and calls it on the gate's inventories before the start.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 2, monkeypatch)
    asked: list[PlanRequest] = []
    seen: list[Inventory] = []

    class Stopper:
        """Records the gate's inventories; no container holds a GPU, so nothing is planned."""

        def __call__(self, inventory: Inventory) -> bool:
            seen.append(inventory)
            return False

        def plan(self, inventory: Inventory) -> tuple[ContainerVerdict, ...]:
            del inventory
            return ()

        def act(self, verdict: ContainerVerdict) -> ContainerResult | None:
            raise AssertionError(verdict)

    def stopper_for(request: PlanRequest) -> Stopper:
        asked.append(request)
        return Stopper()

    harness = build(
        tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False, containers=stopper_for
    )

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {unit}", f"reset-failed {unit}", f"start {unit}"]
    assert [(r.unit, r.live_invocation) for r in asked] == [(unit, None)]
    assert seen
    assert any(2 in {use.gpu_index for h in i.holders for use in h.gpus} for i in seen)


def test_recovery_uses_the_gpu_set_the_gate_recorded(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate saw CUDA_VISIBLE_DEVICES=3 (an EnvironmentFile= value systemctl show lacks).

    An earlier run's worker on GPU 2 is then outside the unit's set: the daemon's recovery must
    not reap it, as the gate would not; with systemd's environment alone it would (all GPUs).
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    worker = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 2, monkeypatch)
    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        loop_entries(unit),
        dry_run=False,
        gate_environment={"CUDA_VISIBLE_DEVICES": "3"},
    )

    assert harness.daemon.run() == 0

    assert not process_gone(worker.pid)
    assert not [f for _, event, f in harness.log.lines if event == "signal"]


def test_loop_without_gpu_cause_is_only_reported(tmp_path: Path, in_process_nvml: Path) -> None:
    """The same exit every time on idle GPUs: reported as not GPU-related, nothing is touched."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    warning = next(f for _, event, f in harness.log.lines if event == "restart loop")
    assert warning["cause"] == "not-gpu-related"
    assert warning["action"] == "report"
    assert not any(event == "signal" for _, event, _ in harness.log.lines)
    assert harness.snapshots[-1]["units"][unit]["action"] == "report"


def test_loop_on_a_gpu_needing_a_reset_goes_to_needs_operator(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stale worker on GPU 2, whose row remap is pending: nothing is stopped or reaped."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 2, monkeypatch)
    update_gpu(in_process_nvml, 2, remapped_rows_pending=1)
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not process_gone(stale.pid)
    (level, _, fields) = next(line for line in harness.log.lines if line[1] == "needs operator")
    assert level == "error"
    assert fields["cause"] == "gpu-needs-reset"
    assert fields["cause_detail"] == "GPU 2: a memory row remap is pending"
    last = harness.snapshots[-1]["units"][unit]
    assert last["needs_operator"] is True
    assert last["action"] == "needs-operator"
    assert last["recoveries"] == []


def test_xid_79_loop_stops_at_needs_operator_and_status_says_reboot(
    tmp_path: Path, in_process_nvml: Path
) -> None:
    """The issue's scenario without a container: Xid 79 on GPU 1, and the unit loops.

    The kernel logs Xid 79 for PCI 3b (GPU 1), NVML calls GPU 1 lost. Nothing is stopped or
    reaped; the daemon stops at needs operator; status, from the same snapshot and a fresh
    inventory, says GPU 1 needs a reboot and shows the Xid, which NVML cannot place (a lost
    GPU has no address in NVML) next to the GPU that has none.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    update_gpu(in_process_nvml, 1, lost=True)
    entries = loop_entries(unit)
    last = entries[-1]
    xid = kernel_line(
        "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus.",
        last,
        -1,
        "xid",
    )
    harness = build(tmp_path, in_process_nvml, unit, [xid, *entries], dry_run=False)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    operator = next(f for _, event, f in harness.log.lines if event == "needs operator")
    assert operator["cause"] == "gpu-needs-reset"
    assert operator["cause_detail"] == "GPU 1: GPU is lost (fallen off the bus)"
    snapshot = harness.snapshots[-1]
    assert snapshot["units"][unit]["needs_operator"] is True
    report = status_report(tmp_path, in_process_nvml, unit, snapshot)
    text = render_text(report)
    assert report.level is Level.CRITICAL
    assert "GPU 1 needs a reboot (GPU is lost (fallen off the bus))" in text
    assert f"{unit} needs an operator: a GPU of its set needs a reset" in text
    assert (
        "kernel Xid for PCI 0000:3b:00, which NVML does not know (NVML cannot tell the address "
        "of GPU 1: it may be that one): Xid 79 (reboot)"
    ) in text


def test_a_kernel_line_that_says_a_gpu_hangs_is_a_gpu_health_finding(
    tmp_path: Path, in_process_nvml: Path
) -> None:
    """nvidia-modeset's "Error while waiting for GPU progress": logged, kept, a status WARNING."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = loop_entries(unit)
    # NVIDIA/open-gpu-kernel-modules pull request #1252's excerpt, as the kernel logs it.
    text = (
        "nvidia-modeset: ERROR: GPU:0: Error while waiting for GPU progress: "
        "0x0000ca7d:0 2:0:200:192"
    )
    hung = kernel_line(text, entries[-1], -1, "hung")
    harness = build(tmp_path, in_process_nvml, unit, [hung, *entries], dry_run=True)

    assert harness.daemon.run() == 0

    said = next(f for _, event, f in harness.log.lines if event == "kernel says a GPU hangs")
    assert said["gpu"] == "GPU:0"
    assert said["line"] == text
    [kept] = harness.snapshots[-1]["xid"]["hung"]
    assert kept["text"] == text
    report = status_report(tmp_path, in_process_nvml, unit, harness.snapshots[-1])
    [finding] = [f for f in report.findings if "the kernel says a GPU hangs" in f.message]
    assert finding.level is Level.WARNING
    assert "nvidia-modeset waited for GPU progress in vain (GPU:0, as nvidia-modeset" in (
        finding.message
    )
    assert text in finding.message
    assert "a reset or reboot may be needed" in finding.message


def beside(entry: Entry, offset_us: int, tag: str, **fields: object) -> Entry:
    """A line of ``entry``'s boot ``offset_us`` after (or before) it, its cursor tagged ``tag``."""
    return {
        **fields,
        "_BOOT_ID": entry["_BOOT_ID"],
        "__CURSOR": f"{entry['__CURSOR']}-{tag}",
        "__REALTIME_TIMESTAMP": str(int(str(entry["__REALTIME_TIMESTAMP"])) + offset_us),
        "__MONOTONIC_TIMESTAMP": str(int(str(entry["__MONOTONIC_TIMESTAMP"])) + offset_us),
    }


def kernel_line(message: str, entry: Entry, offset_us: int, tag: str) -> Entry:
    """A kernel-transport line beside ``entry`` (see ``beside``)."""
    return beside(entry, offset_us, tag, _TRANSPORT="kernel", MESSAGE=message)


def status_report(tmp_path: Path, state: Path, unit: str, snapshot: dict[str, Any]) -> StatusReport:
    """What `gpuguard status` judges now, reading the daemon's ``snapshot`` for ``unit``."""
    settings = Settings(
        units={unit: UnitSettings()},
        device_glob=f"{state}/dev/nvidia*",
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        state_dir=tmp_path / "lib",
    )
    context = StatusContext(
        watched_units={unit: UnitSettings().patterns},
        protected_names=settings.protected_processes,
        idle_threshold_bytes=settings.idle_threshold_mib * MIB,
        as_root=os.geteuid() == 0,
        daemon=snapshots.running(snapshots.read_back(snapshot)),
    )
    return assess(inventory.gather(settings), context, datetime.now(timezone.utc))


def _kernel_xid(code: int, pci_bus: int, entry: Entry, offset_us: int) -> Entry:
    """A kernel Xid line for PCI bus ``pci_bus`` ``offset_us`` after (or before) ``entry``."""
    message = f"NVRM: Xid (PCI:0000:{pci_bus:02x}:00): {code}, pid=4242, name=python3, GSP"
    return kernel_line(message, entry, offset_us, f"xid{code}")


def test_reset_class_xid_on_a_gpu_nvml_calls_healthy_stops_at_needs_operator(
    tmp_path: Path, in_process_nvml: Path
) -> None:
    """Xid 119 (GSP timeout) on GPU 1 after the unit was started: the Xid alone decides.

    NVML reports every GPU healthy; the kernel's Xid for GPU 1's address, logged after the
    operator's start and before the loop, makes the cause gpu-needs-reset: nothing is stopped
    or reaped, and the snapshot hands the fault to the gate.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = loop_entries(unit)
    bus = int(fake_pci_bus_id(1).split(":")[1], 16)
    xid = _kernel_xid(119, bus, entries[0], 1)  # just after the first (operator's) start
    harness = build(
        tmp_path, in_process_nvml, unit, [*entries[:1], xid, *entries[1:]], dry_run=False
    )

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    operator = next(f for _, event, f in harness.log.lines if event == "needs operator")
    assert operator["cause"] == "gpu-needs-reset"
    assert "GPU 1 had Xid 119 (GSP RPC timeout)" in str(operator["cause_detail"])
    assert "it needs a GPU reset" in str(operator["cause_detail"])
    (fault,) = harness.snapshots[-1]["units"][unit]["reset_xids"]
    assert fault["code"] == 119
    assert fault["pci_bus_id"] == f"0000:{bus:02x}:00"


def test_reset_class_xid_before_a_start_by_hand_no_longer_counts(
    tmp_path: Path, in_process_nvml: Path
) -> None:
    """The operator reset the GPU and started the unit: an Xid from before that start is past.

    The same Xid 119 logged just before the first start (not scheduled by PID 1 as a restart)
    neither causes gpu-needs-reset nor reaches the gate through the snapshot.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = loop_entries(unit)
    bus = int(fake_pci_bus_id(1).split(":")[1], 16)
    xid = _kernel_xid(119, bus, entries[0], -1)
    harness = build(tmp_path, in_process_nvml, unit, [xid, *entries], dry_run=False)

    assert harness.daemon.run() == 0

    verdicts = [f for _, event, f in harness.log.lines if "cause" in f]
    assert verdicts
    assert all(f["cause"] != "gpu-needs-reset" for f in verdicts)
    assert harness.snapshots[-1]["units"][unit]["reset_xids"] == []
    assert harness.snapshots[-1]["xid"]["recent"][0]["code"] == 119  # still shown by status


def test_the_device_an_oom_line_names_is_the_units_gpu_with_its_holder(
    tmp_path: Path, in_process_nvml: Path, spawn_holder: HolderSpawner
) -> None:
    """An OOM line naming GPU 1, from a unit with CUDA_VISIBLE_DEVICES=2,3, means GPU 3.

    Another job holds GPU 3 (not the unit's, so not stale): the diagnosis names it as what
    GPU 3 is held by; nothing is reaped, and since no recovery could free GPU 3 the unit goes
    to needs operator instead (never worse).
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    other = spawn_holder(in_process_nvml, gpus=(3,), mib=20000, name="trainer")
    entries = loop_entries(unit)
    last = entries[-5]  # the last run's main process exit
    oom = beside(
        last,
        -1,
        "oom",
        _TRANSPORT="stdout",
        _PID="4242",
        _UID="0",
        _SYSTEMD_UNIT=unit,
        _SYSTEMD_CGROUP=f"/system.slice/{unit}",
        _SYSTEMD_INVOCATION_ID=last["INVOCATION_ID"],
        MESSAGE="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 1 has a total capacity of 79.15 GiB of which 3.19 MiB is free.",
    )
    entries.insert(len(entries) - 5, oom)
    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        entries,
        dry_run=True,
        gate_environment={"CUDA_VISIBLE_DEVICES": "2,3"},
    )

    assert harness.daemon.run() == 0

    loop = next(f for _, event, f in harness.log.lines if event == "needs operator")
    detail = str(loop["cause_detail"])
    assert loop["cause"] == "stale-gpu-holders"
    assert loop["action"] == "needs-operator"
    assert "GPU 1 has a total capacity" in detail
    assert f"; cuda:1 = GPU 3 (20000 MiB used), held by PID {other.pid} (trainer, " in detail
    assert "(no stale holder found now)" in detail
    assert not process_gone(other.pid)


@pytest.mark.parametrize(
    ("kill_mode", "event"),
    [
        ("mixed", "dry run: would recover"),
        ("process", "needs operator: gpuguard cannot prove who holds the GPUs"),
    ],
)
def test_a_spared_process_in_the_units_cgroup_blocks_a_recovery_only_if_the_stop_leaves_it(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    kill_mode: str,
    event: str,
) -> None:
    """A protected process inside the looping unit's cgroup: its KillMode= says if a stop ends it.

    An earlier run's worker there makes the loop one to recover; the plan never signals the
    other (nv-hostengine is protected). With KillMode=mixed systemd's stop SIGKILLs everything
    left in the cgroup, so the daemon would recover; with KillMode=process the stop signals the
    main process alone, so it would stay and the daemon asks an operator. Before, the daemon
    recovered under both.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = run_worker(spawn_holder, in_process_nvml, monkeypatch, OLD_INVOCATION, 1)
    kept = spawn_holder(in_process_nvml, gpus=(0,), mib=20000, name="nv-hostengine")
    unit_cgroups.move(stale.pid, unit)
    unit_cgroups.move(kept.pid, unit)
    harness = build(
        tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=True, kill_mode=kill_mode
    )

    assert harness.daemon.run() == 0

    events = [name for _, name, _ in harness.log.lines]
    assert event in events, harness.log.lines
    if kill_mode == "process":
        blocked = next(f for _, name, f in harness.log.lines if name == event)
        assert f"PID {kept.pid} (nv-hostengine) on GPU 0" in str(blocked["blockers"])
    assert harness.unit.calls == []  # a dry run stops nothing either way
    assert not process_gone(kept.pid)
    assert not process_gone(stale.pid)


def test_a_holder_sigkill_leaves_after_an_xid_naming_it_stops_the_loop_at_needs_operator(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Xid 31 named an earlier run's worker; SIGKILL does not end it; the next loop stops.

    A process that survives SIGKILL needs a driver fault no test can cause, so here alone the
    reaper is a twin that reports ``unkillable`` and signals nothing (everything else is real).
    The first daemon recovers once and records the worker as stuck after Xid 31; a second one,
    from that saved state, sees the same worker still holding GPU 1 and stops at needs
    operator instead of reaping it again.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stuck = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 1, monkeypatch)
    # The recorded loop moved to now on this boot's clock: after the worker started.
    uptime_us = int(float(Path("/proc/uptime").read_text().split()[0]) * 1e6)
    entries = loop_entries(unit)
    shift_us = uptime_us - int(str(entries[0]["__MONOTONIC_TIMESTAMP"]))
    for entry in entries:
        entry["__MONOTONIC_TIMESTAMP"] = str(int(str(entry["__MONOTONIC_TIMESTAMP"])) + shift_us)
    xid = {
        **_kernel_xid(31, 0x3B, entries[0], 1),
        "MESSAGE": f"NVRM: Xid (PCI:0000:3b:00): 31, pid={stuck.pid}, name=python3, MMU Fault",
    }
    tried: list[int] = []

    def unkillable(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        tried.extend(t.identity.pid for t in targets)
        return tuple(
            values.ReapResult(t, values.ReapOutcome.UNKILLABLE, ("SIGTERM", "SIGKILL"), "R")
            for t in targets
        )

    saved: dict[str, dict[str, Any]] = {}
    first = build(
        tmp_path,
        in_process_nvml,
        unit,
        [xid, *entries],
        dry_run=False,
        gate_timeout_s=0.5,
        saved=saved,
        reaper_twin=unkillable,
    )
    assert first.daemon.run() == 0
    (recovery,) = saved[unit]["recoveries"]
    (reaped,) = recovery["reaped"]
    assert reaped["pid"] == stuck.pid
    assert reaped["stuck_after_xid"] == 31
    assert reaped["detail"].startswith("stuck in the driver after Xid 31 (GPU memory page fault)")

    tried.clear()
    second = build(
        tmp_path,
        in_process_nvml,
        unit,
        [xid, *entries],
        dry_run=False,
        gate_timeout_s=0.5,
        saved=saved,
        reaper_twin=unkillable,
    )
    assert second.daemon.run() == 0
    assert tried == []
    assert second.unit.calls == []
    operator = next(f for _, event, f in second.log.lines if event == "needs operator")
    assert operator["cause"] == "gpu-needs-reset"
    detail = str(operator["cause_detail"])
    assert f"GPU 1: PID {stuck.pid} (sglang::schedul" in detail
    assert "is stuck in the driver after Xid 31" in detail
    assert not process_gone(stuck.pid)


def test_kernel_xids_are_kept_for_status_and_malformed_ones_counted(
    tmp_path: Path, in_process_nvml: Path
) -> None:
    """A kernel Xid 79 and a garbled Xid line beside a loop: one kept, one counted."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = loop_entries(unit)
    last = entries[-1]

    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off"
    garbled = "NVRM: Xid (PCI:0000:3b:00): seventy-nine"
    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        [kernel_line(xid, last, 1, "k1"), kernel_line(garbled, last, 2, "k2"), *entries],
        dry_run=False,
    )

    assert harness.daemon.run() == 0

    snapshot = harness.snapshots[-1]["xid"]
    assert snapshot["malformed"] == 1
    (kept,) = snapshot["recent"]
    assert kept["code"] == 79
    assert kept["xid_class"] == "reboot"
    assert kept["pci_bus_id"] == "0000:3b:00"
    assert kept["pid"] is None
    logged = next(f for _, event, f in harness.log.lines if event == "kernel xid")
    assert logged["code"] == 79


def _said_what_it_would_do(harness: Harness, unit: str) -> None:
    would = next(f for _, event, f in harness.log.lines if event == "dry run: would recover")
    assert would["unit"] == unit
    assert harness.snapshots[-1]["units"][unit]["recoveries"][-1]["result"] == "dry-run"


def _saw_no_loop(harness: Harness, unit: str) -> None:
    assert not any(event == "restart loop" for _, event, _ in harness.log.lines), unit


def _reported_as_stopped_on_purpose(harness: Harness, unit: str) -> None:
    last = harness.snapshots[-1]["units"][unit]
    assert last["action"] == "report"
    assert "stopped on purpose" in last["action_reason"]


@pytest.mark.parametrize(
    ("dry_run", "live", "active", "said"),
    [
        pytest.param(True, True, "activating", _said_what_it_would_do, id="dry-run"),
        pytest.param(False, False, "activating", _saw_no_loop, id="replayed-history"),
        pytest.param(False, True, "inactive", _reported_as_stopped_on_purpose, id="inactive-unit"),
    ],
)
def test_a_gpu_caused_loop_is_not_acted_on(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    *,
    dry_run: bool,
    live: bool,
    active: str,
    said: Callable[[Harness, str], None],
) -> None:
    """A GPU-caused loop with an earlier run's worker on GPU 2: nothing stopped or signalled.

    With dry_run it is logged as what would be done. The same loop replayed as history at start
    rebuilds the window but triggers nothing. The unit inactive (nothing will restart it): only
    reported.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 2, monkeypatch)
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=dry_run, live=live)
    harness.unit.active = active

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not process_gone(stale.pid)
    assert not any(event == "signal" for _, event, _ in harness.log.lines)
    said(harness, unit)


def crash_then_restart_entries(unit: str, left_over_pid: int, comm: str) -> list[Entry]:
    """PID 1's lines (systemd 252) of one crash and its restart, which finds ``left_over_pid``.

    The left-over line is systemd's, logged just before the restart's start.
    """
    recorded = loop_entries(unit)[:6]  # run 1 failed, restart scheduled, stopped; run 2 started
    started = recorded[-1]
    found = dict(started) | {
        "MESSAGE": f"{unit}: Found left-over process {left_over_pid} ({comm}) in control group "
        "while starting unit. Ignoring.",
        "__CURSOR": f"{started['__CURSOR']};left-over",
        "__MONOTONIC_TIMESTAMP": str(int(str(started["__MONOTONIC_TIMESTAMP"])) - 1000),
        "__REALTIME_TIMESTAMP": str(int(str(started["__REALTIME_TIMESTAMP"])) - 1000),
        "CODE_FUNC": "unit_log_leftover_process_start",
        "PRIORITY": "4",
    }
    found.pop("JOB_TYPE", None)
    found.pop("JOB_RESULT", None)
    found.pop("MESSAGE_ID", None)
    return [*recorded[:-1], found, started]


def test_one_crash_and_a_restart_beside_a_left_over_holding_nothing_is_no_loop(
    tmp_path: Path, in_process_nvml: Path, spawn_holder: HolderSpawner
) -> None:
    """A crash, its restart loading, a left-over that holds no GPU: no loop, nothing stopped.

    Real vLLM 0.32.0 leaves multiprocessing's resource_tracker ("python") behind a crashed API
    server; the restart's engine holds the GPU (issue 34: status said "restart loop").
    """
    unit = f"vllm-{uuid.uuid4().hex[:8]}.service"
    tracker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE)
    with tracker:
        spawn_holder(in_process_nvml, gpus=(0,), mib=30000, name="VLLM::EngineCor")
        entries = crash_then_restart_entries(unit, tracker.pid, "python")
        harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=False)

        assert harness.daemon.run() == 0
        tracker.kill()

    assert harness.unit.calls == []
    last = harness.snapshots[-1]["units"][unit]
    assert last["looping"] is False
    verdicts = [f for _, event, f in harness.log.lines if event == "verdict"]
    assert any(
        f"left-over process {tracker.pid} (python)" in line
        and "holding none of the unit's GPUs" in line
        for f in verdicts
        for line in cast("list[str]", f.get("findings", []))
    )
    assert not any(event == "restart loop" for _, event, _ in harness.log.lines)


def test_one_crash_and_a_restart_beside_a_left_over_holding_a_gpu_is_a_loop(
    tmp_path: Path, in_process_nvml: Path, spawn_holder: HolderSpawner
) -> None:
    """The same restart beside a left-over that holds a GPU of the unit: an immediate loop."""
    unit = f"vllm-{uuid.uuid4().hex[:8]}.service"
    worker = spawn_holder(in_process_nvml, gpus=(0,), mib=30000, name="VLLM::Worker")
    entries = crash_then_restart_entries(unit, worker.pid, "VLLM::Worker")
    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=True)

    assert harness.daemon.run() == 0

    last = harness.snapshots[-1]["units"][unit]
    assert last["looping"] is True
    assert f"left-over process {worker.pid} (VLLM::Worker)" in last["verdict"]


# --- the operator's intent ----------------------------------------------------------------------


def timed_out_stop_entries(unit: str, invocation: str, job_type: str, at_us: int) -> list[Entry]:
    """A recorded run (systemd 252) whose stop timed out, as a ``job_type`` job, moved to ``at_us``.

    The sample is an operator's `systemctl stop`; ``job_type="restart"`` is the same stop as a
    restart job logs it. Times keep their spacing; cursors and the invocation are made unique.
    """
    lines = (SAMPLES / "stop-sigterm-timeout.jsonl").read_text().splitlines()
    recorded = [json.loads(line) for line in lines]
    pid1 = [e for e in recorded if e.get("_PID") == "1" and e.get("UNIT") == "sglang.service"]
    first = int(pid1[0]["__MONOTONIC_TIMESTAMP"])
    moved = []
    for number, entry in enumerate(pid1):
        shift = int(entry["__MONOTONIC_TIMESTAMP"]) - first
        changed = dict(entry) | {
            "UNIT": unit,
            "INVOCATION_ID": invocation,
            "__CURSOR": f"s=0;i={invocation[:8]}{number:x}",
            "__MONOTONIC_TIMESTAMP": str(at_us + shift),
            "__REALTIME_TIMESTAMP": str(1_795_970_000_000_000 + at_us + shift),
        }
        if "JOB_TYPE" in changed:
            changed["JOB_TYPE"] = job_type if changed["JOB_TYPE"] == "stop" else changed["JOB_TYPE"]
        moved.append(changed)
    return moved


def test_an_operators_stop_is_never_undone(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart, then the operator's stop, both timing out, stale holders on the GPU: no action.

    On main: an "immediate restart loop", and a recovery ending in `systemctl start` of the unit
    the operator had just stopped.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 1, monkeypatch)
    entries = [
        *timed_out_stop_entries(unit, "1" * 32, "restart", 1_000_000_000),
        *timed_out_stop_entries(unit, "2" * 32, "stop", 1_010_000_000),
    ]
    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=False)
    harness.unit.active = "failed"  # a stop that timed out leaves the unit failed

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not process_gone(stale.pid)
    assert not any(event == "restart loop" for _, event, _ in harness.log.lines)
    verdict = harness.snapshots[-1]["units"][unit]
    assert not verdict["looping"]
    assert "stopped by a stop job" in verdict["verdict"]


# --- interrupted recoveries ----------------------------------------------------------------------


def interrupted_record(*, boot: str | None, age_s: float, invocation: str) -> dict[str, Any]:
    """A recovery record left by a daemon that died mid-recovery ``age_s`` ago."""
    return {
        "started_at": "2026-12-01T00:00:00+00:00",
        "started_monotonic_s": time.monotonic() + UPTIME_S - age_s,
        "boot_id": boot,
        "invocation_id": invocation,
        "reason": "3 failed runs in a row",
        "evidence": [],
        "planned_pids": [],
    }


@pytest.mark.parametrize(
    ("boot", "age_s", "dry_run", "active", "why"),
    [
        pytest.param("c" * 32, 5.0, False, "failed", "another boot", id="another-boot"),
        pytest.param(None, 5.0, False, "failed", "another boot", id="boot-unknown"),
        pytest.param(BOOT, 5000.0, False, "failed", "younger than", id="old-record"),
        pytest.param(BOOT, 5.0, True, "failed", "dry_run", id="dry-run"),
        pytest.param(BOOT, 5.0, False, "active", "started it since", id="unit-runs-again"),
    ],
)
def test_an_interrupted_recovery_is_resumed_only_when_safe(
    tmp_path: Path,
    in_process_nvml: Path,
    boot: str | None,
    age_s: float,
    *,
    dry_run: bool,
    active: str,
    why: str,
) -> None:
    """Another boot, an old record, dry_run or a unit running again: closed as abandoned.

    The unit is left alone. On main any record was resumed at start: a record from another boot
    stopped and started a healthy unit, and dry_run did not prevent it. Same boot and young, but
    the unit runs again (someone started it; its state alone says so): not resumed either.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    harness = build(tmp_path, in_process_nvml, unit, [], dry_run=dry_run)
    harness.unit.active = active
    record = interrupted_record(boot=boot, age_s=age_s, invocation=harness.unit.invocation)
    harness.saved[unit] = {"in_progress": record}

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert harness.saved[unit]["in_progress"] is None
    closed = harness.saved[unit]["recoveries"][-1]
    assert closed["result"] == "abandoned"
    assert why in closed["problem"]
    line = next(
        f for _, event, f in harness.log.lines if event == "interrupted recovery not resumed"
    )
    assert why in str(line["reason"])


def test_a_fresh_interrupted_recovery_is_finished(tmp_path: Path, in_process_nvml: Path) -> None:
    """A young record of the same boot, the unit still stopped: stop (a no-op), reset, start."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    harness = build(tmp_path, in_process_nvml, unit, [], dry_run=False)
    harness.unit.active = "failed"
    record = interrupted_record(boot=BOOT, age_s=5, invocation=harness.unit.invocation)
    harness.saved[unit] = {"in_progress": record}

    assert harness.daemon.run() == 0

    assert harness.unit.calls == [f"stop {unit}", f"reset-failed {unit}", f"start {unit}"]
    assert harness.saved[unit]["recoveries"][-1]["result"] == "restarted"


# --- hostile state ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "saved",
    [
        {"planner": [1]},
        {"planner": {"attempts_without_help": "x", "needs_operator": 1}},
        {"recoveries": "x", "in_progress": 5},
        {"recoveries": [1, {"result": "restarted"}], "in_progress": [2]},
    ],
)
def test_a_state_file_of_the_wrong_shape_starts_fresh(
    tmp_path: Path, in_process_nvml: Path, saved: dict[str, Any]
) -> None:
    """Valid JSON with wrong types (main: a crash at start) is named in a warning and ignored."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False)
    harness.saved[unit] = saved

    assert harness.daemon.run() == 0

    assert any(event == "saved state ignored in part" for _, event, _ in harness.log.lines)
    assert harness.log.notes[0].startswith("READY")
    assert not harness.snapshots[-1]["units"][unit]["needs_operator"]


# --- the watchdog ---------------------------------------------------------------------------------


@dataclass
class TimedRecorder(Recorder):
    """A recorder that also keeps when each WATCHDOG=1 was sent."""

    pings: list[float] = field(default_factory=list)

    def watchdog(self) -> None:
        """Keep the time of the ping."""
        self.pings.append(time.monotonic())
        super().watchdog()


@pytest.mark.parametrize(("slow", "reap_grace_s"), [("reap", 3.0), ("nvml", 0.0)])
def test_the_watchdog_is_fed_through_long_steps(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    slow: str,
    reap_grace_s: float,
) -> None:
    """A 3 s reap grace, or NVML answering in 1.5 s, leaves no gap over one ping interval.

    On main the daemon sent nothing while it reaped and gathered (gaps of 36 s and 45 s against
    WatchdogSec=30); here the interval is 0.4 s, so a silent long step is plainly visible.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = run_worker(spawn_holder, in_process_nvml, monkeypatch, OLD_INVOCATION, 0)
    unit_cgroups.move(stale.pid, unit)
    if slow == "nvml":
        update_state(in_process_nvml, block_call="nvmlDeviceGetCount_v2", block_ms=1500)
    recorder = TimedRecorder()
    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        loop_entries(unit),
        dry_run=False,
        reap_grace_s=reap_grace_s,
        watchdog_interval_s=0.4,
        recorder=recorder,
    )
    started = time.monotonic()

    assert harness.daemon.run() == 0

    finished = time.monotonic()
    assert process_gone(stale.pid)
    assert harness.unit.calls[-1] == f"start {unit}"
    assert finished - started >= 3.0
    times = [started, *recorder.pings, finished]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.8


# -- survivors of a run that just ended (issue 15) ---------------------------------------------


def seen_from(pid: int) -> list[SeenProcess]:
    """The process ``pid`` and its descendants, as the ledger's walk read them."""
    return [walked.process for walked in runtree.descendants([pid])]


def crashed_run_entries(unit: str) -> list[Entry]:
    """PID 1's messages of one run that crashed (systemd 252), up to its scheduled restart."""
    entries = loop_entries(unit)
    first = entries[0]["INVOCATION_ID"]
    return [e for e in entries if e["INVOCATION_ID"] == first]


def sweep_lines(harness: Harness) -> list[dict[str, object]]:
    """What the daemon said about survivors of ended runs."""
    return [f for _, event, f in harness.log.lines if event == "survivors of an ended run"]


def test_survivors_of_a_crashed_run_are_reaped_at_its_end(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main process crashed; a worker in the cgroup and one that escaped it still hold GPUs.

    Both carry the crashed run's INVOCATION_ID: reaped at once, no failed start needed, and no
    systemctl call (systemd restarts the unit itself after RestartSec=).
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    inside = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 0)
    unit_cgroups.move(inside.pid, unit)
    escaped = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 1)
    unit_cgroups.move(escaped.pid, f"run-r{uuid.uuid4().hex[:8]}.scope")
    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=False)

    assert harness.daemon.run() == 0

    assert process_gone(inside.pid)
    assert process_gone(escaped.pid)
    assert harness.unit.calls == []
    signals = {f["pid"] for _, event, f in harness.log.lines if event == "signal"}
    assert signals == {inside.pid, escaped.pid}
    [said] = sweep_lines(harness)
    assert said["invocation_id"] == crashed
    assert str(said["summary"]).startswith(f"reaped 2 survivors of run {crashed[:8]} within ")
    assert "GPUs idle at +" in str(said["summary"])
    [record] = harness.snapshots[-1]["units"][unit]["survivors"]
    assert record["result"] == "reaped"
    assert sorted(record["pids"]) == sorted([inside.pid, escaped.pid])
    assert record["idle_after_s"] is not None
    assert record["idle_after_s"] >= record["reaped_after_s"] >= 0


def test_a_survivor_sigkill_has_not_ended_is_dying_not_reaped(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL left the crashed run's worker alive: the sweep says dying, never reaped."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    worker = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 0)
    unit_cgroups.move(worker.pid, unit)

    def unkillable(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        return tuple(
            values.ReapResult(t, values.ReapOutcome.UNKILLABLE, ("SIGTERM", "SIGKILL"))
            for t in targets
        )

    harness = build(
        tmp_path, in_process_nvml, unit, entries, dry_run=False, reaper_twin=unkillable,
        gate_timeout_s=1.0,
    )  # fmt: skip

    assert harness.daemon.run() == 0

    assert not process_gone(worker.pid)
    [said] = sweep_lines(harness)
    summary = str(said["summary"])
    assert not summary.startswith("reaped 1 survivor")
    assert "reaped 0 survivors" in summary
    assert "1 survivor SIGKILLed but still alive (dying" in summary
    [record] = harness.snapshots[-1]["units"][unit]["survivors"]
    assert record["reaped_after_s"] is None
    assert record["pids"] == []


def test_the_next_run_and_other_runs_are_never_touched(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next run is already starting: only the ended run's processes go, by invocation.

    The next run's worker (live) and an older run's left-over (stale, but not this run's: the
    gate or a loop recovery decide about it) stay; the GPUs are not idle, so the sweep says so
    and returns.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    nxt = uuid.uuid4().hex
    ended = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 0)
    live = run_worker(spawn_holder, in_process_nvml, monkeypatch, nxt, 1)
    older = run_worker(spawn_holder, in_process_nvml, monkeypatch, OLD_INVOCATION, 2)
    for pid in (ended.pid, live.pid, older.pid):
        unit_cgroups.move(pid, unit)
    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=False)
    harness.unit.invocation = nxt  # systemd names the run that is starting

    assert harness.daemon.run() == 0

    assert process_gone(ended.pid)
    assert not process_gone(live.pid)
    assert not process_gone(older.pid)
    assert {f["pid"] for _, event, f in harness.log.lines if event == "signal"} == {ended.pid}
    [record] = harness.snapshots[-1]["units"][unit]["survivors"]
    assert record["result"] == "reaped, GPUs not idle"
    assert "GPUs not idle" in record["summary"]


def test_survivors_of_an_operators_stop_are_reported_unless_configured(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop job ended the run: its survivor is named, not killed; configured, it is reaped."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stopped = uuid.uuid4().hex
    worker = run_worker(spawn_holder, in_process_nvml, monkeypatch, stopped, 0)
    unit_cgroups.move(worker.pid, f"run-r{uuid.uuid4().hex[:8]}.scope")
    entries = timed_out_stop_entries(unit, stopped, "stop", 1_000_000_000)
    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=False)
    harness.unit.active = "failed"

    assert harness.daemon.run() == 0

    assert not process_gone(worker.pid)
    assert harness.unit.calls == []
    [said] = sweep_lines(harness)
    assert said["pids"] == [worker.pid]
    assert "stopped on purpose" in str(said["summary"])
    assert "reported, not reaped" in str(said["summary"])
    assert harness.snapshots[-1]["units"][unit]["survivors"][0]["result"] == "reported"

    entries = timed_out_stop_entries(unit, stopped, "stop", 1_000_000_000)
    configured = build(
        tmp_path, in_process_nvml, unit, entries, dry_run=False, reap_stopped_survivors=True
    )
    configured.unit.active = "failed"

    assert configured.daemon.run() == 0

    assert process_gone(worker.pid)
    assert configured.unit.calls == []  # reaped, never started
    assert configured.snapshots[-1]["units"][unit]["survivors"][0]["result"] == "reaped"


@pytest.mark.parametrize(
    ("dry_run", "live", "said"),
    [
        pytest.param(True, True, "dry run: would reap 1 survivor of run ", id="dry-run-names-them"),
        pytest.param(False, False, None, id="replayed-history-sweeps-nothing"),
    ],
)
def test_survivors_are_left_alone_under_dry_run_and_in_history(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    *,
    dry_run: bool,
    live: bool,
    said: str | None,
) -> None:
    """dry_run: the crashed run's survivor is named, with what would be done, and left alone.

    A run that ended before the daemon started is history: never acted on, nothing said.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    worker = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 0)
    unit_cgroups.move(worker.pid, unit)
    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=dry_run, live=live)

    assert harness.daemon.run() == 0

    assert not process_gone(worker.pid)
    assert not any(event == "signal" for _, event, _ in harness.log.lines)
    if said is None:
        assert not sweep_lines(harness)
    else:
        [line] = sweep_lines(harness)
        assert str(line["summary"]).startswith(f"{said}{crashed[:8]}")


def container_sweep(
    tmp_path: Path,
    state: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    *,
    dry_run: bool,
) -> tuple[Harness, FakeEngine, Holder, Holder, str, str]:
    """A crashed run whose server container (named ``sglang``) and a tenant's hold GPU 0.

    The containers are real processes holding fake-NVML memory in real ``/docker/<id>``
    cgroups; the engine is the stand-in of tests/support/containergate.py, which the stopper
    reaches on the socket path ``engineapi.SOCKETS`` names (moved to the test's, nothing else).
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    ours_id, theirs_id = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2  # unique: runs may overlap
    ours = spawn_holder(state, gpus=(0,), mib=30000, name="python3 -m sglang.launch_server")
    theirs = spawn_holder(state, gpus=(0,), mib=1000, name="python3 train.py")
    unit_cgroups.move(ours.pid, ours_id, "docker")
    unit_cgroups.move(theirs.pid, theirs_id, "docker")
    engine = FakeEngine(tmp_path / "engine" / "docker.sock")
    engine.path.parent.mkdir(mode=0o700)
    engine.containers |= {"sglang": (ours_id, ours.pid), "tenant": (theirs_id, theirs.pid)}
    engine.start()
    monkeypatch.setitem(SOCKETS, Engine.DOCKER, engine.path)
    recorder = Recorder()
    harness = build(
        tmp_path,
        state,
        unit,
        entries,
        dry_run=dry_run,
        recorder=recorder,
        containers=lambda request: for_unit(
            request, "sglang", grace_s=1.0, dry_run=dry_run, logger=lambda: recorder
        ),
    )
    return harness, engine, ours, theirs, str(entries[0]["INVOCATION_ID"]), ours_id


def test_a_crashed_runs_left_over_container_is_stopped_at_its_end(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unit's container outlived the crashed run: the sweep stops it through the engine.

    Its processes carry no INVOCATION_ID (the engine started them), so only the engine's
    answer ties it to the unit; the tenant's container on the same GPU is not touched.
    """
    harness, engine, ours, theirs, crashed, ours_id = container_sweep(
        tmp_path, in_process_nvml, spawn_holder, unit_cgroups, monkeypatch, dry_run=False
    )
    try:
        assert harness.daemon.run() == 0
    finally:
        engine.stop()

    assert engine.stops == [f"/containers/{ours_id}/stop?t=1"]
    assert process_gone(ours.pid)
    assert not process_gone(theirs.pid)
    assert not any(event == "signal" for _, event, _ in harness.log.lines)
    stopped = [f for _, e, f in harness.log.lines if e == "container stopped"]
    assert [f["container"] for f in stopped] == [f"docker:{ours_id[:12]}"]
    [said] = sweep_lines(harness)
    assert str(said["summary"]).startswith(
        f"stopped container sglang (docker {ours_id[:12]}) of run {crashed[:8]} within "
    )
    [unit_snapshot] = harness.snapshots[-1]["units"].values()
    [record] = unit_snapshot["survivors"]
    assert record["containers"] == [f"sglang (docker {ours_id[:12]})"]
    assert record["pids"] == []


def test_a_left_over_container_under_dry_run_is_only_named(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dry_run: the sweep says it would stop the unit's container, and sends the engine nothing."""
    harness, engine, ours, _theirs, crashed, ours_id = container_sweep(
        tmp_path, in_process_nvml, spawn_holder, unit_cgroups, monkeypatch, dry_run=True
    )
    try:
        assert harness.daemon.run() == 0
    finally:
        engine.stop()

    assert engine.stops == []
    assert not process_gone(ours.pid)
    assert not [e for _, e, _ in harness.log.lines if "container" in e]  # not acted on at all
    [said] = sweep_lines(harness)
    assert str(said["summary"]).startswith(
        f"dry run: would stop container sglang (docker {ours_id[:12]}) of run {crashed[:8]}"
    )


# -- metrics (adapters.metricsio.Exporter on the daemon's ports, as `gpuguard run` wires it) --


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels (the official parser)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def with_metrics(textfile: Path, exporters: list[Exporter]) -> Callable[[Settings, Ports], Ports]:
    """A ``build(wrap=...)`` that puts an Exporter on the ports, as `gpuguard run` does."""

    def wrap(settings: Settings, ports: Ports) -> Ports:
        settings = settings.model_copy(
            update={"metrics": settings.metrics.model_copy(update={"textfile": str(textfile)})}
        )
        exporter = Exporter(
            settings,
            gather=ports.gather,
            show_unit=ports.show_unit,
            ping=ports.notifier.watchdog,
            log=ports.log,
            monotonic=ports.monotonic,
            wall=ports.wall,
        )
        exporters.append(exporter)
        write = ports.write_snapshot
        return replace(
            ports,
            gather=exporter.gather,
            reap=exporter.reaped(ports.reap),
            load_unit_state=exporter.loaded(ports.load_unit_state),
            write_snapshot=lambda document: write(
                document | {"metrics": exporter.publish(document)}
            ),
        )

    return wrap


def test_a_recovery_is_counted_in_the_textfile(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stale workers recovered: one restart, three processes killed, GPUs idle again."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = run_worker(spawn_holder, in_process_nvml, monkeypatch, OLD_INVOCATION, 0, 1, children=2)
    for pid in (stale.pid, *stale.children):
        unit_cgroups.move(pid, unit)
    # A gate decision recorded before the daemon starts is history: never counted.
    runtime = tmp_path / "run"
    state.record_gate_decision(runtime, unit, {"time": "t0", "result": "passed", "reaped": []})
    textfile = tmp_path / "node-exporter" / "gpuguard.prom"
    textfile.parent.mkdir(mode=0o755)
    exporters: list[Exporter] = []
    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        loop_entries(unit),
        dry_run=False,
        wrap=with_metrics(textfile, exporters),
    )
    # The daemon has taken its baseline (its Exporter exists): a refusal now is counted.
    state.record_gate_decision(
        runtime,
        unit,
        {"time": "t1", "result": "refused", "reaped": [{"pid": 1, "outcome": "unkillable"}]},
    )

    assert harness.daemon.run() == 0

    assert all(process_gone(pid) for pid in (stale.pid, *stale.children))
    found = samples(textfile.read_text())
    assert found["gpuguard_recoveries_total", (("result", "restarted"), ("unit", unit))] == 1
    assert found["gpuguard_recoveries_total", (("result", "failed"), ("unit", unit))] == 0
    assert (
        found["gpuguard_reaped_processes_total", (("outcome", "killed"), ("reaper", "daemon"))] == 3
    )
    assert found["gpuguard_gate_decisions_total", (("result", "refused"), ("unit", unit))] == 1
    assert found["gpuguard_gate_decisions_total", (("result", "passed"), ("unit", unit))] == 0
    assert (
        found["gpuguard_reaped_processes_total", (("outcome", "unkillable"), ("reaper", "gate"))]
        == 1
    )
    assert found["gpuguard_gate_last_decision_refused", (("unit", unit),)] == 1
    assert found["gpuguard_gpu_idle", (("gpu", "0"),)] == 1
    assert found["gpuguard_gpu_stale_holders", (("gpu", "0"),)] == 0
    # The last snapshot is the daemon's clean stop: down, and says so.
    assert found["gpuguard_daemon_up", ()] == 0
    assert textfile.stat().st_mode & 0o777 == 0o644
    assert harness.snapshots[-1]["metrics"]["recoveries"] == [[unit, "restarted", 1]]
    assert not [f for _, event, f in harness.log.lines if "metrics" in event]
    assert [p.name for p in textfile.parent.iterdir()] == [
        "gpuguard.prom"
    ]  # no temporary file left behind


def test_the_http_listener_serves_the_latest_metrics() -> None:
    """[metrics] listen: what the exporter published last, over HTTP on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    latest = Latest()
    serve(f"127.0.0.1:{port}", latest)
    up = GaugeMetricFamily("gpuguard_daemon_up", "1 while the daemon runs.")
    up.add_metric([], 1)
    latest.publish([up])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert "gpuguard_daemon_up 1.0" in text
    assert "process_cpu_seconds_total" not in text  # our registry only, not the global one


def test_a_textfile_that_cannot_be_written_is_said_once_and_then_recovered(
    tmp_path: Path,
    in_process_nvml: Path,
) -> None:
    """No directory yet: one warning however often; once it exists, written and said so."""
    textfile = tmp_path / "node-exporter" / "gpuguard.prom"
    settings = Settings(
        units={"sglang.service": UnitSettings()},
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        device_glob=f"{in_process_nvml}/dev/nvidia*",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        metrics=MetricsSettings(textfile=str(textfile)),
    )
    recorder = Recorder()
    twin = UnitTwin(invocation="a" * 32, active="active")
    exporter = Exporter(
        settings,
        gather=lambda: inventory.gather(settings),
        show_unit=twin.show,
        ping=recorder.watchdog,
        log=recorder,
    )
    snapshot = snapshots.QUIET.to_json()  # a running daemon watching no unit yet
    for _ in range(3):
        exporter.publish(snapshot)
    assert [event for _, event, _ in recorder.lines] == ["cannot write the metrics textfile"]
    textfile.parent.mkdir()
    exporter.publish(snapshot)
    assert [event for _, event, _ in recorder.lines][-1] == "metrics textfile written again"
    found = text_string_to_metric_families(textfile.read_text())
    gpus = {s.labels["gpu"] for f in found if f.name == "gpuguard_gpu_idle" for s in f.samples}
    assert gpus == {"0", "1", "2", "3"}  # the first publish took an inventory of its own
    assert "WATCHDOG" in recorder.notes


def test_a_host_without_node_exporter_is_told_once_without_a_warning(
    tmp_path: Path,
    in_process_nvml: Path,
) -> None:
    """The default textfile's directory missing (no node_exporter): one info line, no warning."""
    if Path(DEFAULT_TEXTFILE).parent.exists():
        pytest.skip("this host has node_exporter's textfile directory: the file would be written")
    settings = Settings(
        units={"sglang.service": UnitSettings()},
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        device_glob=f"{in_process_nvml}/dev/nvidia*",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
    )
    assert settings.metrics.textfile == DEFAULT_TEXTFILE
    recorder = Recorder()
    twin = UnitTwin(invocation="a" * 32, active="active")
    exporter = Exporter(
        settings,
        gather=lambda: inventory.gather(settings),
        show_unit=twin.show,
        ping=recorder.watchdog,
        log=recorder,
    )
    for _ in range(3):
        exporter.publish(snapshots.QUIET.to_json())
    assert [(level, event) for level, event, _ in recorder.lines] == [
        ("info", "no node_exporter textfile directory: no metrics file")
    ]


def test_a_loop_whose_gpus_a_stranger_holds_is_not_stopped_but_sent_to_the_operator(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never worse: a holder the plan would not reap means no stop, CRITICAL, the command."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 0, monkeypatch)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    stranger = spawn_holder(in_process_nvml, gpus=(1,), mib=30000, name="sglang::scheduler")
    unit_cgroups.move(stranger.pid, f"run-r{uuid.uuid4().hex[:8]}.scope")
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not process_gone(stale.pid)
    assert not process_gone(stranger.pid)
    [critical] = [f for level, _e, f in harness.log.lines if level == "critical"]
    assert critical["command"] == f"gpuguard reap --unit {unit} --scope patterns"
    blockers = critical["blockers"]
    assert isinstance(blockers, list)
    [blocker] = blockers
    assert str(blocker).startswith(f"PID {stranger.pid} (sglang::schedu")
    last = harness.snapshots[-1]["units"][unit]
    assert last["needs_operator"] is True
    assert last["action"] == "needs-operator"
    assert f"gpuguard reap --unit {unit} --scope patterns" in last["action_reason"]


def test_a_loop_the_gate_refuses_for_holders_it_cannot_prove_needs_an_operator(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
) -> None:
    """The gate refused the last start (a holder it cannot prove): needs operator, with both."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stranger = spawn_holder(in_process_nvml, gpus=(1,), mib=30000, name="sglang::scheduler")
    unit_cgroups.move(stranger.pid, f"run-r{uuid.uuid4().hex[:8]}.scope")
    refused = {"time": "2026-12-01T03:00:00+00:00", "result": "refused", "blockers": ["old"]}
    state.record_gate_decision(tmp_path / "run", unit, refused)
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not process_gone(stranger.pid)
    assert not [f for _l, event, f in harness.log.lines if event == "restart loop"]
    [critical] = [f for level, _e, f in harness.log.lines if level == "critical"]
    assert critical["command"] == f"gpuguard reap --unit {unit} --scope patterns"
    named = critical["blockers"]
    assert isinstance(named, list)
    [blocker] = named
    assert str(blocker).startswith(f"PID {stranger.pid} (sglang::schedu")
    last = harness.snapshots[-1]["units"][unit]
    assert last["cause"] == "stale-gpu-holders"
    assert "the gate refused the last start" in last["cause_detail"]
    assert "old" not in last["cause_detail"]
    assert last["action"] == "needs-operator"


def test_a_crashed_runs_worker_that_moved_to_its_own_scope_is_reaped_by_the_ledger(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its INVOCATION_ID is its scope's; the ledger recorded it in the crashed run: swept."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    escaped = run_worker(spawn_holder, in_process_nvml, monkeypatch, "d" * 32, 1)
    unit_cgroups.move(escaped.pid, f"tp-worker-{uuid.uuid4().hex[:8]}.scope")
    recorded = Ledger().record(unit, crashed, seen_from(escaped.pid), 1.0)

    def with_ledger(_settings: Settings, ports: Ports) -> Ports:
        return replace(ports, load_ledger=lambda: recorded)

    harness = build(tmp_path, in_process_nvml, unit, entries, dry_run=False, wrap=with_ledger)

    assert harness.daemon.run() == 0

    assert process_gone(escaped.pid)
    assert harness.unit.calls == []
    [said] = sweep_lines(harness)
    assert said["pids"] == [escaped.pid]


def test_the_sweep_never_adopts_a_process_the_ledger_recorded_in_another_units_run(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a scope the unit adopts, with its uid and its crashed run's INVOCATION_ID: kept.

    The environment is the process's to write; the ledger saw it descend from a run of
    b.service, so the sweep of the crashed run leaves it, as the gate does.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    other = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 1)
    unit_cgroups.move(other.pid, f"tp-worker-{uuid.uuid4().hex[:8]}.scope")
    recorded = Ledger().record("b.service", "b" * 32, seen_from(other.pid), 1.0)

    def with_ledger(_settings: Settings, ports: Ports) -> Ports:
        return replace(ports, load_ledger=lambda: recorded)

    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        entries,
        dry_run=False,
        wrap=with_ledger,
        adopt=("tp-worker-*.scope",),
    )

    assert harness.daemon.run() == 0

    assert not process_gone(other.pid)
    assert all(
        other.pid not in cast("list[int]", line.get("pids", [])) for line in sweep_lines(harness)
    )


def test_the_daemon_records_a_running_units_processes_in_the_ledger_file(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At start-up a running unit's cgroup and descendants go into root's ledger file."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    running = "e" * 32
    server = run_worker(spawn_holder, in_process_nvml, monkeypatch, running, 0, children=1)
    unit_cgroups.move(server.pid, unit)
    scope = f"tp-worker-{uuid.uuid4().hex[:8]}.scope"
    unit_cgroups.move(server.children[0], scope)

    def recording(settings: Settings, ports: Ports) -> Ports:
        def show(name: str) -> UnitState:
            return replace(
                ports.show_unit(name),
                active_state="active",
                sub_state="running",
                invocation_id=running,
                control_group=f"/system.slice/{name}",
            )

        def read(group: str | None, seen: Mapping[values.ProcessIdentity, str]) -> Any:
            return runtree.run_processes(group, seen, cgroup_root=CGROUP2)

        real = wiring.ledger_ports(settings, ports.log)
        return replace(ports, show_unit=show, ledger=replace(real, run_processes=read))

    harness = build(tmp_path, in_process_nvml, unit, [], dry_run=False, wrap=recording)

    assert harness.daemon.run() == 0

    ledger, problems = ledgerstore.load(tmp_path / "run")
    assert problems == ()
    [run] = ledger.runs
    assert (run.unit, run.invocation_id) == (unit, running)
    where = {p.pid: p.cgroup for p in run.processes}
    assert where[server.pid] == f"/system.slice/{unit}"
    assert where[server.children[0]] == f"/system.slice/{scope}"
    assert not process_gone(server.pid)


def late_batch(sample: str, unit: str) -> list[Entry]:
    """PID 1's messages of ``sample`` from the first run's stop or crash to the next run's start.

    What a late daemon reads in one batch: the end of the run it last saw come up (its
    "Started" long read), and the next run systemd already started.
    """
    lines = (SAMPLES / sample).read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    ours = [e for e in entries if e.get("_PID") == "1" and e.get("UNIT") == "sglang.service"]
    first, second = list(dict.fromkeys(str(e["INVOCATION_ID"]) for e in ours))[:2]
    batch = []
    for entry in ours:
        message = str(entry["MESSAGE"])
        if (entry["INVOCATION_ID"] == first and not message.startswith("Start")) or (
            entry["INVOCATION_ID"] == second and message.startswith("Start")
        ):
            batch.append(entry | {"UNIT": unit})
    return batch


@pytest.mark.parametrize(
    ("sample", "reap_stopped"),
    [("restart-loop-start-limit.jsonl", False), ("operator-restart.jsonl", True)],
    ids=["crash-with-auto-restart", "systemctl-restart"],
)
def test_a_late_daemon_never_files_the_next_runs_processes_under_the_ended_run(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    sample: str,
    reap_stopped: bool,
) -> None:
    """The run's end is read after systemd started the next run: nothing of it is touched.

    The daemon saw run A come up; before it reads A's crash (or the operator's restart), A's
    server is gone and run B's server runs in the unit's cgroup with a TP worker that moved to
    its own scope (the scope's INVOCATION_ID), holding GPU 1. The end's last record walks the
    cgroup as it is now: B's processes are filed under B, so the sweep of A signals nothing
    (before, they were filed under A and B's worker was SIGTERMed as A's survivor).
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = late_batch(sample, unit)
    ended, nxt = str(entries[0]["INVOCATION_ID"]), str(entries[-1]["INVOCATION_ID"])
    server_a = run_worker(spawn_holder, in_process_nvml, monkeypatch, ended, 0)
    unit_cgroups.move(server_a.pid, unit)
    next_run: list[Holder] = []

    def systemd_moved_on() -> None:
        server_a.kill()
        server_a.process.wait()
        monkeypatch.setenv("INVOCATION_ID", nxt)
        server_b = spawn_holder(
            in_process_nvml,
            gpus=(1,),
            mib=30000,
            children=1,
            child_invocation="d" * 32,
            name="sglang::server",
        )
        monkeypatch.delenv("INVOCATION_ID")
        unit_cgroups.move(server_b.pid, unit)
        unit_cgroups.move(server_b.children[0], f"tp-worker-{uuid.uuid4().hex[:8]}.scope")
        next_run.append(server_b)
        harness.unit.invocation = nxt

    def with_cgroups(settings: Settings, ports: Ports) -> Ports:
        def show(name: str) -> UnitState:
            return replace(ports.show_unit(name), control_group=f"/system.slice/{name}")

        def read(group: str | None, seen: Mapping[values.ProcessIdentity, str]) -> Any:
            return runtree.run_processes(group, seen, cgroup_root=CGROUP2)

        real = wiring.ledger_ports(settings, ports.log)
        return replace(ports, show_unit=show, ledger=replace(real, run_processes=read))

    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        entries,
        dry_run=False,
        wrap=with_cgroups,
        reap_stopped_survivors=reap_stopped,
        before_first_read=systemd_moved_on,
    )
    harness.unit.invocation, harness.unit.active = ended, "active"

    assert harness.daemon.run() == 0

    [server_b] = next_run
    assert not process_gone(server_b.pid)
    assert not process_gone(server_b.children[0])
    assert [f for _, event, f in harness.log.lines if event == "signal"] == []
    assert sweep_lines(harness) == []
    ledger, _ = ledgerstore.load(tmp_path / "run")
    filed = {p.pid: run.invocation_id for run in ledger.runs for p in run.processes}
    assert filed[server_b.pid] == nxt
    assert filed[server_b.children[0]] == nxt


def test_a_survivor_sigkill_cannot_end_does_not_hold_up_the_loop(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
    frozen_group: Path,
) -> None:
    """A crashed run's survivor in an uninterruptible wait: the sweep ends with the reap.

    SIGTERM, the grace, SIGKILL and the reaper's wait leave it alive (frozen: state D); the
    sweep returns then, says the GPUs are not idle, and the loop goes on, instead of looking
    again until the gate's timeout (300 s by default) while every other unit waits.
    """
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    entries = crashed_run_entries(unit)
    crashed = str(entries[0]["INVOCATION_ID"])
    stuck = run_worker(spawn_holder, in_process_nvml, monkeypatch, crashed, 0)
    unit_cgroups.move(stuck.pid, unit)
    (frozen_group / "cgroup.procs").write_text(str(stuck.pid))
    (frozen_group / "freezer.state").write_text("FROZEN")
    looks = [0]

    def counted(_settings: Settings, ports: Ports) -> Ports:
        def gather() -> Inventory:
            looks[0] += 1
            return ports.gather()

        return replace(ports, gather=gather)

    harness = build(
        tmp_path,
        in_process_nvml,
        unit,
        entries,
        dry_run=False,
        reap_grace_s=0.2,
        gate_timeout_s=60.0,
        wrap=counted,
    )

    assert harness.daemon.run() == 0

    assert not process_gone(stuck.pid)
    outcomes = [f["outcome"] for _, event, f in harness.log.lines if event == "reap outcome"]
    assert outcomes == ["unkillable"]
    [record] = harness.snapshots[-1]["units"][unit]["survivors"]
    assert record["result"] == "reaped, GPUs not idle"
    assert looks[0] <= 6  # the start, the burst, the sweep's first look, the snapshots
