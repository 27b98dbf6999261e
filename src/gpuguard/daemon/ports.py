"""The daemon's ports: everything ``Daemon`` touches the world through, as protocols and one value.

The journal follower, sd_notify, the logger, a unit's container stopper and every adapter call
(NVML, systemd, the reaper, the state files, the clocks) arrive in ``Ports``, so tests drive the
same loop with real processes and the fake NVML, or with in-memory twins (tests/support). This
module owns the shape of that boundary and nothing else: no behaviour lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gpuguard.core.ledger import Ledger

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.adapters.journal import JournalHealth, JournalRecord
    from gpuguard.core.breaker import BreakerState
    from gpuguard.core.healthcheck import HealthTarget, ProbeResult
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.logger import Logger
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.unitcontainers import ContainerResult, ContainerVerdict
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ProcessIdentity, ReapResult, ReapTarget, UnitProvenance
    from gpuguard.daemon.ledgerkeeper import LedgerPorts


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
    reap: Callable[[str, Sequence[ReapTarget]], tuple[ReapResult, ...]]
    """Signal the targets a plan for this watched unit chose (the unit is said, never guessed)."""
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
    gate_refusal: Callable[[str], tuple[str, ...] | None] = lambda _unit: None
    """The blockers of the unit's gate when its newest decision refused a start, else None
    (core.gate.refusal over the gate's log)."""
    containers: Callable[[PlanRequest], UnitContainers | None] = lambda _r: None
    """The stopper of a unit's left-over containers, for a recovery's gate and for a sweep
    (containerstop)."""
    ledger: LedgerPorts | None = None
    """The provenance ledger's reads and writes (ledgerkeeper); None: no ledger is kept."""
    load_ledger: Callable[[], Ledger] = Ledger
    """The ledger a previous daemon of this boot left (ledgerstore)."""
    probe_health: Callable[[HealthTarget, float], ProbeResult] | None = None
    """One health probe with its timeout (healthprobe.probe); None: no unit is probed."""
    load_breaker: Callable[[], BreakerState | None] = lambda: None
    """The host-wide breaker of this boot as its file holds it (breakerfile); None: none."""
    save_breaker: Callable[[BreakerState], None] = lambda _state: None
    """Write the breaker's file (a person closes it there: ``gpuguard breaker --close``)."""
