"""Findings about the processes holding GPUs: stuck, left over, shared, not fully seen (pure).

A holder stuck in the driver after an Xid, one in state D (a driver hang only when the kernel
says so), a zombie, each watched unit's left-overs and left-over containers, two units sharing
GPUs, and the processes the /proc walk could not finish inspecting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuguard.core.driverwait import in_driver
from gpuguard.core.escaping import escape
from gpuguard.core.leftovers import Kind, WatchedUnit, left_overs
from gpuguard.core.levels import Level
from gpuguard.core.status.report import Finding, StatusContext
from gpuguard.core.status.words import as_list, gpu_list
from gpuguard.core.xid.stuck import STUCK_STATES, claims_from_snapshot, named_by, stuck_phrase

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from gpuguard.core.inventory import Holder, Inventory
    from gpuguard.core.unitcontainers import ContainerVerdict
    from gpuguard.core.xid.stuck import XidClaim


def holder_findings(inventory: Inventory, context: StatusContext) -> list[Finding]:
    """Holders stuck after an Xid, in state D or zombies, and each watched unit's left-overs."""
    findings: list[Finding] = []
    stuck = _stuck_claims(context)
    for holder in inventory.holders:
        who = f"PID {holder.pid} ({escape(holder.comm)}) holding {gpu_list(holder)}"
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


def shared_gpu_findings(units: Sequence[WatchedUnit]) -> list[Finding]:
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
        who = f"PID {holder.pid} ({escape(holder.comm)}) holding {gpu_list(holder)}"
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


def container_findings(
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
                    + "; ".join(f"PID {h.pid} holding {gpu_list(h)}" for h in holders)
                    + f"): `gpuguard reap --unit {escape(unit)}` or the unit's gate stops it",
                )
            )
    return findings


def _stuck_claims(context: StatusContext) -> Callable[[Holder], XidClaim | None]:
    """The test for "stuck in the driver after an Xid".

    Named by an application Xid (and started before it), alive in R or D, and a reaper's
    SIGKILL (the gate's or the daemon's) left it alive.
    """
    snapshot = context.daemon.snapshot if context.daemon else None
    xid_claims = claims_from_snapshot(snapshot.xids) if snapshot else []
    records = [r for unit in context.units for r in _list_of_dicts(list(unit.gate_decisions))]
    records += [
        r for watch in (snapshot.units if snapshot else {}).values() for r in watch.recoveries
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
    return [item for item in as_list(value) if isinstance(item, dict)]


def _sleep_finding(who: str, kernel_wait: Sequence[str]) -> Finding:
    """State D is "stuck in the driver" only when the kernel says so.

    A vfork() parent waiting for its child, or a process in disk or network I/O, is in state D
    too and wakes on its own; calling that a driver hang would send an operator to reset a GPU.
    """
    driver = in_driver(kernel_wait)
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


_PARTIAL_NAMED = 10


def partial_findings(inventory: Inventory) -> list[Finding]:
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
