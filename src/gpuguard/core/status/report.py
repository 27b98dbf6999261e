"""The values of a status report: what the judgement takes and what it gives (pure).

``StatusContext`` is everything besides the inventory (configuration facts, the units, the
daemon, who asks); ``StatusReport`` is the inventory judged, which ``text`` and ``document``
render. ``Level`` is the monitoring-plugin level, whose value is the exit status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuguard.core.leftovers import WatchedUnit

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence
    from datetime import datetime

    from gpuguard.core.breaker import BreakerLimits, BreakerState
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.levels import Level
    from gpuguard.core.prevented import Prevented
    from gpuguard.core.releaselog import GpuReleases
    from gpuguard.core.snapshot import DaemonView
    from gpuguard.core.unitcontainers import ContainerVerdict


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing an operator should know, with how serious it is."""

    level: Level
    message: str
    summary: str | None = None
    """The finding in one screen line for the headline (the message is below it); None: the
    message, cut to the headline's length."""


@dataclass(frozen=True, slots=True)
class UnitView:
    """A watched unit as status shows it: systemd's state, its GPU set, its last gate runs."""

    name: str
    state: str
    gpu_set: str
    gate_decisions: tuple[Mapping[str, Any], ...] = ()
    not_found: bool = False
    releases: tuple[GpuReleases, ...] = ()
    """How long its GPUs took to release a reaped holder's memory (core.releaselog)."""
    prevented: Prevented | None = None
    """The failed starts gpuguard prevented, in the records kept (core.prevented)."""


@dataclass(frozen=True, slots=True)
class StatusContext:
    """What the judgement needs besides the inventory: configuration facts and who is asking."""

    watched_units: Mapping[str, Sequence[str]]
    protected_names: Collection[str]
    idle_threshold_bytes: int
    as_root: bool
    units: tuple[UnitView, ...] = ()
    boot_time: float | None = None
    clock_ticks: int = 100
    daemon: DaemonView | None = None
    since: datetime | None = None
    """The start of the history shown (``--since``): Xid events, recoveries, sweeps; None: all
    the daemon keeps. The caller leaves older gate decisions out of ``units`` itself."""
    unit_containers: Mapping[str, tuple[str, ContainerVerdict]] = field(default_factory=dict)
    """Containers (``docker:<id12>``) the engine confirms are a watched unit's, as the gate
    confirms them (adapters/containerstop.owners): the unit and the verdict on it."""
    watched: tuple[WatchedUnit, ...] = ()
    """Each watched unit with its GPU set, live run and provenance, as the gate would see it;
    empty: built from ``watched_units`` with nothing asked of systemd (nothing proven)."""
    no_config_file: bool = False
    """No configuration file was read (a source install): the units are the default one."""
    breaker: BreakerState | None = None
    """The host-wide breaker as its file holds it (core.breaker); None: closed."""
    breaker_limits: BreakerLimits | None = None

    def watched_view(self) -> tuple[WatchedUnit, ...]:
        """The units every check of status judges against (one place for the GPU sets)."""
        if self.watched:
            return self.watched
        return tuple(WatchedUnit(name, tuple(p)) for name, p in self.watched_units.items())


@dataclass(frozen=True, slots=True)
class StatusReport:
    """An inventory judged: the overall level, the headline and each finding."""

    inventory: Inventory
    level: Level
    headline: str
    findings: tuple[Finding, ...]
    idle_gpus: frozenset[int]
    generated_at: datetime
    units: tuple[UnitView, ...] = ()
    boot_time: float | None = None
    clock_ticks: int = 100
    daemon: DaemonView | None = None
    since: datetime | None = None
    unit_containers: Mapping[str, tuple[str, ContainerVerdict]] = field(default_factory=dict)
