"""The one screen ``gpuguard status`` prints: headline, GPUs and holders, daemon, units (pure).

Every line is escaped once more as a whole when joined, so foreign text that reached it (a
process or cgroup name, a unit's environment, systemctl's error) stays on its own line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuguard.core.escaping import escape
from gpuguard.core.health import health_warnings, needs_reboot, reset_reasons
from gpuguard.core.mig import mig_on
from gpuguard.core.since import within
from gpuguard.core.status.words import (
    CONTAINER_NOTE,
    OUTSIDE_NOTE,
    as_list,
    by_gpu,
    mib,
    said,
    xid_events,
    xid_phrase,
)
from gpuguard.core.values import NvmlHealth

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from datetime import datetime

    from gpuguard.core.inventory import GpuOccupancy, Holder
    from gpuguard.core.snapshot import DaemonView
    from gpuguard.core.status.report import StatusReport
    from gpuguard.core.unitcontainers import ContainerVerdict


_COMMAND_WIDTH = 100


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
            f"    {xid_phrase(event.xid)}"
            for event in [e for e in xids if e.gpu == gpu.reading.index][-3:]
        )
        shown.update(gpu.holder_pids)
    others = [h for h in inventory.holders if h.pid not in shown]
    if others:
        lines.append("Other holders of NVIDIA device files:")
        lines.extend(_holder_line(h, None, report) for h in others)
    lines.extend(
        f"Unattributed: GPU {gpu.reading.index}: {mib(gpu.unattributed_bytes)}"
        for gpu in inventory.gpus
        if gpu.unattributed_bytes
    )
    lines.extend(
        f"In this container: GPU {gpu.reading.index}: {mib(gpu.container_bytes)} ({CONTAINER_NOTE})"
        for gpu in inventory.gpus
        if gpu.container_bytes
    )
    lines.extend(
        f"From outside: GPU {gpu.reading.index}: {mib(gpu.outside_bytes)} {OUTSIDE_NOTE}"
        for gpu in inventory.gpus
        if gpu.outside_bytes
    )
    if inventory.containment.foreign_pids:
        lines.extend(
            f"Host PIDs: GPU {index}: NVML lists " + ", ".join(str(g.pid) for g in gone)
            for index, gone in by_gpu(inventory.vanished).items()
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
        lines.extend(f"    {gpu.in_words()}" for gpu in unit.releases)
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
    if daemon is not None and daemon.unreadable is not None:
        return [f"Daemon: unknown (its snapshot cannot be read: {daemon.unreadable.reason})"]
    snapshot = daemon.snapshot if daemon is not None else None
    if daemon is None or snapshot is None:
        # A pip user has no gpuguard.service to start: name both ways the daemon runs.
        return [
            "Daemon: not running (no snapshot; the package's gpuguard.service, or `gpuguard run`)"
        ]
    dry = ", DRY RUN" if snapshot.dry_run else ""
    reason = f": {escape(snapshot.journal_reason)}" if snapshot.journal_reason else ""
    return [
        (
            f"Daemon: {daemon.state} (PID {snapshot.pid}, since "
            f"{snapshot.started_at}, snapshot {snapshot.updated_at}{dry}); "
            f"journal {snapshot.journal_state}{reason}"
        )
    ]


def _watch_lines(daemon: DaemonView | None, unit: str, since: datetime | None) -> list[str]:
    """What the daemon says about one unit: verdict, evidence, recent recoveries and sweeps."""
    snapshot = daemon.snapshot if daemon is not None else None
    watch = snapshot.units.get(unit) if snapshot is not None else None
    if watch is None:
        return []
    counts = [f"starts in window {watch.starts_in_window}"]
    if watch.n_restarts is not None:  # systemd logged no restart in the window: nothing to say
        counts.append(f"restart counter {watch.n_restarts}")
    if watch.action is not None:  # no loop, nothing decided
        counts.append(f"action {said(watch.action)}")
    lines = [f"daemon: {escape(watch.verdict)} ({', '.join(counts)})"]
    liveness = watch.liveness or {}
    if liveness.get("summary") and liveness.get("state") != "unknown":
        lines.append(f"engine: {escape(str(liveness['summary']))}")
    if watch.looping:
        lines.append(f"  cause {said(watch.cause)}: {said(watch.cause_detail, 'no detail')}")
        lines.extend(f"  {escape(line)}" for line in watch.evidence[-5:])
    lines.extend(
        f"recovery {said(record.get('started_at'), 'at an unknown time')}: "
        f"{said(record.get('result'), 'no result recorded')}"
        f", reaped {len(as_list(record.get('reaped')))}"
        + (f": {escape(str(record['problem']))}" if record.get("problem") else "")
        for record in _recent(watch.recoveries, "started_at", since)
    )
    lines.extend(
        f"survivors {said(record.get('at'), 'at an unknown time')}: {said(record.get('summary'))}"
        for record in _recent(watch.survivors, "at", since)
        if record.get("summary")
    )
    if watch.needs_operator:
        lines.append("NEEDS OPERATOR: recoveries stopped; see docs/runbook.md")
    return lines


def _recent(
    records: Sequence[Mapping[str, Any]], key: str, since: datetime | None
) -> list[Mapping[str, Any]]:
    """The last three records of a snapshot list whose ``key`` time is in the window."""
    return [r for r in records if within(since, r.get(key))][-3:]


def _gate_line(entry: Mapping[str, Any]) -> str:
    """One recorded gate decision: when, result, how long, reaped and spared."""
    reaped = entry.get("reaped") or []
    spared = entry.get("spared") or []
    line = (
        f"{said(entry.get('time'), '?')} {said(entry.get('result'), '?')} after "
        f"{said(entry.get('waited_s'), '?')} s"
        f", reaped {len(reaped)}, spared {len(spared)}"
    )
    blockers = entry.get("blockers") or []
    return line + (f": {escape(str(blockers[0]))}" if blockers else "")


def _gpu_lines(gpu: GpuOccupancy, report: StatusReport) -> list[str]:
    inventory, idle = report.inventory, report.idle_gpus
    reading = gpu.reading
    name = reading.name or "unknown GPU"
    if reading.memory is not None:
        usage = f"{mib(reading.memory.used_bytes)} / {mib(reading.memory.total_bytes)}"
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
            f" (estimated: {mib(reading.memory.reserved_bytes or 0)} reserved, "
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
        size = mib(use.used_bytes)
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
