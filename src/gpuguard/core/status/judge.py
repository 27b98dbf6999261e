"""The judgement: every finding about an inventory, and the level the worst one sets (pure).

``assess`` gathers the findings of each part (the gate's refusals, the daemon's loops and Xids
here; GPUs in ``gpufindings``; holders, left-overs and containers in ``holderfindings``) and
picks the headline. A refusal or a loop whose GPUs gpuguard cannot free names what holds them
and the operator's command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from gpuguard.core.breaker import open_phrase
from gpuguard.core.escaping import escape
from gpuguard.core.gate.refusal import last_refusal
from gpuguard.core.idle import is_idle_seen
from gpuguard.core.leftovers import WatchedUnit, blockers
from gpuguard.core.levels import Level, worst
from gpuguard.core.prevented import in_words
from gpuguard.core.since import within
from gpuguard.core.snapshot import SNAPSHOT_FILE
from gpuguard.core.status.gpufindings import gpu_findings, nvml_findings
from gpuguard.core.status.holderfindings import (
    container_findings,
    holder_findings,
    partial_findings,
    shared_gpu_findings,
)
from gpuguard.core.status.report import Finding, StatusContext, StatusReport
from gpuguard.core.status.words import said, xid_events, xid_phrase
from gpuguard.core.values import nvml_usable
from gpuguard.core.xid.catalogue import XidClass

if TYPE_CHECKING:
    from collections.abc import Mapping
    from datetime import datetime

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.snapshot import DaemonView


def assess(inventory: Inventory, context: StatusContext, now: datetime) -> StatusReport:
    """Turn evidence into findings; the worst finding sets the level."""
    findings = [
        *_breaker_findings(context),
        *_gate_findings(inventory, context),
        *_daemon_findings(inventory, context),
        *nvml_findings(inventory),
        *gpu_findings(inventory),
        *_xid_findings(inventory, context.daemon, context.since),
        *_hung_findings(context.daemon, context.since),
        *holder_findings(inventory, context),
        *shared_gpu_findings(context.watched),
        *container_findings(inventory, context.unit_containers),
        *partial_findings(inventory),
        *_prevented_findings(context),
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
    level = worst(f.level for f in findings)
    if level is Level.OK:
        headline = _ok_headline(inventory, idle)
    else:
        headline = _headline(next(f for f in findings if f.level is level))
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


HEADLINE_LIMIT: Final = 180
"""Characters of the headline after ``gpuguard status: LEVEL - ``: one line of a wide screen."""


def _headline(finding: Finding) -> str:
    """The worst finding in one screen line: its summary, else its message, cut with a pointer."""
    said = finding.summary or finding.message
    if len(said) <= HEADLINE_LIMIT:
        return said
    return said[: HEADLINE_LIMIT - len(_MORE)].rstrip() + _MORE


_MORE: Final = " … (details below)"


def _ok_headline(inventory: Inventory, idle: frozenset[int]) -> str:
    total = len(inventory.gpus)
    if total and len(idle) == total:
        return f"all {total} GPUs idle"
    busy = total - len(idle)
    return f"{busy} of {total} GPUs in use by live processes"


def _prevented_findings(context: StatusContext) -> list[Finding]:
    """What gpuguard saved per unit, by core.prevented's conservative rule (OK: good news)."""
    found = []
    for unit in context.units:
        said = in_words(unit.prevented) if unit.prevented is not None else None
        if said is not None:
            found.append(Finding(Level.OK, f"{escape(unit.name)}: {said}"))
    return found


def _breaker_findings(context: StatusContext) -> list[Finding]:
    """The host-wide breaker open: the daemon only reports until a person closes it."""
    breaker = context.breaker
    if breaker is None or not breaker.is_open:
        return []
    said = open_phrase(breaker, context.breaker_limits)
    return [
        Finding(
            Level.CRITICAL,
            f"{said}: gpuguard's daemon only reports ({breaker.refused} refused since); after "
            "checking the host, a person closes it: gpuguard breaker --close",
            summary=said,
        )
    ]


def _gate_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    """A watched unit systemd does not know; a unit whose last start the gate refused.

    A refusal stays the headline only while its cause lasts: once the unit's GPUs are idle it
    is history (OK), said so rather than hidden.
    """
    units = context.units
    fix = (
        "the default with no configuration file: name yours in /etc/gpuguard/gpuguard.toml "
        "(or --config FILE)"
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
        if last_refusal(unit.gate_decisions) is None:
            continue
        when = said(unit.gate_decisions[-1].get("time"), "an unknown time")
        refused = f"the gate refused the last start of {unit.name} at {when}"
        seen = watched.get(unit.name)
        if seen is not None and _set_idle(inventory, seen, context.idle_threshold_bytes):
            findings.append(
                Finding(Level.OK, f"{refused}; its cause is gone: its GPUs are idle now")
            )
            continue
        # What holds the GPUs now, each once; what the gate named then is the unit's gate line.
        findings.append(_refusal_now(inventory, seen, context, refused))
    return findings


def _refusal_now(
    inventory: Inventory, unit: WatchedUnit | None, context: StatusContext, refused: str
) -> Finding:
    """A refusal whose GPUs are still not idle: today's blockers and the way out, once each."""
    if not nvml_usable(inventory.nvml):
        why = f"; its GPUs cannot be read: {escape(inventory.nvml.reason or 'NVML unusable')}"
        return Finding(Level.CRITICAL, refused + why)
    if unit is None:
        return Finding(Level.CRITICAL, refused + "; not a watched unit: its GPUs are not judged")
    way_out = _way_out(inventory, unit, context)
    if not way_out:
        # Nothing kept that gpuguard will not free: the next start's gate frees it.
        tail = "; its GPUs are still not idle, held by what its gate frees at the next start"
        return Finding(Level.CRITICAL, refused + tail)
    short = f"{unit.name}: the gate refused its last start"  # when: in the line below
    return Finding(Level.CRITICAL, refused + way_out, short + _held(inventory, unit, context))


def _held(inventory: Inventory, unit: WatchedUnit, context: StatusContext) -> str:
    """``_way_out`` in a headline's few words: who holds the GPUs (PIDs, once each), the command."""
    found = blockers(inventory, unit, context.watched_view(), context.protected_names)
    if found.live_elsewhere:
        return f"; its GPUs are held by the running {', '.join(found.live_elsewhere)}"
    pids = [f"PID {holder.pid}" for holder, _ in found.holders]
    shown = ", ".join(pids[:_HEADLINE_PIDS]) + (
        f" and {len(pids) - _HEADLINE_PIDS} more" if len(pids) > _HEADLINE_PIDS else ""
    )
    command = f"; after checking them: `{found.command}`" if found.command else ""
    return f"; its GPUs are held by {shown}{command}"


_HEADLINE_PIDS: Final = 3


def _set_idle(inventory: Inventory, unit: WatchedUnit, threshold_bytes: int) -> bool:
    """Whether NVML answers and every GPU of the unit's set is present and idle."""
    if not nvml_usable(inventory.nvml):
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
                    f"restart can replace ({said(unit.cause_detail, 'no detail recorded')})",
                )
            )
        elif unit.needs_operator:
            # Said as it was decided: after recoveries that did not help, or before any, when
            # the daemon would not stop a unit whose GPUs it cannot free (never worse).
            why = (
                "recoveries did not break its restart loop"
                if unit.recoveries
                else "gpuguard leaves its restart loop alone: stopping it frees nothing"
            )
            needs = f"{name} needs an operator"
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{needs}: {why} ({escape(unit.verdict)}){way_out}",
                    needs + _held(inventory, seen, context) if way_out and seen else None,
                )
            )
        elif unit.looping and way_out and seen is not None:
            loop = f"{name} is in a restart loop caused by its GPUs that gpuguard cannot end"
            findings.append(
                Finding(
                    Level.CRITICAL,
                    f"{loop}: {escape(unit.verdict)}{way_out}",
                    loop + _held(inventory, seen, context),
                )
            )
        elif unit.looping and unit.cause == "does-not-fit":
            # No reap or restart ends it: the server does not fit as configured; say the knob.
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{name} is in a restart loop that no reap can end: "
                    f"{said(unit.cause_detail, 'no detail recorded')}",
                )
            )
        elif unit.looping:
            findings.append(
                Finding(
                    Level.WARNING,
                    f"{name} is in a restart loop: {escape(unit.verdict)}; "
                    f"cause {said(unit.cause)}; daemon action {said(unit.action, 'none yet')}",
                )
            )
        findings.extend(_liveness_findings(name, unit.liveness or {}))
    return findings


def _liveness_findings(name: str, liveness: Mapping[str, Any]) -> list[Finding]:
    """An engine dead while its unit lives (CRITICAL), a start stuck in a phase (WARNING)."""
    level = {"critical": Level.CRITICAL, "warning": Level.WARNING}.get(str(liveness.get("level")))
    if level is None:
        return []
    return [Finding(level, f"{name}: {said(liveness.get('summary'), 'no summary recorded')}")]


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


def _hung_findings(daemon: DaemonView | None, since: datetime | None) -> list[Finding]:
    """The driver said a GPU hangs (core.xid.hung): the newest line of each source and GPU.

    A GPU health finding, not a holder's: no kill helps a GPU that makes no progress.
    """
    snapshot = daemon.snapshot if daemon is not None else None
    if snapshot is None:
        return []
    newest: dict[tuple[object, object], Mapping[str, Any]] = {}
    for hang in snapshot.gpu_hangs:
        if within(since, hang.get("time")):
            newest[(hang.get("said"), hang.get("gpu"))] = hang
    return [
        Finding(
            Level.WARNING,
            f"the kernel says a GPU hangs: {said(hang.get('said'))}"
            + (
                f" ({said(hang.get('gpu'))}, as nvidia-modeset numbers GPUs)"
                if hang.get("gpu")
                else ""
            )
            + f" at {said(hang.get('time'), 'an unknown time')}: {said(hang.get('text'))}; no kill "
            "helps a hung GPU: a reset or reboot may be needed (docs/xid.md)",
        )
        for hang in newest.values()
    ]


def _unaddressed(inventory: Inventory) -> str:
    """GPUs NVML cannot give an address for (lost, unreadable): an unmatched Xid may be theirs.

    Said, not guessed: the address of a lost GPU is exactly what NVML can no longer tell.
    """
    without = [str(g.reading.index) for g in inventory.gpus if not g.reading.pci_bus_id]
    if not without:
        return ""
    return f" (NVML cannot tell the address of GPU {', '.join(without)}: it may be that one)"
