"""The judgement: every finding about an inventory, and the level the worst one sets (pure).

``assess`` gathers the findings of each part (the gate's refusals, the daemon's loops and Xids
here; GPUs in ``gpufindings``; holders, left-overs and containers in ``holderfindings``) and
picks the headline. A refusal or a loop whose GPUs gpuguard cannot free names what holds them
and the operator's command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuguard.core.escaping import escape
from gpuguard.core.idle import is_idle_seen
from gpuguard.core.leftovers import WatchedUnit, blockers
from gpuguard.core.levels import Level
from gpuguard.core.snapshot import SNAPSHOT_FILE
from gpuguard.core.status.gpufindings import gpu_findings, nvml_findings
from gpuguard.core.status.holderfindings import (
    container_findings,
    holder_findings,
    partial_findings,
    shared_gpu_findings,
)
from gpuguard.core.status.report import Finding, StatusContext, StatusReport
from gpuguard.core.status.words import as_list, xid_events, xid_phrase
from gpuguard.core.values import NvmlHealth
from gpuguard.core.xid.catalogue import XidClass

if TYPE_CHECKING:
    from collections.abc import Mapping
    from datetime import datetime

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.snapshot import DaemonView


def assess(inventory: Inventory, context: StatusContext, now: datetime) -> StatusReport:
    """Turn evidence into findings; the worst finding sets the level."""
    findings = [
        *_gate_findings(inventory, context),
        *_daemon_findings(inventory, context),
        *nvml_findings(inventory),
        *gpu_findings(inventory),
        *_xid_findings(inventory, context.daemon, context.since),
        *holder_findings(inventory, context),
        *shared_gpu_findings(context.watched),
        *container_findings(inventory, context.unit_containers),
        *partial_findings(inventory),
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


def _ok_headline(inventory: Inventory, idle: frozenset[int]) -> str:
    total = len(inventory.gpus)
    if total and len(idle) == total:
        return f"all {total} GPUs idle"
    busy = total - len(idle)
    return f"{busy} of {total} GPUs in use by live processes"


def _gate_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    """A watched unit systemd does not know; a unit whose last start the gate refused.

    A refusal stays the headline only while its cause lasts: once the unit's GPUs are idle it
    is history (OK), said so rather than hidden.
    """
    units = context.units
    fix = (
        "it is the default, watched while no configuration file names the units: name yours in "
        "/etc/gpuguard/gpuguard.toml (or --config FILE)"
        if context.no_config_file
        else "check the name in the configuration"
    )
    findings = [
        Finding(
            Level.WARNING,
            f"watched unit {unit.name} does not exist (LoadState=not-found): {fix}",
        )
        for unit in units
        if unit.not_found
    ]
    watched = {w.name: w for w in context.watched_view()}
    for unit in units:
        last = unit.gate_decisions[-1] if unit.gate_decisions else None
        if last is None or last.get("result") != "refused":
            continue
        listed = as_list(last.get("blockers"))
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
    """Loops the daemon found, units it gave up on, a daemon that died or cannot be read.

    A loop with a GPU cause whose holders gpuguard cannot reap is CRITICAL: nothing will end it
    but an operator, so the finding names the blockers and the command.
    """
    daemon = context.daemon
    if daemon is not None and daemon.unreadable is not None:
        return [
            Finding(
                Level.WARNING,
                f"the gpuguard daemon's snapshot (runtime_dir/{SNAPSHOT_FILE}) cannot be read: "
                f"{escape(daemon.unreadable.reason)}; status cannot show what the daemon found",
            )
        ]
    snapshot = daemon.snapshot if daemon is not None else None
    if daemon is None or snapshot is None:
        return []
    findings: list[Finding] = []
    if daemon.state == "dead":
        findings.append(
            Finding(
                Level.WARNING,
                f"the gpuguard daemon (PID {snapshot.pid}) is not running; its last "
                f"snapshot is from {snapshot.updated_at}",
            )
        )
    watched = {w.name: w for w in context.watched_view()}
    for name, unit in snapshot.units.items():
        seen = watched.get(name)
        gpu_cause = unit.cause == "stale-gpu-holders" and seen is not None
        way_out = _way_out(inventory, seen, context) if gpu_cause and seen else ""
        if unit.needs_operator and unit.cause == "gpu-needs-reset":
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{name} needs an operator: a GPU of its set needs a reset, which no kill or "
                    f"restart can replace ({escape(str(unit.cause_detail))})",
                )
            )
        elif unit.needs_operator:
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{name} needs an operator: recoveries did not break its restart loop "
                    f"({escape(unit.verdict)}){way_out}",
                )
            )
        elif unit.looping and way_out:
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{name} is in a restart loop caused by its GPUs that gpuguard cannot end: "
                    f"{escape(unit.verdict)}{way_out}",
                )
            )
        elif unit.looping and unit.cause == "does-not-fit":
            # No reap or restart ends it: the server does not fit as configured; say the knob.
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{name} is in a restart loop that no reap can end: "
                    f"{escape(str(unit.cause_detail))}",
                )
            )
        elif unit.looping:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{name} is in a restart loop: {escape(unit.verdict)}; "
                    f"cause {unit.cause}; daemon action {unit.action}",
                )
            )
        findings.extend(_liveness_findings(name, unit.liveness or {}))
    return findings


def _liveness_findings(name: str, liveness: Mapping[str, Any]) -> list[Finding]:
    """An engine dead while its unit lives (CRITICAL), a start stuck in a phase (WARNING)."""
    level = {"critical": Level.CRITICAL, "warning": Level.WARNING}.get(str(liveness.get("level")))
    if level is None:
        return []
    return [Finding(level, f"{name}: {escape(str(liveness.get('summary')))}")]


# Xid classes after which no kill helps (xid.catalogue); an application fault is the reaper's.
_SERIOUS_XIDS = frozenset({XidClass.RESET_GPU, XidClass.REBOOT, XidClass.OPERATOR})


def _xid_findings(
    inventory: Inventory, daemon: DaemonView | None, since: datetime | None
) -> list[Finding]:
    """Xids after which no kill helps, per GPU; Xids for an address NVML does not know."""
    findings: list[Finding] = []
    seen: set[tuple[object, object]] = set()
    for event in reversed(xid_events(inventory, daemon, since)):
        xid = event.xid
        key = (event.gpu if event.gpu is not None else xid.pci_bus_id, xid.code)
        if key in seen:
            continue
        seen.add(key)
        what = xid_phrase(xid)
        if event.gpu is None:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"kernel Xid for PCI {escape(xid.pci_bus_id)}, which NVML "
                    f"does not know{_unaddressed(inventory)}: {what}",
                )
            )
        elif xid.xid_class in _SERIOUS_XIDS:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"GPU {event.gpu} had {what}: no kill helps after it; a reset or reboot "
                    "may be needed (docs/xid.md)",
                )
            )
    snapshot = daemon.snapshot if daemon is not None else None
    if snapshot is not None and snapshot.xids_malformed > 0:
        findings.append(
            Finding(
                Level.OK,
                f"{snapshot.xids_malformed} kernel Xid line(s) could not be read (daemon log)",
            )
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
