"""The watchdog daemon (`gpuguard run`): journal → events → detector → recovery.

One thread, one loop: wait on journalctl's pipes with a short timeout, feed systemd's messages
to each unit's detector, judge only after a *live* event (history replayed at start rebuilds
the window but is never acted on), and recover a loop with a GPU cause the way the gate would:
stop the unit, reap its stale holders, wait until its GPUs are idle, reset-failed, start.
Every adapter is passed in (``Ports``), so tests drive the same loop with real processes and
the fake NVML, or with in-memory twins.

Time is ``Ports.monotonic`` (the journal's per-boot monotonic clock) for every decision: the
detector's window, the recovery backoff, refreshes. The wall clock only stamps records for
people. The operator's intent wins: a run ended by a stop job is no loop (the detector), a unit
that is inactive is never started, and an interrupted recovery is resumed only in the same
boot, soon after it began, with the unit as the recovery left it, and never under ``dry_run``.
Long steps (an NVML snapshot, the reaper's grace, a systemctl call) keep the watchdog fed from a
helper thread, for no longer than the step's own deadline allows.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from gpuguard.adapters.journal import KERNEL
from gpuguard.core.detector import Detector, GpuEvidence
from gpuguard.core.escaping import escape
from gpuguard.core.events import EventKind, parse_entry
from gpuguard.core.gate import GateSettings, reap_targets, set_blockers
from gpuguard.core.gpuset import cuda_view, resolve_gpu_set
from gpuguard.core.health import reset_reasons
from gpuguard.core.ledger import Ledger
from gpuguard.core.liveness import ENGINE_DEAD_GRACE_S, Liveness, State, acted_on, left_alone
from gpuguard.core.oomdevice import device_phrases
from gpuguard.core.policy import PlanRequest, Scope, plan
from gpuguard.core.records import bound_record
from gpuguard.core.recovery import (
    Action,
    Interrupted,
    RecoveryDecision,
    RecoveryPlanner,
    operator_command,
    resume_problem,
    unfreeable,
)
from gpuguard.core.runend import (
    RunEnd,
    RunEnds,
    Sweep,
    describe,
    live_invocation,
    next_start,
    over_problem,
)
from gpuguard.core.unitcontainers import container_of
from gpuguard.core.values import MIB, UnitProvenance
from gpuguard.core.xid import lookup
from gpuguard.core.xidevents import MalformedXid, XidEvent, parse_kernel_entry
from gpuguard.core.xidfaults import FaultLog, LastUp, XidFault, blockers, to_record
from gpuguard.core.xidstuck import claims, named_by, stuck_phrase
from gpuguard.daemon import recover
from gpuguard.daemon.documents import Snapshot, UnitSnapshot, UnitStateDocument
from gpuguard.daemon.ledgerkeeper import LedgerKeeper, LedgerPorts

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.adapters.journal import JournalHealth, JournalRecord
    from gpuguard.adapters.systemd import UnitState
    from gpuguard.config import Settings
    from gpuguard.core.detector import Diagnosis
    from gpuguard.core.events import UnitEvent
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.unitcontainers import ContainerResult, ContainerVerdict
    from gpuguard.core.values import ProcessIdentity, ReapResult, ReapTarget

XIDS_KEPT = 50
"""Kernel Xid events the snapshot keeps (the newest), so a storm of them costs nothing."""
# The snapshot is rewritten when what it says changes, and at least this often (a sign of life
# for readers; status judges liveness by PID, not by this).
SNAPSHOT_EVERY_S = 60.0
# The longest the loop sleeps with nothing due: idle cost is wake-ups, so wake only for work.
MAX_SLEEP_S = 60.0
# How often a verdict is re-derived from the events alone, so "starting" becomes "up".
REFRESH_EVERY_S = 30.0
_RECENT = 10
# Beyond a long step's own deadline (NVML's timeout, the reaper's grace, systemctl's 10 s): the
# /proc walk, the reaper's SIGKILL wait, a busy host. Past it the watchdog goes hungry.
_STEP_SLACK_S = 30.0
# Beyond the grace, a container stopper's step: the engine's inspect answers (engineapi: 10 s
# each) and its own SIGKILL and wait after the grace (engineapi: 30 s).
_CONTAINER_SLACK_S = 60.0
# An interrupted recovery is resumed only if it could still be running: the stop wait, the
# gate's timeout and one restart of the daemon.
_RESUME_SLACK_S = 60.0
# A sweep of an ended run's survivors waits this long for the GPUs to be released once none of
# that run's processes holds them any more; past it, others hold the set and the gate decides.
_RELEASE_S = 5.0
# The unit of /proc's process start times (USER_HZ): compared with the journal's seconds.
_TICKS = os.sysconf("SC_CLK_TCK")
_T = TypeVar("_T")
_P = ParamSpec("_P")


class UnitContainers(Protocol):
    """A unit's left-over containers, judged and stopped (adapters/containerstop's stopper)."""

    def __call__(self, inventory: Inventory) -> bool:
        """The gate's step: act on each container newly seen; whether one was stopped."""
        ...

    def plan(self, inventory: Inventory) -> tuple[ContainerVerdict, ...]:
        """The verdict on each container holding the unit's GPUs."""
        ...

    def act(self, verdict: ContainerVerdict) -> ContainerResult | None:
        """Stop one (or, in a dry run, say so); None for one kept."""
        ...


class Logger(Protocol):
    """The structured logger the daemon writes to (structlog's bound logger satisfies it)."""

    def info(self, event: str, **fields: object) -> object:
        """An informational line."""
        ...

    def warning(self, event: str, **fields: object) -> object:
        """Something an operator should see."""
        ...

    def error(self, event: str, **fields: object) -> object:
        """Something failed."""
        ...

    def critical(self, event: str, **fields: object) -> object:
        """An operator must act now."""
        ...


class Follower(Protocol):
    """The journal follower as the daemon uses it (journal.JournalFollower, or a twin)."""

    def start(self) -> None:
        """Spawn journalctl: history first, then live."""

    def fds(self) -> list[int]:
        """Pipes to wait on."""
        ...

    def wake_in(self) -> float | None:
        """Seconds until a restart is due, if any."""
        ...

    def read_available(self) -> list[JournalRecord]:
        """What arrived, without blocking."""
        ...

    def take_problems(self) -> list[str]:
        """Lines skipped since the last call, with reasons."""
        ...

    def commit(self, *records: JournalRecord) -> None:
        """Persist the cursor after processing."""

    def health(self) -> JournalHealth:
        """Attached, replaying or restarting."""
        ...

    def close(self) -> None:
        """Stop journalctl."""


class NotifierPort(Protocol):
    """sd_notify as the daemon uses it."""

    def ready(self, status: str) -> None:
        """READY=1 with a status line."""

    def status(self, status: str) -> None:
        """STATUS= one line."""

    def watchdog(self) -> None:
        """WATCHDOG=1."""

    def stopping(self, status: str) -> None:
        """STOPPING=1."""

    def close(self) -> None:
        """Release the socket."""


@dataclass(frozen=True)
class Ports:
    """Everything the daemon touches the world through."""

    gather: Callable[[], Inventory]
    show_unit: Callable[[str], UnitState]
    control: Callable[[str, str], str | None]
    reap: Callable[[Sequence[ReapTarget]], tuple[ReapResult, ...]]
    notifier: NotifierPort
    log: Logger
    wall: Callable[[], float]
    monotonic: Callable[[], float]
    sleep: Callable[[float], None]
    write_snapshot: Callable[[dict[str, Any]], None]
    load_unit_state: Callable[[str], dict[str, Any] | None]
    save_unit_state: Callable[[str, dict[str, Any]], None]
    untouchable: frozenset[int]
    provenance: Callable[[UnitState], UnitProvenance]
    """What ties a process to an ended run of a unit (systemd.provenance)."""
    boot_id: str | None = None
    """This boot's ID (/proc/sys/kernel/random/boot_id): monotonic times are only compared
    within one boot."""
    identity: ProcessIdentity | None = None
    watchdog_interval_s: float | None = None
    wakeup_fd: int | None = None
    """Read end of a self-pipe that signal.set_wakeup_fd writes to: SIGTERM ends a long wait."""
    gate_environment: Callable[[str], dict[str, str] | None] = lambda _unit: None
    """The unit's GPU variables as its gate last read them (unitenv); None: ask systemd."""
    containers: Callable[[PlanRequest], UnitContainers | None] = lambda _r: None
    """The stopper of a unit's left-over containers, for a recovery's gate and for a sweep
    (containerstop)."""
    ledger: LedgerPorts | None = None
    """The provenance ledger's reads and writes (ledgerkeeper); None: no ledger is kept."""
    load_ledger: Callable[[], Ledger] = Ledger
    """The ledger a previous daemon of this boot left (ledgerstore)."""


@dataclass
class _Watch:
    """One watched unit: its detector, its recovery bookkeeping, what was last said."""

    name: str
    detector: Detector
    planner: RecoveryPlanner
    ends: RunEnds
    """Which runs are over, for the sweep of their survivors."""
    liveness: Liveness
    """Its engine: dead while the unit lives, its start phases (core.liveness)."""
    diagnosis: Diagnosis | None = None
    decision: RecoveryDecision | None = None
    systemd_state: str = "unknown"
    not_found: bool = False
    recoveries: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_RECENT))
    in_progress: dict[str, Any] | None = None
    refresh_at: float = 0.0
    sweeps: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_RECENT))
    last_sweep: Sweep | None = None
    """The newest sweep still waiting for the next run's start, to say whether it was in time."""
    up: LastUp = field(default_factory=LastUp)
    """When the unit last came up: reset-class Xids before it no longer count (xidfaults)."""
    stuck_said: str | None = None
    """The run whose stuck start was logged (once per run)."""
    dead_due: float | None = None
    """When to act on an engine seen dying live (its grace, or a recovery backoff's end)."""
    read_through_s: float | None = None
    """The newest journal moment (monotonic) of an event of this unit the detector has seen:
    its verdict line says it, so explain replays exactly what the daemon had read, not what
    arrived while it swept or recorded."""


class Daemon:
    """The daemon's state and loop; ``run()`` returns the exit status."""

    def __init__(self, settings: Settings, follower: Follower, ports: Ports) -> None:
        """Wire one detector and one recovery planner per watched unit."""
        self._settings = settings
        self._follower = follower
        self._ports = ports
        loop, limits = settings.daemon.loop(), settings.daemon.recovery_limits()
        self._watches = {
            name: _Watch(
                name,
                Detector(name, loop),
                RecoveryPlanner(limits),
                RunEnds(name),
                Liveness(
                    name,
                    unit.server,
                    clean_exit_is_death=settings.daemon.clean_exit_is_death,
                ),
            )
            for name, unit in settings.units.items()
        }
        self._gather = self._fed(settings.nvml_timeout_s, ports.gather)
        self._show_unit = self._fed(0.0, ports.show_unit)
        self._control = self._fed(0.0, ports.control)
        self._reap = self._fed(settings.reap_grace_s, ports.reap)
        self._provenance = self._fed(0.0, ports.provenance)  # journalctl, systemctl's 10 s
        self._started_at = ports.wall()
        self._stop = False
        self._ready = False
        # Often enough that a run counts as up soon after stable_s; rarely enough to stay idle.
        self._refresh_every_s = min(REFRESH_EVERY_S, settings.daemon.stable_s / 2)
        self._published: tuple[str, str] | None = None
        self._published_at = float("-inf")
        self._xids: deque[XidEvent] = deque(maxlen=XIDS_KEPT)
        self._xids_malformed = 0
        self._faults = FaultLog()
        self._unjudged: dict[str, frozenset[int]] = {}  # MIG GPUs last said per unit
        self._keeper = LedgerKeeper(ports.ledger, ports.load_ledger(), ports.wall)

    def request_stop(self) -> None:
        """Ask the loop to end (SIGTERM handler); it finishes within about a second."""
        self._stop = True

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Start up, then loop until asked to stop; 0 on a clean shutdown.

        Whatever ends the loop (an exception included), journalctl goes with it.
        """
        try:
            return self._run()
        finally:
            self._follower.close()

    def _run(self) -> int:
        ports = self._ports
        for watch in self._watches.values():
            self._restore(watch)
        inventory = self._gather()
        for watch in self._watches.values():
            state = self._show_unit(watch.name)
            self._note_state(watch, state)
            self._ledger_up(watch.name, state)
        self._follower.start()
        ports.log.info(
            "started",
            units=list(self._watches),
            dry_run=self._settings.daemon.dry_run,
            nvml=inventory.nvml.health.value,
            gpus=len(inventory.gpus),
        )
        for watch in self._watches.values():
            if watch.in_progress is not None:
                self._resume_recovery(watch)
        ports.notifier.ready(self._status_line())
        self._ready = True
        next_ping = ports.monotonic()
        while not self._stop:
            self._wait(next_ping)
            self._handle(self._follower.read_available())
            for problem in self._follower.take_problems():
                ports.log.warning("journal line skipped", reason=problem)
            self._retry_waiting()
            self._refresh()
            self._keeper.tick(ports.monotonic())
            now = ports.monotonic()
            if ports.watchdog_interval_s is not None and now >= next_ping:
                ports.notifier.watchdog()  # only from here: a stuck loop stops the pings
                next_ping = now + ports.watchdog_interval_s
            self._publish()
        ports.notifier.stopping("stopping")
        self._follower.close()
        self._publish(running=False)
        ports.notifier.close()
        ports.log.info("stopped")
        return 0

    def _wait(self, next_ping: float) -> None:
        """Sleep until journal data, a signal, or the next thing that is due - not longer.

        Idle cost is wake-ups: the loop wakes for the next watchdog ping, a journalctl restart,
        the end of a recovery backoff or the snapshot's refresh, never on a fixed tick.
        """
        ports = self._ports
        now = ports.monotonic()
        due = [MAX_SLEEP_S, self._published_at + SNAPSHOT_EVERY_S - now]
        if ports.watchdog_interval_s is not None:
            due.append(next_ping - now)
        due.extend(w for w in (self._follower.wake_in(), self._keeper.due_in(now)) if w is not None)
        due.extend(
            watch.refresh_at - now
            for watch in self._watches.values()
            if watch.diagnosis is not None
        )
        due.extend(
            watch.decision.not_before_s - now
            for watch in self._watches.values()
            if watch.decision is not None
            and watch.decision.action is Action.WAIT
            and watch.decision.not_before_s is not None
        )
        due.extend(w.dead_due - now for w in self._watches.values() if w.dead_due is not None)
        due.extend(
            wake - now for w in self._watches.values() if (wake := w.liveness.wake_at) is not None
        )
        timeout = max(0.0, min(due))
        fds = self._follower.fds()
        if ports.wakeup_fd is not None:
            fds = [*fds, ports.wakeup_fd]
        if not fds:
            ports.sleep(timeout)
            return
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        if ports.wakeup_fd is not None and ports.wakeup_fd in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(ports.wakeup_fd, 4096)  # drain: the signal's handler already ran

    def _handle(self, records: Sequence[JournalRecord]) -> None:
        """Feed records to the detectors; sweep runs a live event ended; judge touched units."""
        touched: set[str] = set()
        ended: list[tuple[_Watch, RunEnd]] = []
        live: list[tuple[_Watch, UnitEvent]] = []
        for record in records:
            if record.stream == KERNEL:
                self._kernel(record)
                continue
            for watch in self._watches.values():
                event = parse_entry(record.entry, watch.name)
                if event is None:
                    continue
                end = watch.ends.observe(event)  # history too: a replayed end is not swept again
                watch.read_through_s = max(watch.read_through_s or 0.0, event.monotonic_s)
                watch.up.observe(event)
                if self._observe(watch, event, live=record.live):
                    touched.add(watch.name)
                if record.live:
                    self._ledger_event(watch, event, end)
                    live.append((watch, event))
                    ended.extend([(watch, end)] if end is not None else [])
        if records:
            self._follower.commit(*records)
        # Survivors first: a loop judged after the sweep no longer counts what it reaped.
        self._sweep_all(ended)
        for watch, event in live:  # after the sweeps: the next start may be in the same burst
            self._note_next_start(watch, event)
        for name in touched:
            self._judge(self._watches[name])
        self._dead_engines()

    def _ledger_event(self, watch: _Watch, event: UnitEvent, end: RunEnd | None) -> None:
        """Record a run as it comes up, at once when its stop is announced, and as it ends."""
        now = self._ports.monotonic()
        if event.kind in {EventKind.STARTING, EventKind.STARTED}:
            self._ledger_up(watch.name, self._show_unit(watch.name))
        elif event.kind is EventKind.STOPPING:
            self._keeper.record(watch.name, now)
        if end is not None:
            self._keeper.run_over(watch.name, end.invocation_id, now)

    def _ledger_up(self, unit: str, state: UnitState) -> None:
        """Start recording the unit's live run (nothing when it is not running)."""
        if self._ports.ledger is None or not state.running or state.invocation_id is None:
            return
        self._keeper.run_up(unit, state.invocation_id, state.control_group, self._ports.monotonic())

    def _kernel(self, record: JournalRecord) -> None:
        """Keep a kernel Xid for status (history too: recent faults explain a loop); log news."""
        parsed = parse_kernel_entry(record.entry)
        if isinstance(parsed, MalformedXid):
            self._xids_malformed += 1
            self._ports.log.warning("kernel xid line not understood", reason=parsed.reason)
        elif parsed is not None:
            self._xids.append(parsed)
            self._faults.add(parsed)
            if record.live:
                info = lookup(parsed.code)
                self._ports.log.warning(
                    "kernel xid",
                    code=parsed.code,
                    xid_class=info.xid_class.value,
                    pci_bus_id=parsed.pci_bus_id,
                    pid=parsed.pid,
                    name=parsed.name,
                    detail=parsed.detail,
                )

    def _refresh(self) -> None:
        """Let verdicts age without new events: a run that stayed up for stable_s is healthy.

        Only the cheap, event-only verdict: acting needs a live event (or a backoff's end),
        so history replayed at start is still never acted on.
        """
        now = self._ports.monotonic()
        self._dead_engines()
        for watch in self._watches.values():
            if watch.diagnosis is None or now < watch.refresh_at:
                continue
            watch.refresh_at = now + self._refresh_every_s
            quick = watch.detector.diagnose(now, None)
            watch.up.stayed_up(quick.good_start_s)
            if not quick.looping:
                watch.planner.healthy(now)
                self._say(watch, quick, None)

    def _retry_waiting(self) -> None:
        """A unit whose recovery waited out its backoff is judged again (no new event needed)."""
        now = self._ports.monotonic()
        for watch in self._watches.values():
            decision = watch.decision
            waiting = decision is not None and decision.action is Action.WAIT
            if waiting and decision is not None and now >= (decision.not_before_s or 0.0):
                self._judge(watch)

    # -- judging and acting --------------------------------------------------------------------

    def _judge(self, watch: _Watch) -> None:
        now = self._ports.monotonic()
        if watch.not_found:  # events about it: it may exist now
            self._note_state(watch, self._show_unit(watch.name))
        quick = watch.detector.diagnose(now, None)
        watch.up.stayed_up(quick.good_start_s)
        if not quick.looping:
            watch.planner.healthy(now)
            self._say(watch, quick, None)
            return
        inventory = self._gather()
        state = self._show_unit(watch.name)
        self._note_state(watch, state)
        evidence = self._gpu_evidence(watch, inventory, state)
        diagnosis = watch.detector.diagnose(now, evidence)
        decision = watch.planner.decide(diagnosis, now)
        if decision.action is Action.RECOVER and state.active_state == "inactive":
            # Nothing will start it again (a restart pending is "activating"): someone stopped
            # it, and gpuguard does not start a unit that was stopped on purpose.
            decision = RecoveryDecision(
                Action.REPORT,
                f"{watch.name} is inactive with no restart pending: it was stopped on purpose, "
                "and gpuguard does not start it",
            )
        if decision.action is Action.RECOVER:
            decision = self._never_worse(watch, inventory, state, decision)
        self._say(watch, diagnosis, decision)
        if decision.action is Action.RECOVER:
            self._recover(watch, diagnosis, inventory, state)
        self._save(watch)

    def _never_worse(
        self, watch: _Watch, inventory: Inventory, state: UnitState, decision: RecoveryDecision
    ) -> RecoveryDecision:
        """Recover only when the plan can free what holds the unit's GPUs; else needs operator.

        Stopping a unit whose GPUs others hold (a left-over gpuguard cannot prove is the unit's)
        frees nothing and risks an outage: the unit is left as systemd has it, and the operator
        is told the blockers and the command to run after checking them (CRITICAL).
        """
        request = self._request(watch.name, inventory, state, None)
        blockers = unfreeable(
            plan(inventory.holders, request), inventory, self._settings.idle_threshold_mib * MIB
        )
        if not blockers:
            return decision
        command = operator_command(watch.name)
        reason = (
            f"{watch.name} is not stopped: its plan cannot free its GPUs, held by "
            + "; ".join(blockers)
            + f". After checking them: {command}"
        )
        if watch.decision is None or watch.decision.reason != reason:
            self._ports.log.critical(
                "needs operator: gpuguard cannot prove who holds the GPUs",
                unit=watch.name,
                blockers=list(blockers),
                command=command,
            )
        return RecoveryDecision(Action.NEEDS_OPERATOR, reason)

    def _with_ledger(self, provenance: UnitProvenance, unit: str) -> UnitProvenance:
        """Systemd's provenance plus what the ledger recorded, of this unit and of others."""
        recorded = self._keeper.evidence(unit)
        return replace(provenance, ledger=recorded.claims, elsewhere=recorded.elsewhere)

    def _note_state(self, watch: _Watch, state: UnitState) -> None:
        """Remember systemd's view; say once that a watched unit does not exist (a typo?)."""
        if state.not_found and not watch.not_found:
            self._ports.log.warning(
                "watched unit not found", unit=watch.name, load_state=state.load_state
            )
        watch.not_found = state.not_found
        watch.systemd_state = _describe_state(state)

    def _say(self, watch: _Watch, diagnosis: Diagnosis, decision: RecoveryDecision | None) -> None:
        """Log a verdict once when it changes, not on every event."""
        before = (watch.diagnosis.reason if watch.diagnosis else None, _action(watch.decision))
        watch.diagnosis, watch.decision = diagnosis, decision
        if before == (diagnosis.reason, _action(decision)):
            return
        fields: dict[str, object] = {
            "unit": watch.name,
            "looping": diagnosis.looping,
            "reason": diagnosis.reason,
            "cause": diagnosis.cause.value,
            "cause_detail": diagnosis.cause_detail,
            "starts_in_window": diagnosis.starts_in_window,
            "n_restarts": diagnosis.n_restarts,
            "read_through_s": watch.read_through_s,
        }
        if diagnosis.findings:  # no loop, but worth saying (a left-over at an operator's start)
            fields["findings"] = list(diagnosis.findings)
        if decision is None:
            self._ports.log.info("verdict", **fields)
            return
        fields |= {"action": decision.action.value, "action_reason": decision.reason}
        if decision.action is Action.NEEDS_OPERATOR:
            self._ports.log.error("needs operator", evidence=list(diagnosis.evidence), **fields)
        else:
            self._ports.log.warning("restart loop", evidence=list(diagnosis.evidence), **fields)

    def _request(
        self, unit: str, inventory: Inventory, state: UnitState, live: str | None
    ) -> PlanRequest:
        settings = self._settings
        unit_settings = settings.units[unit]
        environment = self._environment(unit, state)
        gpu_set = resolve_gpu_set(unit_settings.gpus, environment, inventory.nvml.gpus)
        if gpu_set.unjudged != self._unjudged.get(unit, frozenset()):
            self._unjudged[unit] = gpu_set.unjudged
            if gpu_set.unjudged:  # core/mig.py: said once, not on every look
                self._ports.log.warning(
                    "MIG GPUs not judged", unit=unit, gpu_set=gpu_set.describe()
                )
        return PlanRequest(
            unit=unit,
            scope=Scope.UNIT,
            patterns=unit_settings.patterns,
            gpu_set=gpu_set.indices,
            protected_names=settings.protected_processes,
            untouchable_pids=self._ports.untouchable,
            provenance=self._with_ledger(self._provenance(state), unit),
            live_invocation=live,
            adopt=unit_settings.adopt,
        )

    def _environment(self, unit: str, state: UnitState) -> dict[str, str]:
        """The unit's GPU variables: the gate's record includes EnvironmentFile= values."""
        recorded = self._ports.gate_environment(unit)
        return state.environment if recorded is None else recorded

    # -- a dead engine (core.liveness; docs/liveness.md) ---------------------------------------

    def _observe(self, watch: _Watch, event: UnitEvent, *, live: bool) -> bool:
        """Feed the unit's liveness, then its detector; whether the detector wants a judgement."""
        self._observe_liveness(watch, event, live=live)
        return event.kind not in _LIVENESS_ONLY and watch.detector.observe(event, live=live)

    def _observe_liveness(self, watch: _Watch, event: UnitEvent, *, live: bool) -> None:
        """An engine seen dying live is said at once, and acted on after its grace."""
        liveness = watch.liveness
        learned = liveness.learned
        died = liveness.observe(event, live=live)
        if live and liveness.learned != learned:
            self._save(watch)  # a start came up: its phases teach the next start's budget
        if died:
            self._said_dead(watch)

    def _said_dead(self, watch: _Watch) -> None:
        """Say once that a unit's engine died; its action is due after the grace."""
        dead = watch.liveness.dead
        if dead is None:
            return
        self._ports.log.error(
            "engine dead",
            unit=watch.name,
            invocation_id=dead.invocation_id,
            cause=dead.cause,
            line=dead.line,
            action=self._settings.units[watch.name].on_engine_dead,
        )
        # After an exit 0, systemd's own restart (Restart=always) may still come: wait as long
        # as for a fatal line (whose grace is over by now).
        watch.dead_due = dead.since_s + ENGINE_DEAD_GRACE_S

    def _dead_engines(self) -> None:
        """Recover each unit whose engine is still dead after its grace, if it opted in.

        Also says once per run that a start is stuck in a phase, and recovers it if opted in.
        """
        now = self._ports.monotonic()
        for watch in self._watches.values():
            unit = self._settings.units[watch.name]
            if watch.liveness.tick(now):
                self._said_dead(watch)
            view = watch.liveness.view(now)
            if view.state is State.STUCK and watch.stuck_said != view.invocation_id:
                watch.stuck_said = view.invocation_id
                action = unit.on_start_stuck
                self._ports.log.warning(
                    "start stuck", unit=watch.name, summary=view.summary, action=action
                )
                watch.dead_due = now if action == "recover" else watch.dead_due
            if watch.dead_due is None or now < watch.dead_due:
                continue
            watch.dead_due = None
            view = watch.liveness.view(now)
            if not acted_on(
                view, on_engine_dead=unit.on_engine_dead, on_start_stuck=unit.on_start_stuck
            ):
                continue
            state = self._show_unit(watch.name)
            self._note_state(watch, state)
            decision = watch.planner.decide_engine_dead(view.summary, now)
            if (why := left_alone(view, watch.name, state)) is not None:
                decision = RecoveryDecision(Action.REPORT, why)
            self._ports.log.warning(
                "engine dead: decision" if view.dead else "start stuck: decision",
                unit=watch.name,
                action=decision.action.value,
                reason=decision.reason,
            )
            watch.decision = decision
            if decision.action is Action.WAIT and decision.not_before_s is not None:
                watch.dead_due = decision.not_before_s
            elif decision.action is Action.RECOVER:
                quick = watch.detector.diagnose(now, None)
                line = view.dead.line if view.dead else view.summary
                cause = replace(quick, reason=view.summary, evidence=(line,))
                self._recover(watch, cause, self._gather(), state)
                self._save(watch)

    # -- survivors of a run that just ended -----------------------------------------------------

    def _sweep_all(self, ended: Sequence[tuple[_Watch, RunEnd]]) -> None:
        """One look for a whole burst of ended runs, then a sweep of those with survivors.

        The common case is that nothing of the ended runs holds a GPU: one inventory, and
        systemd is not asked at all. A run whose processes do hold one is looked at afresh, and
        so is every ended run while a docker/podman container holds a GPU (a container's
        processes carry no INVOCATION_ID: only its engine can say it is the unit's).
        """
        if not ended:
            return
        holders = self._gather().holders
        holding = {h.invocation_id for h in holders}
        for watch, _end in ended:  # moved out, with a scope's own INVOCATION_ID
            recorded = dict(self._keeper.claims(watch.name))
            holding.update(recorded[h.identity] for h in holders if h.identity in recorded)
        in_container = any(container_of(h.attribution.container) for h in holders)
        for watch, end in ended:
            if in_container or end.invocation_id in holding:
                self._sweep(watch, end)

    def _sweep(self, watch: _Watch, end: RunEnd) -> None:
        """Reap exactly the ended run's processes that still hold GPUs, then wait for the set.

        Only processes whose INVOCATION_ID is the ended run's (``PlanRequest.only_invocation``),
        under the gate's policy, protections and reaper; the run starting or running now is kept
        by invocation; and the unit's own left-over container, which the engine stops
        (containerstop, the gate's rule). A run stopped on purpose is only reported unless
        ``daemon.reap_stopped_survivors``; ``dry_run`` reaps and stops nothing.
        """
        ports = self._ports
        state = self._show_unit(watch.name)
        not_over = over_problem(
            end,
            active_state=state.active_state,
            sub_state=state.sub_state,
            invocation=state.invocation_id,
        )
        if not_over is not None:
            ports.log.info("run not over", unit=watch.name, reason=not_over)
            return
        inventory = self._gather()
        request = self._survivor_request(watch.name, inventory, state, end)
        planned = plan(inventory.holders, request).to_reap
        stopper = ports.containers(request)
        left_over = self._left_over(stopper, inventory)
        if not planned and not left_over:
            return
        daemon = self._settings.daemon
        base = Sweep(end, 0, len(planned), None, None, containers=_named(left_over))
        if daemon.dry_run:
            self._swept(watch, replace(base, dry_run=True), [d.holder.pid for d in planned])
            return
        if end.stopped_on_purpose and not daemon.reap_stopped_survivors:
            self._swept(watch, replace(base, reported_only=True), [d.holder.pid for d in planned])
            return
        ports.notifier.status(f"reaping survivors of {watch.name}")
        stopped = self._stop_containers(stopper, left_over)
        if stopped:
            inventory = self._gather()
        reaped, reaped_at, idle_at = self._reap_run(request, inventory)
        sweep = replace(
            base,
            reaped=len(reaped),
            reaped_after_s=reaped_at - end.ended_s,
            idle_after_s=None if idle_at is None else idle_at - end.ended_s,
            containers=_named([r.verdict for r in stopped]),
        )
        self._swept(watch, sweep, [r.target.identity.pid for r in reaped])

    def _left_over(
        self, stopper: UnitContainers | None, inventory: Inventory
    ) -> list[ContainerVerdict]:
        """The unit's containers the engine confirms are left over, holding its GPUs."""
        if stopper is None:
            return []
        # Each inspect is bounded by the engine adapter (10 s): fed like any long step.
        verdicts = self._fed(_CONTAINER_SLACK_S, stopper.plan)(inventory)
        return [verdict for verdict in verdicts if verdict.stop]

    def _stop_containers(
        self, stopper: UnitContainers | None, left_over: Sequence[ContainerVerdict]
    ) -> list[ContainerResult]:
        """Stop each left-over container through its engine; those no longer running."""
        if stopper is None:
            return []
        act = self._fed(self._settings.reap_grace_s + _CONTAINER_SLACK_S, stopper.act)
        return [result for v in left_over if (result := act(v)) is not None and result.done]

    def _survivor_request(
        self, unit: str, inventory: Inventory, state: UnitState, end: RunEnd
    ) -> PlanRequest:
        """The gate's request narrowed to the ended run: its invocation is the only ended one."""
        running = state.error is None and state.running
        live = live_invocation(end, running=running, invocation=state.invocation_id)
        request = self._request(unit, inventory, state, live)
        found = request.provenance
        return replace(
            request,
            provenance=UnitProvenance(
                found.problem, frozenset({end.invocation_id}), found.uid, found.ledger
            ),
            only_invocation=end.invocation_id,
        )

    def _reap_run(
        self, request: PlanRequest, inventory: Inventory
    ) -> tuple[list[ReapResult], float, float | None]:
        """Reap the run's holders as they appear, until the set is idle or they are gone.

        Bounded by the gate's timeout, and by ``_RELEASE_S`` once none of the run's processes
        holds a GPU (others hold the set then: the gate, if installed, decides the next start).
        Returns what was reaped, when the last reap returned and when the set was idle.
        """
        ports = self._ports
        settings = self._gate_settings(request)
        deadline = ports.monotonic() + self._settings.gate_timeout_s
        signalled: set[ProcessIdentity] = set()
        reaped: list[ReapResult] = []
        reaped_at = ports.monotonic()
        released_at: float | None = None
        while True:
            fresh = [
                d
                for d in plan(inventory.holders, request).to_reap
                if d.holder.identity not in signalled
            ]
            if fresh:
                reaped.extend(self._reap(reap_targets(fresh)))
                signalled.update(d.holder.identity for d in fresh)
                reaped_at = ports.monotonic()
                inventory = self._gather()
            now = ports.monotonic()
            if not set_blockers(inventory, settings):
                return reaped, reaped_at, now
            if plan(inventory.holders, request).to_reap:
                released_at = None
            elif released_at is None:
                released_at = now
            if now >= deadline or (released_at is not None and now - released_at >= _RELEASE_S):
                return reaped, reaped_at, None
            self._heartbeat_sleep(settings.poll_s)
            inventory = self._gather()

    def _swept(self, watch: _Watch, sweep: Sweep, pids: list[int]) -> None:
        """Record and say what a sweep did; the next start's time is added when it comes."""
        ports = self._ports
        watch.last_sweep = sweep
        watch.sweeps.append(_sweep_record(sweep, pids, _iso(ports.wall())))
        log = ports.log.info if sweep.reaped_after_s is not None else ports.log.warning
        log(
            "survivors of an ended run",
            unit=watch.name,
            invocation_id=sweep.end.invocation_id,
            pids=pids,
            summary=describe(sweep),
        )
        ports.notifier.status(self._status_line())

    def _note_next_start(self, watch: _Watch, event: UnitEvent) -> None:
        """The next run started: say whether the swept run's GPUs were free before it."""
        sweep = watch.last_sweep
        if sweep is None:
            return
        started = next_start(event, sweep.end)
        if started is None:
            return
        done = replace(sweep, next_start_after_s=started - sweep.end.ended_s)
        watch.last_sweep = None
        if watch.sweeps and watch.sweeps[-1]["invocation_id"] == sweep.end.invocation_id:
            watch.sweeps[-1] |= {
                "next_start_after_s": round(started - sweep.end.ended_s, 2),
                "summary": describe(done),
            }
        self._ports.log.info("next run started", unit=watch.name, summary=describe(done))

    def _gpu_evidence(self, watch: _Watch, inventory: Inventory, state: UnitState) -> GpuEvidence:
        """Stale holders of the unit's GPUs: what a reap would take while the unit runs.

        A GPU of the set needs a reset when NVML says so, or after a reset-class kernel Xid
        since the unit last came up (xidfaults).
        """
        live = state.invocation_id if state.running else None
        request = self._request(watch.name, inventory, state, live)
        stale = tuple(
            f"PID {d.holder.pid} ({escape(d.holder.comm)}) holds GPU "
            + ",".join(str(u.gpu_index) for u in d.holder.gpus)
            + f": {d.reason}"
            for d in plan(inventory.holders, request).to_reap
        )
        settings = self._gate_settings(request)
        wanted = request.gpu_set
        needs_reset = tuple(
            f"GPU {gpu.reading.index}: " + "; ".join(reasons)
            for gpu in inventory.gpus
            if (wanted is None or gpu.reading.index in wanted)
            and (reasons := reset_reasons(gpu.reading))
        )
        needs_reset += self._stuck(watch, inventory, wanted)
        faults = [
            XidFault(e.pci_bus_id, e.code, _iso_or_none(e.realtime_s))
            for e in self._faults.since(watch.up.since_s)
        ]
        needs_reset += blockers(faults, inventory.nvml.gpus, wanted)
        view = cuda_view(self._environment(watch.name, state), inventory.nvml.gpus)
        return GpuEvidence(
            stale_holders=stale,
            gpus_busy=bool(set_blockers(inventory, settings)),
            needs_reset=needs_reset,
            cuda_devices=device_phrases(view, inventory),
            cuda_note=view.note,
        )

    def _stuck(
        self, watch: _Watch, inventory: Inventory, wanted: frozenset[int] | None
    ) -> tuple[str, ...]:
        """Holders of the set the last recovery's SIGKILL left alive after an Xid naming them.

        Alive after SIGKILL, a process is in R or D inside the kernel by necessity; the same
        process still holding a GPU (it started before the Xid) is stuck. Reaping it again
        cannot help: the unit needs a GPU reset (needs operator).
        """
        last = watch.recoveries[-1] if watch.recoveries else {}
        stuck_pids = {
            r.get("pid")
            for r in last.get("reaped") or ()
            if isinstance(r, dict) and r.get("stuck_after_xid") is not None
        }
        xid_claims = claims(self._xids)
        found = []
        for holder in inventory.holders:
            gpus = [u.gpu_index for u in holder.gpus if wanted is None or u.gpu_index in wanted]
            if holder.pid not in stuck_pids or not gpus:
                continue
            claim = named_by(holder.pid, holder.identity.start_time / _TICKS, xid_claims)
            if claim is not None:
                found.append(
                    f"GPU {','.join(map(str, gpus))}: PID {holder.pid} ({escape(holder.comm)}) "
                    f"is {stuck_phrase(claim)}; SIGKILL did not end it"
                )
        return tuple(found)

    def _gate_settings(self, request: PlanRequest) -> GateSettings:
        settings = self._settings
        return GateSettings(
            request, settings.idle_threshold_mib * MIB, settings.gate_timeout_s, poll_s=0.5
        )

    def _recover(
        self, watch: _Watch, diagnosis: Diagnosis, inventory: Inventory, state: UnitState
    ) -> None:
        ports = self._ports
        now = ports.monotonic()
        request = self._request(watch.name, inventory, state, None)
        planned = [d.holder.pid for d in plan(inventory.holders, request).to_reap]
        record: dict[str, Any] = {
            "started_at": _iso(ports.wall()),
            "started_monotonic_s": now,
            "boot_id": ports.boot_id,
            "invocation_id": state.invocation_id,
            "reason": diagnosis.reason,
            "evidence": list(diagnosis.evidence),
            "planned_pids": planned,
        }
        watch.planner.recovered(now)
        if self._settings.daemon.dry_run:
            record |= {"result": "dry-run", "finished_at": _iso(ports.wall())}
            ports.log.warning(
                "dry run: would recover",
                unit=watch.name,
                steps=[
                    "systemctl stop",
                    f"reap {planned}",
                    "wait for idle GPUs",
                    "reset-failed",
                    "systemctl start",
                ],
            )
            watch.recoveries.append(bound_record(record))
            return
        watch.in_progress = record
        self._save(watch)
        self._carry_out(watch, record)

    def _resume_recovery(self, watch: _Watch) -> None:
        """A recovery interrupted by our own death (SIGKILL, crash) is finished, not repeated.

        Only when it is this boot's, young, the unit is as the recovery left it and dry_run is
        off (``recovery.resume_problem``); otherwise it is closed as abandoned, untouched.
        """
        record = watch.in_progress
        assert record is not None  # noqa: S101 - checked by the caller
        ports = self._ports
        state = self._show_unit(watch.name)
        problem = resume_problem(
            Interrupted(
                record_boot=record.get("boot_id"),
                record_started_s=record.get("started_monotonic_s"),
                boot=ports.boot_id,
                now=ports.monotonic(),
                active_state=None if state.error else state.active_state,
            ),
            dry_run=self._settings.daemon.dry_run,
            within_s=recover.STOP_WAIT_S + self._settings.gate_timeout_s + _RESUME_SLACK_S,
        )
        if problem is not None:
            ports.log.warning(
                "interrupted recovery not resumed",
                unit=watch.name,
                since=record.get("started_at"),
                reason=problem,
            )
            record |= {
                "finished_at": _iso(ports.wall()),
                "result": "abandoned",
                "problem": f"not resumed: {problem}",
            }
            watch.in_progress = None
            watch.recoveries.append(record)
            self._save(watch)
            return
        ports.log.warning(
            "resuming interrupted recovery", unit=watch.name, since=record.get("started_at")
        )
        self._carry_out(watch, record)

    def _carry_out(self, watch: _Watch, record: dict[str, Any]) -> None:
        ports = self._ports
        ports.notifier.status(f"recovering {watch.name}")
        ports.log.warning("recovery: stopping unit", unit=watch.name)
        done = recover.carry_out(watch.name, self._recovery_steps())
        record |= {"finished_at": _iso(ports.wall())} | done.record(claims(self._xids))
        watch.detector.reset(done.restarted_at)
        watch.in_progress = None
        watch.recoveries.append(bound_record(record))
        self._save(watch)
        log = ports.log.info if done.problem is None else ports.log.error
        log(
            "recovery finished",
            unit=watch.name,
            result=done.result,
            problem=done.problem,
            reaped=len(record["reaped"]),
        )
        ports.notifier.status(self._status_line())

    def _recovery_steps(self) -> recover.Steps:
        def gate_settings(unit: str, inventory: Inventory, state: UnitState) -> GateSettings:
            return self._gate_settings(self._request(unit, inventory, state, None))

        return recover.Steps(
            control=self._control,
            show_unit=self._show_unit,
            gather=self._gather,
            gate_settings=gate_settings,
            reap=self._reap,
            containers=self._fed_containers,
            monotonic=self._ports.monotonic,
            sleep=self._heartbeat_sleep,
        )

    def _fed(self, deadline_s: float, step: Callable[_P, _T]) -> Callable[_P, _T]:
        """``step`` run while a helper thread feeds the watchdog, for its deadline plus slack.

        A step that waits on its own deadline (an NVML snapshot, the reaper's grace, systemctl)
        can outlast WatchdogSec although nothing is wrong; the helper pings meanwhile. It stops
        at ``deadline_s + _STEP_SLACK_S`` whatever happens, so a step that hangs for good still
        starves the watchdog and systemd restarts the daemon.
        """
        interval = self._ports.watchdog_interval_s
        if interval is None:
            return step
        notifier, clock = self._ports.notifier, self._ports.monotonic

        def fed(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            # Starting a step is progress: a run of short steps (each under half an interval,
            # so the helper never pings) must not add up to a silent gap.
            notifier.watchdog()
            done = threading.Event()
            until = clock() + deadline_s + _STEP_SLACK_S

            def feed() -> None:
                # Every half interval: the main loop's last ping may be almost an interval old.
                while not done.wait(interval / 2) and clock() < until:
                    notifier.watchdog()

            feeder = threading.Thread(target=feed, name="watchdog-feeder", daemon=True)
            feeder.start()
            try:
                return step(*args, **kwargs)
            finally:
                done.set()
                feeder.join()

        return fed

    def _fed_containers(self, request: PlanRequest) -> Callable[[Inventory], bool] | None:
        """The unit's container stopper, fed like the reaper: an engine's stop can take a while."""
        stopper = self._ports.containers(request)
        if stopper is None:
            return None
        return self._fed(self._settings.reap_grace_s + _CONTAINER_SLACK_S, stopper)

    def _heartbeat_sleep(self, seconds: float) -> None:
        """Sleep inside a recovery while still proving to systemd's watchdog that we live."""
        if self._ports.watchdog_interval_s is not None:
            self._ports.notifier.watchdog()
        self._ports.sleep(seconds)

    # -- state that outlives the process ------------------------------------------------------

    def _save(self, watch: _Watch) -> None:
        document = UnitStateDocument(
            boot_id=self._ports.boot_id,
            planner=watch.planner.export(),
            recoveries=tuple(watch.recoveries),
            in_progress=watch.in_progress,
            liveness=watch.liveness.export(),
        )
        self._ports.save_unit_state(watch.name, document.to_json())

    def _restore(self, watch: _Watch) -> None:
        """Take back a unit's saved state; what is malformed is named and starts fresh."""
        saved = self._ports.load_unit_state(watch.name)
        if not saved:
            return
        document, problems = UnitStateDocument.parse(saved)
        if document.planner is not None:
            same_boot = self._ports.boot_id is not None and document.boot_id == (
                self._ports.boot_id
            )
            problems += [
                f"planner: {p}"
                for p in watch.planner.restore(document.planner, same_boot=same_boot)
            ]
        watch.recoveries.extend(document.recoveries)
        watch.in_progress = document.in_progress
        if document.liveness is not None:
            problems += watch.liveness.restore(document.liveness)
        for problem in problems:
            self._ports.log.warning("saved state ignored in part", unit=watch.name, problem=problem)

    # -- what operators see -------------------------------------------------------------------

    def _status_line(self) -> str:
        parts = []
        for watch in self._watches.values():
            if _needs_operator(watch):
                parts.append(f"{watch.name}: NEEDS OPERATOR")
            elif watch.diagnosis is not None and watch.diagnosis.looping:
                parts.append(f"{watch.name}: restart loop ({_action(watch.decision)})")
            elif watch.liveness.dead is not None:
                parts.append(f"{watch.name}: engine dead")
            elif watch.not_found:
                parts.append(f"{watch.name}: unit not found")
            else:
                parts.append(f"{watch.name}: ok")
        journal = self._follower.health()
        return f"watching {', '.join(parts)}; journal {journal.state}"

    def _publish(self, *, running: bool = True) -> None:
        """Write the snapshot and STATUS= when what they say changed (or the refresh is due)."""
        ports = self._ports
        health = self._follower.health()
        document = Snapshot(
            pid=os.getpid(),
            start_time=ports.identity.start_time if ports.identity else None,
            running=running,
            ready=self._ready,
            started_at=_iso(self._started_at),
            dry_run=self._settings.daemon.dry_run,
            journal_state=health.state,
            journal_reason=health.reason,
            units={
                name: replace(
                    _unit_snapshot(watch, self._reset_xids(watch)),
                    liveness=watch.liveness.view(ports.monotonic()).to_json(),
                )
                for name, watch in self._watches.items()
            },
            xids=tuple(_xid_snapshot(event) for event in self._xids),
            xids_malformed=self._xids_malformed,
        ).to_json()
        content = (json.dumps(document, sort_keys=True, default=str), self._status_line())
        refresh_due = ports.monotonic() >= self._published_at + SNAPSHOT_EVERY_S
        if content == self._published and not refresh_due:
            return
        ports.write_snapshot(document | {"updated_at": _iso(ports.wall())})
        if content[1] != (self._published or ("", ""))[1]:
            ports.notifier.status(content[1])
        self._published, self._published_at = content, ports.monotonic()

    def _reset_xids(self, watch: _Watch) -> list[dict[str, Any]]:
        """The reset-class Xids since the unit last came up, for its gate (xidfaults)."""
        return [
            to_record(event, _iso_or_none(event.realtime_s))
            for event in self._faults.since(watch.up.since_s)
        ]


_LIVENESS_ONLY = frozenset({EventKind.ENGINE_FATAL, EventKind.START_PHASE})
"""Output events only core.liveness reads (the detector keeps its window for restarts)."""


def _unit_snapshot(watch: _Watch, reset_xids: list[dict[str, Any]]) -> UnitSnapshot:
    diagnosis = watch.diagnosis
    return UnitSnapshot(
        systemd_state=watch.systemd_state,
        unit_found=not watch.not_found,
        looping=bool(diagnosis and diagnosis.looping),
        verdict=diagnosis.reason if diagnosis else "no lifecycle events seen yet",
        cause=diagnosis.cause.value if diagnosis else None,
        cause_detail=diagnosis.cause_detail if diagnosis else None,
        starts_in_window=diagnosis.starts_in_window if diagnosis else 0,
        failures_in_window=diagnosis.failures_in_window if diagnosis else 0,
        n_restarts=diagnosis.n_restarts if diagnosis else None,
        oom_device=diagnosis.oom_device if diagnosis else None,
        evidence=tuple(diagnosis.evidence) if diagnosis else (),
        action=_action(watch.decision),
        action_reason=watch.decision.reason if watch.decision else None,
        needs_operator=_needs_operator(watch),
        recoveries=tuple(watch.recoveries),
        recovery_in_progress=watch.in_progress is not None,
        survivors=tuple(watch.sweeps),
        reset_xids=tuple(reset_xids),
    )


def _sweep_record(sweep: Sweep, pids: list[int], at: str) -> dict[str, Any]:
    """A sweep as the snapshot keeps it (plain JSON; times in seconds after the run's end)."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    if sweep.dry_run:
        result = "dry-run"
    elif sweep.reported_only:
        result = "reported"
    else:
        result = "reaped" if sweep.idle_after_s is not None else "reaped, GPUs not idle"
    return {
        "at": at,
        "invocation_id": sweep.end.invocation_id,
        "ended_by": sweep.end.how,
        "stopped_on_purpose": sweep.end.stopped_on_purpose,
        "result": result,
        "pids": pids,
        "reaped_after_s": rounded(sweep.reaped_after_s),
        "idle_after_s": rounded(sweep.idle_after_s),
        "next_start_after_s": None,
        "containers": list(sweep.containers),
        "summary": describe(sweep),
    }


def _named(verdicts: Sequence[ContainerVerdict]) -> tuple[str, ...]:
    """``NAME (docker <id12>)`` for each container, as a sweep says it."""
    return tuple(f"{v.name} ({v.engine} {v.short_id})" for v in verdicts)


def _xid_snapshot(event: XidEvent) -> dict[str, object]:
    """One kernel Xid as status reads it back (text already escaped by the parser)."""
    return {
        "code": event.code,
        "xid_class": lookup(event.code).xid_class.value,
        "pci_bus_id": event.pci_bus_id,
        "pid": event.pid,
        "name": event.name,
        "detail": event.detail,
        "time": _iso_or_none(event.realtime_s),
        "monotonic_s": event.monotonic_s,
        "boot_id": event.boot_id,
    }


def _needs_operator(watch: _Watch) -> bool:
    """Recoveries gave up, or the last decision was that only an operator can help (a GPU reset)."""
    decision = watch.decision
    return watch.planner.needs_operator or (
        decision is not None and decision.action is Action.NEEDS_OPERATOR
    )


def _action(decision: RecoveryDecision | None) -> str | None:
    return decision.action.value if decision is not None else None


def _describe_state(state: UnitState) -> str:
    if state.error:
        return f"unknown ({state.error})"
    if state.not_found:
        return "not found (LoadState=not-found: systemd has no such unit)"
    return f"{state.active_state} ({state.sub_state})"


def _iso_or_none(seconds: float | None) -> str | None:
    return None if seconds is None else _iso(seconds)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")
