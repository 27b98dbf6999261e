"""The daemon's loop with real processes, real cgroups, the fake NVML and real journal entries.

systemd itself cannot run here outside a container, so two adapters are in-memory twins, passed
in (never patched): the journal follower replays entries recorded from a real systemd 252
(tests/journal_samples), and the unit's systemctl is a small state machine. Everything else is
real: the inventory (unmodified pynvml over the C fake, the /proc walk), the policy, the reaper
with pidfds and signals, the detector, the recovery planner. The end-to-end suite runs the same
daemon against a real systemd.
"""

from __future__ import annotations

import ctypes
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fakeholder import process_gone
from fakestate import update_gpu

from gpuguard import inventory, reaper
from gpuguard.config import DaemonSettings, Settings, UnitSettings
from gpuguard.daemon import Daemon, Ports
from gpuguard.journal import JournalHealth, JournalRecord
from gpuguard.systemd import UnitState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from clirunner import Openers, UnitCgroups
    from fakeholder import Holder, HolderSpawner

SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples" / "bookworm"
OLD_INVOCATION = "0" * 32


def loop_entries(unit: str) -> list[dict[str, object]]:
    """PID 1's messages of a real restart loop (systemd 252), renamed to ``unit``."""
    lines = (SAMPLES / "restart-loop-start-limit.jsonl").read_text().splitlines()
    entries = []
    for line in lines:
        entry = json.loads(line)
        if entry.get("_PID") == "1" and entry.get("UNIT") == "sglang.service":
            entry["UNIT"] = unit
            entries.append(entry)
    return entries


@dataclass
class ReplayFollower:
    """Twin of JournalFollower: hands out recorded entries as live records, once."""

    entries: list[dict[str, object]]
    live: bool = True
    committed: list[str] = field(default_factory=list)
    started: bool = False

    def start(self) -> None:
        """Nothing to spawn."""
        self.started = True

    def fds(self) -> list[int]:
        """No pipes: the daemon sleeps through the injected sleep instead."""
        return []

    def wake_in(self) -> float | None:
        """Never needs waking."""
        return None

    def read_available(self) -> list[JournalRecord]:
        """Everything at once, as journalctl would after a burst."""
        records = [JournalRecord(entry, "lifecycle", live=self.live) for entry in self.entries]
        self.entries = []
        return records

    def take_problems(self) -> list[str]:
        """No malformed lines in recorded samples."""
        return []

    def commit(self, *records: JournalRecord) -> None:
        """Remember what the daemon processed."""
        self.committed.extend(record.cursor for record in records)

    def health(self) -> JournalHealth:
        """Always attached."""
        return JournalHealth("attached", None, None, (), None)

    def close(self) -> None:
        """Nothing to stop."""


@dataclass
class UnitTwin:
    """Twin of systemctl for one unit: looping (activating, auto-restart) until stopped."""

    invocation: str
    calls: list[str] = field(default_factory=list)
    active: str = "activating"

    def show(self, unit: str) -> UnitState:
        """What `systemctl show` would say now."""
        sub = "auto-restart" if self.active == "activating" else "dead"
        return UnitState(unit, self.active, sub, None, self.invocation, {}, 3)

    def control(self, verb: str, unit: str) -> str | None:
        """Record the verb; stop makes the unit inactive, start makes it activate again."""
        self.calls.append(f"{verb} {unit}")
        # A unit stopped while it was failing stays "failed" until reset-failed.
        self.active = {"stop": "failed", "reset-failed": "inactive", "start": "activating"}.get(
            verb, self.active
        )
        return None


@dataclass
class Recorder:
    """A structured logger and sd_notify twin that keep what they were told."""

    lines: list[tuple[str, str, dict[str, object]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def info(self, event: str, **fields: object) -> None:
        """Keep an info line."""
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: object) -> None:
        """Keep a warning line."""
        self.lines.append(("warning", event, fields))

    def error(self, event: str, **fields: object) -> None:
        """Keep an error line."""
        self.lines.append(("error", event, fields))

    def ready(self, status: str) -> None:
        """Keep READY."""
        self.notes.append(f"READY {status}")

    def status(self, status: str) -> None:
        """Keep STATUS."""
        self.notes.append(f"STATUS {status}")

    def watchdog(self) -> None:
        """Keep WATCHDOG."""
        self.notes.append("WATCHDOG")

    def stopping(self, status: str) -> None:
        """Keep STOPPING."""
        self.notes.append(f"STOPPING {status}")

    def close(self) -> None:
        """Keep CLOSE."""
        self.notes.append("CLOSE")


@pytest.fixture
def in_process_nvml(fake_nvml_dir: Path, fake_state: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Load the fake NVML into this process (pynvml then finds it by its soname)."""
    ctypes.CDLL(str(fake_nvml_dir / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    monkeypatch.setenv("FAKENVML_STATE", str(fake_state))
    return fake_state


def earlier_run_worker(
    spawn_holder: HolderSpawner,
    state: Path,
    cgroups: UnitCgroups,
    unit: str,
    gpu: int,
    monkeypatch: pytest.MonkeyPatch,
) -> Holder:
    """A worker of an earlier run of ``unit``: in its cgroup, with the old INVOCATION_ID."""
    monkeypatch.setenv("INVOCATION_ID", OLD_INVOCATION)
    worker = spawn_holder(state, gpus=(gpu,), mib=30000, name="sglang::scheduler")
    monkeypatch.delenv("INVOCATION_ID")
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


def build(
    tmp_path: Path,
    state: Path,
    unit: str,
    entries: list[dict[str, object]],
    *,
    dry_run: bool,
    live: bool = True,
) -> Harness:
    """A daemon for ``unit`` that stops itself after a few idle turns of its loop."""
    settings = Settings(
        units={unit: UnitSettings()},
        device_glob=f"{state}/dev/nvidia*",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        reap_grace_s=1.0,
        gate_timeout_s=20.0,
        daemon=DaemonSettings(dry_run=dry_run),
    )
    newest = max(int(str(e["__REALTIME_TIMESTAMP"])) for e in entries) / 1e6
    twin = UnitTwin(invocation=str(entries[-1]["INVOCATION_ID"]))
    recorder = Recorder()
    snapshots: list[dict[str, Any]] = []
    saved: dict[str, dict[str, Any]] = {}
    turns = [0]
    holder: list[Daemon] = []

    def sleep(seconds: float) -> None:
        turns[0] += 1
        if turns[0] > 3:
            holder[0].request_stop()
        del seconds

    def reap(targets: Sequence[reaper.ReapTarget]) -> tuple[reaper.ReapResult, ...]:
        return reaper.reap(targets, grace_s=settings.reap_grace_s, logger=recorder)

    ports = Ports(
        gather=lambda: inventory.gather(settings),
        show_unit=twin.show,
        control=twin.control,
        reap=reap,
        notifier=recorder,
        log=recorder,
        wall=lambda: newest + 1.0,
        monotonic=__import__("time").monotonic,
        sleep=sleep,
        write_snapshot=snapshots.append,
        load_unit_state=saved.get,
        save_unit_state=saved.__setitem__,
        untouchable=frozenset({os.getpid()}),
    )
    follower = ReplayFollower(entries, live=live)
    daemon = Daemon(settings, follower, ports)
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
    monkeypatch.setenv("INVOCATION_ID", OLD_INVOCATION)  # the earlier run's, inherited
    stale = spawn_holder(
        in_process_nvml,
        gpus=(0, 1, 2, 3),
        mib=30000,
        children=2,
        name="sglang::scheduler",
        ignore_sigterm=True,
    )
    monkeypatch.delenv("INVOCATION_ID")
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


def test_dry_run_acts_on_nothing(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With dry_run the GPU-caused loop is logged as what would be done; nothing is signalled."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 2, monkeypatch)
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=True)

    assert harness.daemon.run() == 0

    assert harness.unit.calls == []
    assert not process_gone(stale.pid)
    would = next(f for _, event, f in harness.log.lines if event == "dry run: would recover")
    assert would["unit"] == unit
    assert harness.snapshots[-1]["units"][unit]["recoveries"][-1]["result"] == "dry-run"


def test_history_is_never_acted_on(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same loop replayed as history at start rebuilds the window but triggers nothing."""
    unit = f"sglang-{uuid.uuid4().hex[:8]}.service"
    stale = earlier_run_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, 0, monkeypatch)
    harness = build(tmp_path, in_process_nvml, unit, loop_entries(unit), dry_run=False, live=False)

    assert harness.daemon.run() == 0
    assert harness.unit.calls == []
    assert not process_gone(stale.pid)
    assert not any(event == "restart loop" for _, event, _ in harness.log.lines)
