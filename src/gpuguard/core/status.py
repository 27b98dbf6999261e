"""Judge an inventory and render it for an operator: one screen of text, or versioned JSON (pure).

The exit status follows the monitoring-plugin convention (0 OK, 1 WARNING, 2 CRITICAL,
3 UNKNOWN) so the same command serves a human at a terminal and a Nagios/Icinga-style check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from gpuguard.core.baseline import CONFIRM_AFTER_S, plausible_max
from gpuguard.core.escaping import escape
from gpuguard.core.health import health_warnings, needs_reboot, reset_reasons
from gpuguard.core.idle import is_idle_seen
from gpuguard.core.leftovers import Kind, WatchedUnit, blockers, left_overs
from gpuguard.core.mig import UNJUDGED, mig_on, pending_change
from gpuguard.core.since import within
from gpuguard.core.values import MIB, MemoryApi, NvmlHealth, ReservedSource
from gpuguard.core.xid import XidClass
from gpuguard.core.xidevents import normalize_pci
from gpuguard.core.xidstuck import STUCK_STATES, claims_from_snapshot, named_by, stuck_phrase

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping, Sequence

    from gpuguard.core.inventory import GpuOccupancy, Holder, Inventory, VanishedProcess
    from gpuguard.core.unitcontainers import ContainerVerdict
    from gpuguard.core.values import GpuHealth, GpuReading
    from gpuguard.core.xidstuck import XidClaim

SCHEMA_VERSION = 3
_COMMAND_WIDTH = 100


class Level(IntEnum):
    """Monitoring-plugin levels; the value is the exit status."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing an operator should know, with how serious it is."""

    level: Level
    message: str


@dataclass(frozen=True, slots=True)
class UnitView:
    """A watched unit as status shows it: systemd's state, its GPU set, its last gate runs."""

    name: str
    state: str
    gpu_set: str
    gate_decisions: tuple[Mapping[str, Any], ...] = ()
    not_found: bool = False


@dataclass(frozen=True, slots=True)
class DaemonView:
    """The watchdog daemon as its snapshot shows it, and whether that process is still alive.

    ``state``: "running", "stopped" (shut down cleanly), "dead" (the snapshot says running but
    its process is gone) or "absent" (no snapshot: the daemon is not installed or never ran).
    """

    state: str
    snapshot: Mapping[str, Any]


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


def assess(inventory: Inventory, context: StatusContext, now: datetime) -> StatusReport:
    """Turn evidence into findings; the worst finding sets the level."""
    findings = [
        *_gate_findings(inventory, context),
        *_daemon_findings(inventory, context),
        *_nvml_findings(inventory),
        *_gpu_findings(inventory),
        *_xid_findings(inventory, context.daemon, context.since),
        *_holder_findings(inventory, context),
        *_shared_gpu_findings(context.watched),
        *_container_findings(inventory, context.unit_containers),
        *_partial_findings(inventory),
    ]
    if inventory.scan.unreadable and not context.as_root:
        findings.append(
            Finding(
                Level.OK,
                f"{inventory.scan.unreadable} processes could not be inspected without root; "
                "run as root to see every holder",
            )
        )
    idle = frozenset(
        gpu.reading.index
        for gpu in inventory.gpus
        if is_idle_seen(inventory, gpu, context.idle_threshold_bytes)
    )
    level = max((f.level for f in findings), default=Level.OK)
    if level is Level.OK:
        headline = _ok_headline(inventory, idle)
    else:
        headline = next(f.message for f in findings if f.level is level)
    return StatusReport(
        inventory,
        level,
        headline,
        tuple(findings),
        idle,
        now,
        context.units,
        context.boot_time,
        context.clock_ticks,
        context.daemon,
        context.since,
        context.unit_containers,
    )


_PARTIAL_NAMED = 10


def _partial_findings(inventory: Inventory) -> list[Finding]:
    """A budget of the /proc walk ran out: never "clean", so say whom and what it may hide.

    The first ten are named (a flood may be hundreds of processes; ``--json`` lists them all).
    One that could hold a GPU is a WARNING; one that shows no NVIDIA file and that NVML does not
    list blocks nothing and is only named (OK): any user can open many descriptors, and that
    alone must not turn the host's monitoring to WARNING.
    """
    findings = [
        Finding(
            Level.WARNING if other.gpus else Level.OK,
            f"PID {other.pid} ({escape(other.comm)}, {escape(other.user)}) not fully inspected: "
            f"{other.reason}"
            + (
                "; GPU " + ", ".join(map(str, other.gpus)) + " not reported idle"
                if other.gpus
                else "; it shows no NVIDIA file in what was read and NVML does not list it"
            ),
        )
        for other in inventory.partial[:_PARTIAL_NAMED]
    ]
    if len(inventory.partial) > _PARTIAL_NAMED:
        rest = inventory.partial[_PARTIAL_NAMED:]
        gpus = sorted({index for other in rest for index in other.gpus})
        findings.append(
            Finding(
                Level.WARNING if gpus else Level.OK,
                f"{len(rest)} more processes not fully inspected"
                + ("; GPU " + ", ".join(map(str, gpus)) + " not reported idle" if gpus else ""),
            )
        )
    if inventory.scan.not_visited:
        findings.append(
            Finding(
                Level.WARNING,
                f"{inventory.scan.not_visited} processes not inspected: the /proc walk's "
                "budget of processes or time ran out (docs/security.md)",
            )
        )
    return findings


def _gate_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    """A watched unit systemd does not know; a unit whose last start the gate refused.

    A refusal stays the headline only while its cause lasts: once the unit's GPUs are idle it
    is history (OK), said so rather than hidden.
    """
    units = context.units
    findings = [
        Finding(
            Level.WARNING,
            f"watched unit {unit.name} does not exist (LoadState=not-found): "
            "check the name in the configuration",
        )
        for unit in units
        if unit.not_found
    ]
    watched = {w.name: w for w in context.watched_view()}
    for unit in units:
        last = unit.gate_decisions[-1] if unit.gate_decisions else None
        if last is None or last.get("result") != "refused":
            continue
        listed = _list(last.get("blockers"))
        why = escape(str(listed[0])) if listed else "GPUs busy"
        said = f"the gate refused the last start of {unit.name} at {last.get('time')}: {why}"
        seen = watched.get(unit.name)
        if seen is not None and _set_idle(inventory, seen, context.idle_threshold_bytes):
            findings.append(Finding(Level.OK, f"{said}; its cause is gone: its GPUs are idle now"))
            continue
        way_out = "" if seen is None else _way_out(inventory, seen, context)
        findings.append(Finding(Level.CRITICAL, said + way_out))
    return findings


def _set_idle(inventory: Inventory, unit: WatchedUnit, threshold_bytes: int) -> bool:
    """Whether NVML answers and every GPU of the unit's set is present and idle."""
    if inventory.nvml.health not in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD):
        return False
    present = {gpu.reading.index for gpu in inventory.gpus}
    if unit.gpu_set is not None and not unit.gpu_set <= present:
        return False
    wanted = [g for g in inventory.gpus if unit.gpu_set is None or g.reading.index in unit.gpu_set]
    return bool(wanted) and all(is_idle_seen(inventory, g, threshold_bytes) for g in wanted)


def _way_out(inventory: Inventory, unit: WatchedUnit, context: StatusContext) -> str:
    """What keeps the unit's GPUs that its gate and the daemon will not free, and the command.

    Empty when nothing is kept: the gate and the daemon can free what there is. A command only
    for holders that look like the unit's (its patterns): another tenant's job is its owner's.
    """
    found = blockers(inventory, unit, context.watched_view(), context.protected_names)
    if found.live_elsewhere:
        return (
            f"; its GPUs are held by the running {', '.join(found.live_elsewhere)}: stop it or "
            "give the units disjoint GPUs (gpus = [...] in the configuration)"
        )
    if not found.holders:
        return ""
    if found.command is None:
        return (
            f"; its GPUs are held by processes that are not {unit.name}'s by any evidence, "
            f"which gpuguard never reaps: {found.phrase()}; their owners must stop them, or "
            "give the unit other GPUs"
        )
    return f"; gpuguard will not reap {found.phrase()}; after checking them, run `{found.command}`"


def _daemon_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    """Loops the daemon found, units it gave up on, and a daemon that died.

    A loop with a GPU cause whose holders gpuguard cannot reap is CRITICAL: nothing will end it
    but an operator, so the finding names the blockers and the command.
    """
    daemon = context.daemon
    if daemon is None or daemon.state == "absent":
        return []
    findings: list[Finding] = []
    if daemon.state == "dead":
        findings.append(
            Finding(
                Level.WARNING,
                f"the gpuguard daemon (PID {daemon.snapshot.get('pid')}) is not running; its last "
                f"snapshot is from {daemon.snapshot.get('updated_at')}",
            )
        )
    watched = {w.name: w for w in context.watched_view()}
    for name, value in _dict(daemon.snapshot.get("units")).items():
        unit = _dict(value)
        seen = watched.get(name)
        gpu_cause = unit.get("cause") == "stale-gpu-holders" and seen is not None
        way_out = _way_out(inventory, seen, context) if gpu_cause and seen else ""
        if unit.get("needs_operator") and unit.get("cause") == "gpu-needs-reset":
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{name} needs an operator: a GPU of its set needs a reset, which no kill or "
                    f"restart can replace ({escape(str(unit.get('cause_detail')))})",
                )
            )
        elif unit.get("needs_operator"):
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{name} needs an operator: recoveries did not break its restart loop "
                    f"({escape(str(unit.get('verdict')))}){way_out}",
                )
            )
        elif unit.get("looping") and way_out:
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{name} is in a restart loop caused by its GPUs that gpuguard cannot end: "
                    f"{escape(str(unit.get('verdict')))}{way_out}",
                )
            )
        elif unit.get("looping") and unit.get("cause") == "does-not-fit":
            # No reap or restart ends it: the server does not fit as configured; say the knob.
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{name} is in a restart loop that no reap can end: "
                    f"{escape(str(unit.get('cause_detail')))}",
                )
            )
        elif unit.get("looping"):
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{name} is in a restart loop: {escape(str(unit.get('verdict')))}; "
                    f"cause {unit.get('cause')}; daemon action {unit.get('action')}",
                )
            )
        findings.extend(_liveness_findings(name, _dict(unit.get("liveness"))))
    return findings


def _liveness_findings(name: str, liveness: Mapping[str, Any]) -> list[Finding]:
    """An engine dead while its unit lives (CRITICAL), a start stuck in a phase (WARNING)."""
    level = {"critical": Level.CRITICAL, "warning": Level.WARNING}.get(str(liveness.get("level")))
    if level is None:
        return []
    return [Finding(level, f"{name}: {escape(str(liveness.get('summary')))}")]


def _ok_headline(inventory: Inventory, idle: frozenset[int]) -> str:
    total = len(inventory.gpus)
    if total and len(idle) == total:
        return f"all {total} GPUs idle"
    busy = total - len(idle)
    return f"{busy} of {total} GPUs in use by live processes"


def _nvml_findings(inventory: Inventory) -> list[Finding]:
    nvml = inventory.nvml
    if nvml.health is NvmlHealth.OK:
        return []
    reason = nvml.reason or nvml.health.value
    if nvml.health is NvmlHealth.TIMED_OUT:
        return [Finding(Level.CRITICAL, reason)]
    if nvml.health is NvmlHealth.DRIVER_TOO_OLD:
        return [Finding(Level.WARNING, reason)]
    # Without NVML the /proc scan is the only evidence; with none at all we cannot judge.
    level = Level.WARNING if inventory.holders else Level.UNKNOWN
    return [Finding(level, reason)]


def _v1_findings(inventory: Inventory) -> list[Finding]:
    """Say when memory figures are estimates, and when they cannot even be that."""
    estimated: list[str] = []
    findings: list[Finding] = []
    for gpu in inventory.gpus:
        memory = gpu.reading.memory
        if memory is None or memory.api is not MemoryApi.V1:
            continue
        if memory.reserved_bytes is None:
            bound = plausible_max(memory)
            above = (
                f"; its {_mib(memory.used_bytes)} in use is more than a driver reserves (at most "
                f"{_mib(bound)}): memory held by something, never learned as the reserve"
                if memory.used_bytes > bound
                else ""
            )
            findings.append(
                Finding(
                    Level.WARNING,
                    f"GPU {gpu.reading.index}: the v1 memory API counts the driver's reserved "
                    "memory as used and no estimate of it exists yet, so idle cannot be told "
                    "from busy (set v1_reserved_mib, or run gpuguard as root while it is idle)"
                    + above,
                )
            )
        else:
            if memory.reserved_source is ReservedSource.UNCONFIRMED:
                findings.append(
                    Finding(
                        Level.WARNING,
                        f"GPU {gpu.reading.index}: the v1 reserve learned for it "
                        f"({_mib(memory.reserved_bytes)}) is not confirmed yet: an idle reading "
                        f"{CONFIRM_AFTER_S:.0f} s or more after the first confirms it; until "
                        "then the GPU is not called idle",
                    )
                )
            estimated.append(
                f"GPU {gpu.reading.index} {_mib(memory.reserved_bytes)} "
                f"({memory.reserved_source or 'reported'})"
            )
    if estimated:
        findings.insert(
            0,
            Finding(
                Level.OK,
                "memory use is estimated: the v1 memory API counts the driver's reserved memory "
                "as used; taken out: " + ", ".join(estimated),
            ),
        )
    return findings


def _gpu_findings(inventory: Inventory) -> list[Finding]:
    findings: list[Finding] = _v1_findings(inventory)
    for gpu in inventory.gpus:
        reading = gpu.reading
        if reasons := reset_reasons(reading):
            findings.append(Finding(Level.CRITICAL, _reset_advice(reading, reasons)))
        elif reading.problem:
            findings.append(Finding(Level.WARNING, f"GPU {reading.index}: {reading.problem}"))
        findings.extend(
            Finding(Level.WARNING, f"GPU {reading.index}: {warning}")
            for warning in health_warnings(reading)
        )
        if mig_on(reading):
            # Its unattributed memory may well be another tenant's instance: said here, once.
            findings.append(Finding(Level.WARNING, _mig_finding(reading)))
            continue
        if change := pending_change(reading):
            findings.append(Finding(Level.OK, f"GPU {reading.index}: {change}"))
        if gpu.unattributed_bytes:
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"GPU {reading.index}: {_mib(gpu.unattributed_bytes)} in use that no visible "
                    "process explains (a process in another PID namespace, or the driver "
                    "still releasing it)",
                )
            )
        findings.extend(_namespace_findings(gpu))
    findings.extend(_claim_findings(inventory))
    findings.extend(
        Finding(
            Level.OK,
            f"GPU {hidden.gpu_index}: NVML lists PID {hidden.pid}"
            f"{'' if hidden.used_bytes is None else f' ({_mib(hidden.used_bytes)})'}"
            ", which exists but is not inspectable without root",
        )
        for hidden in inventory.uninspectable
    )
    return findings


def _mig_finding(reading: GpuReading) -> str:
    change = pending_change(reading)
    return (
        f"GPU {reading.index}: MIG mode is on: {UNJUDGED}; the gate and the daemon neither wait "
        "on nor reap from it (check its instances with `nvidia-smi mig -lgi` and "
        "`nvidia-smi`)" + (f"; {change}" if change else "")
    )


def _namespace_findings(gpu: GpuOccupancy) -> list[Finding]:
    """Inside a PID namespace: memory credited to this container's holders, or used outside."""
    index = gpu.reading.index
    findings = []
    if gpu.container_bytes:
        findings.append(
            Finding(
                Level.OK,
                f"GPU {index}: {_mib(gpu.container_bytes)} held by processes of this container "
                f"({_CONTAINER_NOTE})",
            )
        )
    if gpu.outside_bytes:
        findings.append(
            Finding(
                Level.WARNING,
                f"GPU {index}: {_mib(gpu.outside_bytes)} {_OUTSIDE_NOTE}",
            )
        )
    return findings


_CONTAINER_NOTE = "per-process amounts not available: the driver reports host PIDs"
_OUTSIDE_NOTE = (
    "used from outside this container (another container or the host): no process here "
    "holds the GPU; reported, never reaped, and a start gated on this GPU waits for it"
)


def _claim_findings(inventory: Inventory) -> list[Finding]:
    """NVML PIDs /proc does not back: gone (on a host) or from another PID namespace."""
    in_namespace = inventory.containment.foreign_pids
    if in_namespace:
        findings = [
            Finding(
                Level.OK,
                f"GPU {index}: NVML lists host PIDs "
                + ", ".join(f"{g.pid}{_size(g.used_bytes)}" for g in gone)
                + ", of another PID namespace (the driver reports host PIDs)",
            )
            for index, gone in _by_gpu(inventory.vanished).items()
        ]
    else:
        findings = [
            Finding(
                Level.CRITICAL,
                f"GPU {gone.gpu_index}: NVML lists PID {gone.pid}{_size(gone.used_bytes)}"
                " but /proc has no such process",
            )
            for gone in inventory.vanished
        ]
    findings.extend(
        Finding(
            Level.OK if in_namespace else Level.CRITICAL,
            f"GPU {other.gpu_index}: NVML lists PID {other.pid}{_size(other.used_bytes)}, a PID "
            f"from another PID namespace or a reused one: PID {other.pid} here is an unrelated "
            f"process that holds no device file of GPU {other.gpu_index} (not credited, never "
            "signalled)",
        )
        for other in inventory.foreign
    )
    return findings


def _by_gpu(vanished: Sequence[VanishedProcess]) -> dict[int, list[VanishedProcess]]:
    grouped: dict[int, list[VanishedProcess]] = {}
    for gone in vanished:
        grouped.setdefault(gone.gpu_index, []).append(gone)
    return grouped


def _size(used_bytes: int | None) -> str:
    return "" if used_bytes is None else f" ({_mib(used_bytes)})"


# Xid classes after which no kill helps (xid.py); an application fault is the reaper's business.
_SERIOUS_XIDS = frozenset({XidClass.RESET_GPU, XidClass.REBOOT, XidClass.OPERATOR})


def xid_events(
    inventory: Inventory, daemon: DaemonView | None, since: datetime | None = None
) -> list[dict[str, Any]]:
    """The daemon's recent kernel Xid events, each with the GPU index NVML gives its PCI id.

    ``gpu`` is None when NVML knows no GPU at that address (reported, not dropped). With
    ``since``, only the events logged from then on.
    """
    if daemon is None:
        return []
    by_pci = {
        normalize_pci(gpu.reading.pci_bus_id): gpu.reading.index
        for gpu in inventory.gpus
        if gpu.reading.pci_bus_id
    }
    events = []
    for raw in _list(_dict(daemon.snapshot.get("xid")).get("recent")):
        event = _dict(raw)
        pci = event.get("pci_bus_id")
        if not isinstance(pci, str) or not isinstance(event.get("code"), int):
            continue
        if not within(since, event.get("time")):
            continue
        events.append({**event, "gpu": by_pci.get(normalize_pci(pci))})
    return events


def _xid_findings(
    inventory: Inventory, daemon: DaemonView | None, since: datetime | None
) -> list[Finding]:
    """Xids after which no kill helps, per GPU; Xids for an address NVML does not know."""
    findings: list[Finding] = []
    seen: set[tuple[object, object]] = set()
    for event in reversed(xid_events(inventory, daemon, since)):
        key = (event["gpu"] if event["gpu"] is not None else event["pci_bus_id"], event["code"])
        if key in seen:
            continue
        seen.add(key)
        what = _xid_phrase(event)
        if event["gpu"] is None:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"kernel Xid for PCI {escape(str(event['pci_bus_id']))}, which NVML "
                    f"does not know{_unaddressed(inventory)}: {what}",
                )
            )
        elif event.get("xid_class") in _SERIOUS_XIDS:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"GPU {event['gpu']} had {what}: no kill helps after it; a reset or reboot "
                    "may be needed (docs/xid.md)",
                )
            )
    malformed = _dict(daemon.snapshot.get("xid")).get("malformed") if daemon else None
    if isinstance(malformed, int) and malformed > 0:
        findings.append(
            Finding(Level.OK, f"{malformed} kernel Xid line(s) could not be read (daemon log)")
        )
    return findings


def _unaddressed(inventory: Inventory) -> str:
    """GPUs NVML cannot give an address for (lost, unreadable): an unmatched Xid may be theirs.

    Said, not guessed: the address of a lost GPU is exactly what NVML can no longer tell.
    """
    without = [str(g.reading.index) for g in inventory.gpus if not g.reading.pci_bus_id]
    if not without:
        return ""
    return f" (NVML cannot tell the address of GPU {', '.join(without)}: it may be that one)"


def _xid_phrase(event: Mapping[str, Any]) -> str:
    who = f", pid {event['pid']}" if isinstance(event.get("pid"), int) else ""
    return (
        f"Xid {event['code']} ({escape(str(event.get('xid_class')))}) at "
        f"{escape(str(event.get('time')))}: "
        f"{escape(str(event.get('detail') or ''))}{who}"
    )


def _reset_advice(reading: GpuReading, reasons: Sequence[str]) -> str:
    """What is wrong and what to do: killing processes cannot free such a GPU."""
    index = reading.index
    what = "; ".join(reasons)
    if needs_reboot(reading):
        return (
            f"GPU {index} needs a reboot ({what}): no kill or restart can free it; drain the "
            "host and reboot it (docs/runbook.md, GPU needs a reset)"
        )
    return (
        f"GPU {index} needs a GPU reset ({what}): no kill or restart can free it; stop every "
        f"process using it, then run `nvidia-smi -r -i {index}` as root, or reboot "
        "(docs/runbook.md, GPU needs a reset)"
    )


def _holder_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    findings: list[Finding] = []
    stuck = _stuck_claims(context)
    for holder in inventory.holders:
        who = f"PID {holder.pid} ({escape(holder.comm)}) holding {_gpu_list(holder)}"
        claim = stuck(holder)
        if claim is not None:
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{who} is {escape(stuck_phrase(claim))}: SIGKILL did not end it and no "
                    "reap will; reset the GPU or reboot (docs/runbook.md, GPU needs a reset)",
                )
            )
        elif holder.state == "D":
            findings.append(_sleep_finding(who, holder.kernel_wait))
        elif holder.state == "Z":
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{who} is a zombie: a thread or its parent keeps its GPU memory",
                )
            )
    findings.extend(_left_over_findings(inventory, context))
    return findings


def _shared_gpu_findings(units: Sequence[WatchedUnit]) -> list[Finding]:
    """Two units whose GPU sets, as the gate resolves them, share a GPU (or one has no set).

    Judged on the resolved sets, config or CUDA_VISIBLE_DEVICES alike: each waits on the
    other's processes at every gate, and neither reaps the other's.
    """
    findings = []
    resolved = [unit for unit in units if unit.gpu_source]
    for index, unit in enumerate(resolved):
        for other in resolved[index + 1 :]:
            if unit.gpu_set is None or other.gpu_set is None:
                open_one = unit if unit.gpu_set is None else other
                shared = f"{open_one.name} may use every GPU ({escape(open_one.gpu_source)})"
            elif unit.gpu_set & other.gpu_set:
                listed = ",".join(str(i) for i in sorted(unit.gpu_set & other.gpu_set))
                shared = f"both use GPU {listed}"
            else:
                continue
            findings.append(
                Finding(
                    Level.WARNING,
                    f"units {unit.name} and {other.name} share GPUs: {shared}; each gate waits "
                    "on the other's processes: give each unit its own GPUs",
                )
            )
    return findings


def _left_over_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    """Each watched unit's left-overs, once per holder (leftovers.py: the metrics count these)."""
    findings = []
    owned = {container: unit for container, (unit, _) in context.unit_containers.items()}
    found = left_overs(inventory, context.watched_view(), context.protected_names, owned)
    for left in found:
        holder = left.holder
        who = f"PID {holder.pid} ({escape(holder.comm)}) holding {_gpu_list(holder)}"
        if left.kind is Kind.PROVEN:
            message = (
                f"{who} is a left-over of {left.unit} ({left.reason}): the gate (where installed) "
                f"and the daemon reap it, or `gpuguard reap --unit {left.unit}` now"
            )
        else:
            message = (
                f"{who} looks like a left-over of {left.unit} but runs outside it "
                f"({holder.owner}); no evidence ties it to an ended run, so gpuguard keeps it: "
                f"check it, then `gpuguard reap --unit {left.unit} --scope patterns`"
            )
        findings.append(Finding(Level.WARNING, message))
    return findings


def _container_findings(
    inventory: Inventory, unit_containers: Mapping[str, tuple[str, ContainerVerdict]]
) -> list[Finding]:
    """A unit's own container left over from an earlier run, holding GPUs: one warning each."""
    findings = []
    for container, (unit, verdict) in unit_containers.items():
        holders = [h for h in inventory.holders if h.attribution.container == container]
        if verdict.stop and holders:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{escape(unit)}'s container {escape(verdict.name or '')} "
                    f"({verdict.engine} {verdict.short_id}) is left over from an earlier run ("
                    + "; ".join(f"PID {h.pid} holding {_gpu_list(h)}" for h in holders)
                    + f"): `gpuguard reap --unit {escape(unit)}` or the unit's gate stops it",
                )
            )
    return findings


def _stuck_claims(context: StatusContext) -> Callable[[Holder], XidClaim | None]:
    """The test for "stuck in the driver after an Xid".

    Named by an application Xid (and started before it), alive in R or D, and a reaper's
    SIGKILL (the gate's or the daemon's) left it alive.
    """
    daemon = _dict(context.daemon.snapshot) if context.daemon else {}
    xid_claims = claims_from_snapshot(_dict(daemon.get("xid")).get("recent"))
    records = [r for unit in context.units for r in _list_of_dicts(list(unit.gate_decisions))]
    records += [
        r
        for watch in _dict(daemon.get("units")).values()
        for r in _list_of_dicts(_dict(watch).get("recoveries"))
    ]
    unkillable = {
        reaped.get("pid")
        for record in records
        for reaped in _list_of_dicts(record.get("reaped"))
        if reaped.get("outcome") == "unkillable"
    }

    def stuck(holder: Holder) -> XidClaim | None:
        if holder.pid not in unkillable or holder.state not in STUCK_STATES:
            return None
        started_s = holder.identity.start_time / max(context.clock_ticks, 1)
        return named_by(holder.pid, started_s, xid_claims)

    return stuck


def _list_of_dicts(value: object) -> list[dict[str, Any]]:
    return [item for item in _list(value) if isinstance(item, dict)]


# Module and symbol names of the NVIDIA kernel driver (nvidia, nvidia_uvm, nvidia_modeset).
_DRIVER_MARKS = ("nvidia", "uvm")


def _sleep_finding(who: str, kernel_wait: Sequence[str]) -> Finding:
    """State D is "stuck in the driver" only when the kernel says so.

    A vfork() parent waiting for its child, or a process in disk or network I/O, is in state D
    too and wakes on its own; calling that a driver hang would send an operator to reset a GPU.
    """
    driver = next((f for f in kernel_wait if any(m in f.lower() for m in _DRIVER_MARKS)), None)
    if driver is not None:
        return Finding(
            Level.CRITICAL,
            f"{who} is stuck in the NVIDIA driver (state D, in {escape(driver)}): "
            "it cannot be killed; a GPU reset or reboot may be needed",
        )
    if kernel_wait:
        return Finding(
            Level.OK,
            f"{who} is in uninterruptible sleep (state D, in {escape(kernel_wait[0])}, "
            "not the NVIDIA driver): signals take effect when it wakes",
        )
    return Finding(
        Level.WARNING,
        f"{who} is in uninterruptible sleep (state D); where it waits is visible only to root "
        "(run as root to tell a driver hang from I/O)",
    )


def _gpu_list(holder: Holder) -> str:
    if holder.gpus:
        return "GPU " + ",".join(str(u.gpu_index) for u in holder.gpus)
    return "NVIDIA device files"


def _mib(value: int) -> str:
    return f"{value // MIB} MiB"


def render_text(report: StatusReport) -> str:
    """The one-screen view: headline, NVML health, each GPU with its holders, then findings."""
    inventory = report.inventory
    nvml = inventory.nvml
    lines = [f"gpuguard status: {report.level.name} - {report.headline}"]
    if nvml.health is NvmlHealth.OK:
        api = {g.reading.memory.api.value for g in inventory.gpus if g.reading.memory}
        lines.append(
            f"NVML: ok, driver {nvml.driver_version or 'unknown'}, {len(inventory.gpus)} GPUs"
            + (f", memory API {'/'.join(sorted(api))}" if api else "")
        )
    elif nvml.reason and nvml.reason in report.headline:
        lines.append(f"NVML: {nvml.health.value} (above)")  # said once is enough
    else:
        lines.append(f"NVML: {nvml.reason or nvml.health.value}")
    lines.append(f"Runs: {inventory.containment.summary}")
    shown: set[int] = set()
    xids = xid_events(inventory, report.daemon, report.since)
    for gpu in inventory.gpus:
        lines.extend(_gpu_lines(gpu, report))
        lines.extend(
            f"    {_xid_phrase(event)}"
            for event in [e for e in xids if e["gpu"] == gpu.reading.index][-3:]
        )
        shown.update(gpu.holder_pids)
    others = [h for h in inventory.holders if h.pid not in shown]
    if others:
        lines.append("Other holders of NVIDIA device files:")
        lines.extend(_holder_line(h, None, report) for h in others)
    lines.extend(
        f"Unattributed: GPU {gpu.reading.index}: {_mib(gpu.unattributed_bytes)}"
        for gpu in inventory.gpus
        if gpu.unattributed_bytes
    )
    lines.extend(
        f"In this container: GPU {gpu.reading.index}: {_mib(gpu.container_bytes)} "
        f"({_CONTAINER_NOTE})"
        for gpu in inventory.gpus
        if gpu.container_bytes
    )
    lines.extend(
        f"From outside: GPU {gpu.reading.index}: {_mib(gpu.outside_bytes)} {_OUTSIDE_NOTE}"
        for gpu in inventory.gpus
        if gpu.outside_bytes
    )
    if inventory.containment.foreign_pids:
        lines.extend(
            f"Host PIDs: GPU {index}: NVML lists " + ", ".join(str(g.pid) for g in gone)
            for index, gone in _by_gpu(inventory.vanished).items()
        )
    else:
        lines.extend(
            f"Vanished: PID {gone.pid} listed by NVML on GPU {gone.gpu_index} is not in /proc"
            for gone in inventory.vanished
        )
    lines.extend(
        f"Foreign: PID {other.pid} listed by NVML on GPU {other.gpu_index} is not this "
        f"namespace's PID {other.pid}, which holds no device file of GPU {other.gpu_index}"
        for other in inventory.foreign
    )
    lines.extend(
        f"Not inspectable: PID {hidden.pid} listed by NVML on GPU {hidden.gpu_index} exists; "
        "/proc shows its details only to root"
        for hidden in inventory.uninspectable
    )
    lines.extend(_daemon_lines(report.daemon))
    if report.since is not None:
        lines.append(f"History since {report.since.isoformat(timespec='seconds')}")
    for unit in report.units:
        lines.append(f"Unit {unit.name}: {unit.state}; {unit.gpu_set}")
        lines.extend(f"    {line}" for line in _watch_lines(report.daemon, unit.name, report.since))
        lines.extend(f"    gate {_gate_line(entry)}" for entry in unit.gate_decisions)
    scan = inventory.scan
    lines.append(
        f"/proc: {scan.method} scan, {len(inventory.holders)} holders"
        + (f", {scan.unreadable} processes not readable" if scan.unreadable else "")
        + (f", {len(inventory.partial)} not fully inspected" if inventory.partial else "")
        + (f", {scan.not_visited} not visited" if scan.not_visited else "")
    )
    lines.extend(f"{f.level.name}: {f.message}" for f in report.findings)
    # Every line is escaped once more as a whole: whatever foreign text reached it (a process
    # or cgroup name, a unit's environment, systemctl's error), it stays on its own line.
    return "\n".join(escape(line) for line in lines) + "\n"


def _daemon_lines(daemon: DaemonView | None) -> list[str]:
    if daemon is None or daemon.state == "absent":
        # A pip user has no gpuguard.service to start: name both ways the daemon runs.
        return [
            "Daemon: not running (no snapshot; the package's gpuguard.service, or `gpuguard run`)"
        ]
    snapshot = daemon.snapshot
    journal = _dict(snapshot.get("journal"))
    dry = ", DRY RUN" if snapshot.get("dry_run") else ""
    reason = f": {escape(str(journal['reason']))}" if journal.get("reason") else ""
    return [
        (
            f"Daemon: {daemon.state} (PID {snapshot.get('pid')}, since "
            f"{snapshot.get('started_at')}, snapshot {snapshot.get('updated_at')}{dry}); "
            f"journal {journal.get('state')}{reason}"
        )
    ]


def _watch_lines(daemon: DaemonView | None, unit: str, since: datetime | None) -> list[str]:
    """What the daemon says about one unit: verdict, evidence, recent recoveries and sweeps."""
    watch = _dict(_dict(daemon.snapshot.get("units")).get(unit)) if daemon else {}
    if not watch:
        return []
    lines = [
        (
            f"daemon: {escape(str(watch.get('verdict')))} "
            f"(starts in window {watch.get('starts_in_window')}, "
            f"restart counter {watch.get('n_restarts')}, action {watch.get('action')})"
        )
    ]
    liveness = _dict(watch.get("liveness"))
    if liveness.get("summary") and liveness.get("state") != "unknown":
        lines.append(f"engine: {escape(str(liveness['summary']))}")
    if watch.get("looping"):
        detail = escape(str(watch.get("cause_detail")))
        lines.append(f"  cause {watch.get('cause')}: {detail}")
        lines.extend(f"  {escape(str(line))}" for line in _list(watch.get("evidence"))[-5:])
    lines.extend(
        f"recovery {record.get('started_at')}: {record.get('result')}"
        f", reaped {len(_list(record.get('reaped')))}"
        + (f": {escape(str(record['problem']))}" if record.get("problem") else "")
        for record in _recent(watch.get("recoveries"), "started_at", since)
    )
    lines.extend(
        f"survivors {escape(str(record.get('at')))}: {escape(str(record.get('summary')))}"
        for record in _recent(watch.get("survivors"), "at", since)
        if record.get("summary")
    )
    if watch.get("needs_operator"):
        lines.append("NEEDS OPERATOR: recoveries stopped; see docs/runbook.md")
    return lines


def _recent(records: object, key: str, since: datetime | None) -> list[dict[str, Any]]:
    """The last three records of a snapshot list whose ``key`` time is in the window."""
    return [r for r in map(_dict, _list(records)) if within(since, r.get(key))][-3:]


def _dict(value: object) -> dict[str, Any]:
    """A snapshot field that should be an object (snapshots are read back from disk)."""
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    """A snapshot field that should be a list."""
    return value if isinstance(value, list) else []


def _gate_line(entry: Mapping[str, Any]) -> str:
    """One recorded gate decision: when, result, how long, reaped and spared."""
    reaped = entry.get("reaped") or []
    spared = entry.get("spared") or []
    line = (
        f"{entry.get('time', '?')} {entry.get('result', '?')} after {entry.get('waited_s', '?')} s"
        f", reaped {len(reaped)}, spared {len(spared)}"
    )
    blockers = entry.get("blockers") or []
    return line + (f": {escape(str(blockers[0]))}" if blockers else "")


def _gpu_lines(gpu: GpuOccupancy, report: StatusReport) -> list[str]:
    inventory, idle = report.inventory, report.idle_gpus
    reading = gpu.reading
    name = reading.name or "unknown GPU"
    if reading.memory is not None:
        usage = f"{_mib(reading.memory.used_bytes)} / {_mib(reading.memory.total_bytes)}"
    else:
        usage = "memory unknown"
    tag = " idle" if reading.index in idle else ""
    if reset_reasons(reading):
        tag = " NEEDS REBOOT" if needs_reboot(reading) else " NEEDS RESET"
    if mig_on(reading):
        tag = " MIG (not judged)"
    if reading.lost:
        tag = " LOST"
    if reading.memory is not None and reading.memory.reserved_source is not None:
        usage += (
            f" (estimated: {_mib(reading.memory.reserved_bytes or 0)} reserved, "
            f"{reading.memory.reserved_source.value})"
        )
    lines = [f"GPU {reading.index}  {name}  {usage}{tag}"]
    notes = (*reset_reasons(reading), *health_warnings(reading))
    if notes:
        lines.append("    health: " + "; ".join(notes))
    for pid in gpu.holder_pids:
        holder = inventory.holder(pid)
        if holder is not None:
            lines.append(_holder_line(holder, reading.index, report))
    return lines


def _holder_line(holder: Holder, gpu_index: int | None, report: StatusReport) -> str:
    use = next((u for u in holder.gpus if u.gpu_index == gpu_index), None)
    if use is not None and use.used_bytes is not None:
        size = _mib(use.used_bytes)
    elif use is not None and use.listed_by_nvml:
        size = "size n/a"
    else:
        size = "fd only"
    owner = _owner(holder, report.unit_containers)
    hidden = "" if holder.files_readable else "  (open files not inspectable without root)"
    # At most 100 characters of command line: one holder stays on one line of a wide terminal;
    # --json has the whole command line.
    command = holder.command_within(_COMMAND_WIDTH)
    return f"    pid {holder.pid:<7} {holder.state}  {owner:<24} {size:>11}  {command}{hidden}"


def _owner(holder: Holder, unit_containers: Mapping[str, tuple[str, ContainerVerdict]]) -> str:
    """Who holds: the unit for a container the engine confirms is its own, else as attributed.

    ``sglang.service (container sglang-srv, docker 1a2b3c4d5e6f)``; the name is escaped.
    """
    found = unit_containers.get(holder.attribution.container or "")
    if found is None:
        return holder.owner
    unit, verdict = found
    return escape(verdict.owner(unit))


def _unit_container_json(
    holder: Holder, unit_containers: Mapping[str, tuple[str, ContainerVerdict]]
) -> dict[str, Any] | None:
    found = unit_containers.get(holder.attribution.container or "")
    if found is None:
        return None
    unit, verdict = found
    return {
        "unit": unit,
        "name": verdict.name,
        "engine": verdict.engine.value,
        "id": verdict.full_id,
        "left_over": verdict.stop,
    }


def to_json(report: StatusReport) -> dict[str, Any]:
    """The same report as a versioned document (see docs/status-json.md)."""
    inventory = report.inventory
    nvml = inventory.nvml
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": report.generated_at.isoformat(),
        "status": report.level.name,
        "exit_code": int(report.level),
        "headline": report.headline,
        "nvml": {
            "health": nvml.health.value,
            "reason": nvml.reason,
            "driver_version": nvml.driver_version,
        },
        "gpus": [_gpu_json(gpu, report.idle_gpus) for gpu in inventory.gpus],
        "holders": [_holder_json(h, report) for h in inventory.holders],
        "vanished": [
            {"pid": v.pid, "gpu": v.gpu_index, "used_mib": _opt_mib(v.used_bytes)}
            for v in inventory.vanished
        ],
        "uninspectable": [
            {"pid": u.pid, "gpu": u.gpu_index, "used_mib": _opt_mib(u.used_bytes)}
            for u in inventory.uninspectable
        ],
        "foreign": [
            {"pid": f.pid, "gpu": f.gpu_index, "used_mib": _opt_mib(f.used_bytes)}
            for f in inventory.foreign
        ],
        "containment": {
            "container": inventory.containment.container,
            "foreign_pids": inventory.containment.foreign_pids,
            "evidence": list(inventory.containment.evidence),
        },
        "units": [
            {
                "name": unit.name,
                "state": unit.state,
                "found": not unit.not_found,
                "gpu_set": unit.gpu_set,
                "gate_decisions": list(unit.gate_decisions),
            }
            for unit in report.units
        ],
        "since": None if report.since is None else report.since.isoformat(timespec="seconds"),
        "xid_events": xid_events(inventory, report.daemon, report.since),
        "daemon": None
        if report.daemon is None
        else {"state": report.daemon.state, "snapshot": dict(report.daemon.snapshot)},
        "scan": {
            "method": inventory.scan.method,
            "unreadable": inventory.scan.unreadable,
            "not_visited": inventory.scan.not_visited,
            "partial": [
                {
                    "pid": other.pid,
                    "user": other.user,
                    "comm": other.comm,
                    "reason": other.reason,
                    "gpus": list(other.gpus),
                }
                for other in inventory.partial
            ],
        },
        "findings": [{"level": f.level.name, "message": f.message} for f in report.findings],
    }


def _gpu_json(gpu: GpuOccupancy, idle: frozenset[int]) -> dict[str, Any]:
    reading = gpu.reading
    memory = reading.memory
    return {
        "index": reading.index,
        "name": reading.name,
        "uuid": reading.uuid,
        "pci_bus_id": reading.pci_bus_id,
        "minor": reading.minor,
        "memory": None
        if memory is None
        else {
            "api": memory.api.value,
            "total_mib": memory.total_bytes // MIB,
            "used_mib": memory.used_bytes // MIB,
            "reserved_mib": _opt_mib(memory.reserved_bytes),
            "reserved_source": None
            if memory.reserved_source is None
            else memory.reserved_source.value,
        },
        "idle": reading.index in idle,
        "lost": reading.lost,
        "problem": reading.problem,
        "health": _health_json(reading),
        "mig": None
        if reading.mig is None
        else {"current": reading.mig.current, "pending": reading.mig.pending},
        "holder_pids": list(gpu.holder_pids),
        "unattributed_mib": _opt_mib(gpu.unattributed_bytes),
        "container_mib": _opt_mib(gpu.container_bytes),
        "outside_mib": _opt_mib(gpu.outside_bytes),
    }


def _health_json(reading: GpuReading) -> dict[str, Any]:
    """Each fact as NVML gave it (null: unknown), and the verdict drawn from them."""
    health: GpuHealth = reading.health
    reasons = reset_reasons(reading)
    return {
        "needs_reset": bool(reasons),
        "needs_reboot": bool(reasons) and needs_reboot(reading),
        "reset_reasons": list(reasons),
        "warnings": list(health_warnings(reading)),
        "reset_required": health.reset_required,
        "retired_pages_pending": health.retired_pages_pending,
        "remapped_rows_pending": health.remapped_rows_pending,
        "remapped_rows_failed": health.remapped_rows_failed,
        "volatile_uncorrectable_ecc": health.volatile_uncorrectable_ecc,
        "recovery_action": None if health.recovery_action is None else health.recovery_action.value,
    }


def _holder_json(holder: Holder, report: StatusReport) -> dict[str, Any]:
    attribution = holder.attribution
    started_at = None
    if report.boot_time is not None:
        started = report.boot_time + holder.identity.start_time / report.clock_ticks
        started_at = datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")
    return {
        "pid": holder.pid,
        "start_time": holder.identity.start_time,
        "started_at": started_at,
        "ppid": holder.ppid,
        "state": holder.state,
        "user": holder.user,
        "comm": holder.comm,
        "cmdline": list(holder.cmdline),
        "unit": attribution.unit,
        "user_unit": attribution.user_unit,
        "container": attribution.container,
        "unit_container": _unit_container_json(holder, report.unit_containers),
        "invocation_id": holder.invocation_id,
        "device_files": sorted(holder.device_files),
        "files_readable": holder.files_readable,
        "gpus": [
            {
                "index": use.gpu_index,
                "used_mib": _opt_mib(use.used_bytes),
                "listed_by_nvml": use.listed_by_nvml,
                "holds_device_file": use.holds_device_file,
            }
            for use in holder.gpus
        ],
    }


def _opt_mib(value: int | None) -> int | None:
    return None if value is None else value // MIB
