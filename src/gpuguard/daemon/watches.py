"""The daemon's state: one ``Watch`` per watched unit, and ``DaemonState``, which every part shares.

``DaemonState`` is the base of ``loop.Daemon``: it wires one detector, recovery planner, run-end
tracker and liveness per unit, wraps the long adapter calls so the watchdog stays fed, and holds
what more than one part of the loop asks: the unit's facts (core.unitfacts, merged from the
ports' answers by the gate's rule) and its plan request (its GPU set, provenance and the
ledger's claims), the gate's settings for it, systemd's view of it, and the per-unit state
file that outlives the process (``UnitStateDocument``: recoveries, the planner's backoff, an
interrupted recovery, the learned start phases).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuguard.core.breaker import BreakerState, Recovery, admit, open_phrase
from gpuguard.core.detector import Detector
from gpuguard.core.gate.run import GateSettings
from gpuguard.core.gpuset import resolve_gpu_set
from gpuguard.core.healthcheck import HealthCheck
from gpuguard.core.liveness import Liveness
from gpuguard.core.policy import PlanRequest, Scope
from gpuguard.core.recovery import RecoveryPlanner
from gpuguard.core.runend import RunEnds
from gpuguard.core.unitfacts import unit_facts
from gpuguard.core.values import MIB
from gpuguard.core.xid.faults import FaultLog, LastUp
from gpuguard.daemon.documents import UnitStateDocument
from gpuguard.daemon.ledgerkeeper import LedgerKeeper
from gpuguard.daemon.watchdog import WatchdogFeeder

if TYPE_CHECKING:
    from gpuguard.config import Settings
    from gpuguard.core.detector import Diagnosis
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.recovery import RecoveryDecision
    from gpuguard.core.runend import Sweep
    from gpuguard.core.unitfacts import UnitFacts
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.xid.events import XidEvent
    from gpuguard.core.xid.hung import HungGpuLine
    from gpuguard.daemon.ports import Follower, Ports

XIDS_KEPT = 50
HANGS_KEPT = 10
"""Kernel lines that say a GPU hangs kept for status (core.xid.hung): the newest few."""
"""Kernel Xid events the snapshot keeps (the newest), so a storm of them costs nothing."""
# How often a verdict is re-derived from the events alone, so "starting" becomes "up".
REFRESH_EVERY_S = 30.0
CHORE_EARLY_S = 1.0
"""How early a wake may do a periodic chore (a refresh, a ledger record) that is almost due, so
that chores waiting for the watchdog's wakes stay on them instead of slipping one ping later."""
_RECENT = 10


@dataclass
class Watch:
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
    """When the unit last came up: reset-class Xids before it no longer count (xid.faults)."""
    stuck_said: str | None = None
    """The run whose stuck start was logged (once per run)."""
    dead_due: float | None = None
    """When to act on an engine seen dying live (its grace, or a recovery backoff's end)."""
    health: HealthCheck | None = None
    """Its health check's count (core.healthcheck); None: the unit sets no ``health_url``."""
    silence_recovered: bool = False
    """The daemon's last recovery of a dead engine was for a silent health check alone: the
    next such verdict is reported, never acted on (core.livenessview.left_alone)."""
    read_through_s: float | None = None
    """The newest journal moment (monotonic) of an event of this unit the detector has seen:
    its verdict line says it, so explain replays exactly what the daemon had read, not what
    arrived while it swept or recorded."""


class DaemonState:
    """What the daemon knows, and the lookups its parts share (``loop.Daemon`` is one)."""

    def __init__(self, settings: Settings, follower: Follower, ports: Ports) -> None:
        """Wire one detector and one recovery planner per watched unit."""
        self._settings = settings
        self._follower = follower
        self._ports = ports
        self._feeder = WatchdogFeeder(ports)
        loop, limits = settings.daemon.loop(), settings.daemon.recovery_limits()
        self._watches = {
            name: Watch(
                name,
                Detector(name, loop),
                RecoveryPlanner(limits),
                RunEnds(name),
                Liveness(
                    name,
                    unit.server,
                    clean_exit_is_death=settings.daemon.clean_exit_is_death,
                ),
                health=None
                if unit.health_url is None
                else HealthCheck(unit.health_every_s, unit.health_failures),
            )
            for name, unit in settings.units.items()
        }
        self._gather = self._feeder.fed(settings.nvml_timeout_s, ports.gather)
        self._show_unit = self._feeder.fed(0.0, ports.show_unit)
        self._control = self._feeder.fed(0.0, ports.control)
        self._reap = self._feeder.fed(settings.reap_grace_s, ports.reap)
        self._provenance = self._feeder.fed(0.0, ports.provenance)  # journalctl, systemctl's 10 s
        self._started_at = ports.wall()
        self._stop = False
        self._ready = False
        # Often enough that a run counts as up soon after stable_s; rarely enough to stay idle.
        self._refresh_every_s = min(REFRESH_EVERY_S, settings.daemon.stable_s / 2)
        self._published: tuple[str, str] | None = None
        self._published_at = float("-inf")
        self._xids: deque[XidEvent] = deque(maxlen=XIDS_KEPT)
        self._xids_malformed = 0
        self._hangs: deque[HungGpuLine] = deque(maxlen=HANGS_KEPT)
        self._faults = FaultLog()
        self._unjudged: dict[str, frozenset[int]] = {}  # MIG GPUs last said per unit
        self._keeper = LedgerKeeper(ports.ledger, ports.load_ledger(), ports.wall)
        self._breaker = ports.load_breaker() or BreakerState(boot_id=ports.boot_id)

    def _admit(self, unit: str, kind: str, at: str) -> str | None:
        """Ask the host-wide breaker for one recovery (counted); None: go on, else why not.

        The file wins over what this process remembers (a person may have closed it); without
        one, the breaker this process kept counts. Dry runs act on nothing and never ask.
        """
        ports, limits = self._ports, self._settings.daemon.breaker_limits()
        self._breaker = ports.load_breaker() or self._breaker
        was_open = self._breaker.is_open
        asked = Recovery(ports.monotonic(), at, unit, kind)
        allowed, self._breaker = admit(self._breaker, limits, asked)
        ports.save_breaker(self._breaker)
        if allowed:
            return None
        said = open_phrase(self._breaker, limits)
        if not was_open:
            ports.log.critical(
                "breaker open",
                unit=unit,
                kind=kind,
                recoveries=[f"{r.at} {r.unit} {r.kind}" for r in self._breaker.recoveries],
                command="gpuguard breaker --close",
            )
        return (
            f"{said}: gpuguard's daemon only reports until a person closes it "
            "(`gpuguard breaker --close`, after checking the host)"
        )

    def request_stop(self) -> None:
        """Ask the loop to end (SIGTERM handler); it finishes within about a second."""
        self._stop = True

    def _note_state(self, watch: Watch, state: UnitState) -> None:
        """Remember systemd's view; say once that a watched unit does not exist (a typo?)."""
        if state.not_found and not watch.not_found:
            self._ports.log.warning(
                "watched unit not found", unit=watch.name, load_state=state.load_state
            )
        watch.not_found = state.not_found
        watch.systemd_state = state.in_words()

    def _facts(self, unit: str, state: UnitState) -> UnitFacts:
        """The unit's facts, gathered through the ports and merged as the gate merges its own.

        Its GPU variables as the gate recorded them (EnvironmentFile= included), else systemd's
        Environment=; systemd's provenance, with what this daemon's ledger recorded.
        """
        recorded = self._ports.gate_environment(unit)
        return unit_facts(
            state, self._provenance(state), self._keeper.evidence(unit), environment=recorded
        )

    def _request(
        self, unit: str, inventory: Inventory, facts: UnitFacts, live: str | None
    ) -> PlanRequest:
        settings = self._settings
        unit_settings = settings.units[unit]
        gpu_set = resolve_gpu_set(unit_settings.gpus, facts.environment, inventory.nvml.gpus)
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
            provenance=facts.provenance,
            live_invocation=live,
            adopt=unit_settings.adopt,
        )

    def _gate_settings(self, request: PlanRequest) -> GateSettings:
        settings = self._settings
        return GateSettings(
            request, settings.idle_threshold_mib * MIB, settings.gate_timeout_s, poll_s=0.5
        )

    # -- state that outlives the process ------------------------------------------------------

    def _save(self, watch: Watch) -> None:
        document = UnitStateDocument(
            boot_id=self._ports.boot_id,
            planner=watch.planner.export(),
            recoveries=tuple(watch.recoveries),
            in_progress=watch.in_progress,
            liveness=watch.liveness.export(),
        )
        self._ports.save_unit_state(watch.name, document.to_json())

    def _restore(self, watch: Watch) -> None:
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
