"""In-memory twins of the daemon's ports, for tests that cannot or need not touch the world.

The daemon (gpuguard.daemon.loop) reaches the world only through its ``Follower`` and ``Ports``;
these stand in for them without root, systemd or GPUs: ``ReplayFollower`` replays journal
entries recorded from a real systemd, ``UnitTwin`` is a unit's systemctl as a small state
machine, ``Recorder`` keeps the log lines and sd_notify messages, and ``GpuHost`` is NVML plus
/proc plus the reaper over processes that exist only in memory (reaping one frees its memory).
Integration tests combine the first three with the real inventory and reaper; unit tests use
all four, through ``daemon_twin``: the real ``Daemon`` over a recorded journal and the twins,
on the journal's own clock, for a few idle turns. Each is passed in, never patched in.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import builders
from builders import gpu, nvml
from typing_extensions import Self

from gpuguard.adapters import systemd
from gpuguard.adapters.journal import KERNEL, JournalHealth, JournalRecord
from gpuguard.config import Settings
from gpuguard.core.inventory import build_inventory
from gpuguard.core.unitstate import UnitState
from gpuguard.core.values import MigMode, ProcScan, ReapOutcome, ReapResult
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
from gpuguard.daemonsettings import DaemonSettings

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from gpuguard.core.healthcheck import HealthTarget, ProbeResult
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.values import GpuReading, ProcessFacts, ReapTarget, UnitProvenance
    from gpuguard.unitsettings import UnitSettings

SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples" / "bookworm"
BOOT = "b" * 32
"""The boot the twins' daemon runs on, unless a test names the journal's own."""
TURNS = 3
"""Idle sleeps a twin daemon takes before it stops: enough for its grace periods to be judged."""


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
    before_first_read: Callable[[], None] | None = None
    """What happens in the world before the entries reach the daemon (a late daemon: systemd
    already ended the run they tell of and started the next)."""

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
        if self.before_first_read is not None:
            self.before_first_read()
            self.before_first_read = None
        records = [
            JournalRecord(
                entry,
                KERNEL if entry.get("_TRANSPORT") == "kernel" else "lifecycle",
                live=self.live,
            )
            for entry in self.entries
        ]
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
    kill_mode: str | None = None
    """Its KillMode= as `systemctl show` prints it (None: not said)."""

    def show(self, unit: str) -> UnitState:
        """What `systemctl show` would say now."""
        sub = "auto-restart" if self.active == "activating" else "dead"
        return UnitState(
            unit, self.active, sub, None, self.invocation, {}, 3, kill_mode=self.kill_mode
        )

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

    def debug(self, event: str, **fields: object) -> None:
        """Keep a debug line."""
        self.lines.append(("debug", event, fields))

    def info(self, event: str, **fields: object) -> None:
        """Keep an info line."""
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: object) -> None:
        """Keep a warning line."""
        self.lines.append(("warning", event, fields))

    def error(self, event: str, **fields: object) -> None:
        """Keep an error line."""
        self.lines.append(("error", event, fields))

    def critical(self, event: str, **fields: object) -> None:
        """Keep a critical line."""
        self.lines.append(("critical", event, fields))

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


@dataclass
class JournaledRecorder(Recorder):
    """A Recorder that also keeps each log line as journald stores gpuguard.service's output.

    ``clock`` is the daemon's monotonic clock (its port), read when a line is written;
    ``realtime_s`` turns that moment into a wall-clock stamp. ``entries`` are what
    ``journalctl -o json`` would print for the lines: from the unit, as root, on ``boot_id``.
    """

    clock: Callable[[], float] = field(default=lambda: 0.0)
    realtime_s: Callable[[float], float] = field(default=lambda monotonic_s: monotonic_s)
    boot_id: str = ""
    entries: list[dict[str, object]] = field(default_factory=list)

    def _journal(self, level: str, event: str, fields: dict[str, object]) -> None:
        now = self.clock()
        self.entries.append(
            {
                "__CURSOR": f"gpuguard-{len(self.entries)}",
                "__MONOTONIC_TIMESTAMP": str(int(now * 1e6)),
                "__REALTIME_TIMESTAMP": str(int(self.realtime_s(now) * 1e6)),
                "_BOOT_ID": self.boot_id,
                "_SYSTEMD_UNIT": "gpuguard.service",
                "_UID": "0",
                "_PID": "4242",
                "_TRANSPORT": "stdout",
                "MESSAGE": json.dumps({"event": event, "level": level, **fields}, default=str),
            }
        )

    def info(self, event: str, **fields: object) -> None:
        """Keep an info line, also as a journal entry."""
        super().info(event, **fields)
        self._journal("info", event, fields)

    def warning(self, event: str, **fields: object) -> None:
        """Keep a warning line, also as a journal entry."""
        super().warning(event, **fields)
        self._journal("warning", event, fields)

    def error(self, event: str, **fields: object) -> None:
        """Keep an error line, also as a journal entry."""
        super().error(event, **fields)
        self._journal("error", event, fields)

    def critical(self, event: str, **fields: object) -> None:
        """Keep a critical line, also as a journal entry."""
        super().critical(event, **fields)
        self._journal("critical", event, fields)


@dataclass(frozen=True)
class Process:
    """A process of the in-memory host: who it is and how much of which GPUs it holds."""

    pid: int
    gpus: tuple[int, ...]
    mib: int
    cgroup: str
    invocation_id: str | None = None
    comm: str = "python3"
    ppid: int = 1
    uids: tuple[int, int, int, int] = (0, 0, 0, 0)


@dataclass
class GpuHost:
    """NVML, /proc and the reaper of a host that exists only in memory.

    ``gather`` builds the same Inventory the real adapters would from these processes;
    ``reap`` removes a target (exited after SIGTERM) unless it is in ``unkillable``, and records
    every target it was handed.
    """

    gpus: int = 4
    processes: dict[int, Process] = field(default_factory=dict)
    unkillable: set[int] = field(default_factory=set)
    reaped: list[ReapTarget] = field(default_factory=list)
    mig: frozenset[int] = frozenset()
    """GPUs with MIG mode on."""

    def add(self, process: Process) -> Process:
        """Start ``process`` on its GPUs."""
        self.processes[process.pid] = process
        return process

    def gather(self) -> Inventory:
        """What NVML and the /proc walk would say now, merged as gpuguard merges them."""
        readings = tuple(self._reading(index) for index in range(self.gpus))
        return build_inventory(
            nvml(*readings), ProcScan(tuple(map(_facts, self.processes.values()))), 0
        )

    def reap(self, targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        """Signal each target: it exits (its memory is freed) unless it is unkillable."""
        results = []
        for target in targets:
            self.reaped.append(target)
            pid = target.identity.pid
            if pid in self.unkillable:
                results.append(ReapResult(target, ReapOutcome.UNKILLABLE, ("SIGTERM", "SIGKILL")))
            elif self.processes.pop(pid, None) is None:
                results.append(ReapResult(target, ReapOutcome.GONE))
            else:
                results.append(ReapResult(target, ReapOutcome.EXITED, ("SIGTERM",)))
        return tuple(results)

    def _reading(self, index: int) -> GpuReading:
        reading = gpu(index, *((p.pid, p.mib) for p in self.processes.values() if index in p.gpus))
        if index in self.mig:
            return replace(reading, mig=MigMode(current=True, pending=True))
        return reading


def _facts(process: Process) -> ProcessFacts:
    facts = builders.process(
        process.pid,
        *process.gpus,
        cgroup=process.cgroup,
        comm=process.comm,
        cmdline=(process.comm, "-m", "sglang.launch_server"),
        invocation_id=process.invocation_id,
    )
    return replace(facts, ppid=process.ppid, uids=process.uids)


def newest_invocation(entries: Sequence[Mapping[str, object]]) -> str:
    """The invocation ID of the newest entry that names one: the unit's run as systemd has it."""
    return str(next(e["INVOCATION_ID"] for e in reversed(entries) if "INVOCATION_ID" in e))


@dataclass(frozen=True)
class JournalClock:
    """A recorded journal's clocks, a second after its newest entry: the daemon's "now".

    ``shift_s`` turns this process's monotonic clock into the journal's, so grace periods
    measured from the recorded entries run as they did on the recording host.
    """

    newest_real_s: float
    newest_mono_s: float
    shift_s: float

    @classmethod
    def of(cls, entries: Sequence[Mapping[str, object]]) -> Self:
        """The clocks of ``entries``, read now."""
        newest_real = max(int(str(e["__REALTIME_TIMESTAMP"])) for e in entries) / 1e6
        newest_mono = max(int(str(e["__MONOTONIC_TIMESTAMP"])) for e in entries) / 1e6
        return cls(newest_real, newest_mono, newest_mono + 1.0 - time.monotonic())

    def monotonic(self) -> float:
        """The journal's monotonic clock, now."""
        return time.monotonic() + self.shift_s

    def wall(self) -> float:
        """The wall clock the daemon reads: a second after the newest entry, all along."""
        return self.newest_real_s + 1.0

    def realtime_s(self, monotonic_s: float) -> float:
        """The wall-clock moment of a moment of the journal's monotonic clock."""
        return self.newest_real_s + monotonic_s - self.newest_mono_s


@dataclass(frozen=True)
class SteppedClock(JournalClock):
    """A JournalClock the twins move on: a sleep or a probe's wait takes its time at once."""

    stepped: list[float] = field(default_factory=lambda: [0.0])

    def monotonic(self) -> float:
        """The journal's monotonic clock, now, plus every step taken."""
        return super().monotonic() + self.stepped[0]

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        self.stepped[0] += seconds


def twin_settings(
    tmp_path: Path, units: dict[str, UnitSettings], daemon: DaemonSettings | None = None
) -> Settings:
    """Settings for a daemon over the twins: its files under ``tmp_path``, short waits."""
    return Settings(
        units=units,
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        reap_grace_s=1.0,
        gate_timeout_s=5.0,
        daemon=daemon or DaemonSettings(),
    )


@dataclass
class Harness:
    """One daemon over the twins, and what it produced."""

    daemon: Daemon
    host: GpuHost
    unit: UnitTwin
    log: Recorder
    snapshots: list[dict[str, Any]]
    saved: dict[str, dict[str, Any]]
    turns: list[int] = field(default_factory=lambda: [0])
    """The loop's sleeps so far (one per turn)."""

    def said(self, event: str) -> list[tuple[str, dict[str, object]]]:
        """Each line the daemon logged as ``event``: its level and its fields."""
        return [(level, fields) for level, name, fields in self.log.lines if name == event]


def daemon_twin(
    settings: Settings,
    follower: ReplayFollower,
    host: GpuHost,
    unit: UnitTwin,
    *,
    log: Recorder | None = None,
    clock: JournalClock | None = None,
    saved: dict[str, dict[str, Any]] | None = None,
    provenance: Callable[[UnitState], UnitProvenance] = systemd.provenance,
    boot_id: str = BOOT,
    probe_health: Callable[[HealthTarget, float], ProbeResult] | None = None,
    watchdog_interval_s: float | None = None,
    turns: int = TURNS,
) -> Harness:
    """The real daemon over ``follower``'s entries and the twins; it stops after TURNS sleeps.

    ``clock``: the journal's (by default that of the follower's entries; a SteppedClock moves
    on by each sleep); ``saved``: the units' saved state the daemon starts from, and where it
    saves; ``log``: a Recorder to write to; ``turns``: the sleeps before it stops.
    """
    clock = clock or JournalClock.of(follower.entries)
    recorder = log or Recorder()
    snapshots: list[dict[str, Any]] = []
    state = {} if saved is None else saved
    daemons: list[Daemon] = []
    slept = [0]

    def sleep(seconds: float) -> None:
        if isinstance(clock, SteppedClock):
            clock.advance(seconds)
        slept[0] += 1
        if slept[0] > turns:
            daemons[0].request_stop()

    ports = Ports(
        gather=host.gather,
        show_unit=unit.show,
        control=unit.control,
        reap=lambda _unit, targets: host.reap(targets),
        notifier=recorder,
        log=recorder,
        wall=clock.wall,
        monotonic=clock.monotonic,
        sleep=sleep,
        write_snapshot=snapshots.append,
        load_unit_state=state.get,
        save_unit_state=state.__setitem__,
        untouchable=frozenset(),
        provenance=provenance,
        boot_id=boot_id,
        probe_health=probe_health,
        watchdog_interval_s=watchdog_interval_s,
    )
    daemons.append(Daemon(settings, follower, ports))
    return Harness(daemons[0], host, unit, recorder, snapshots, state, slept)
