"""``status --json``: the report as a versioned document (pure; docs/status.md describes it).

``SCHEMA_VERSION`` changes only when a field changes meaning or disappears; fields may be added.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from gpuguard.core.health import health_warnings, needs_reboot, reset_reasons
from gpuguard.core.status.words import xid_events
from gpuguard.core.values import MIB

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.core.inventory import GpuOccupancy, Holder
    from gpuguard.core.snapshot import DaemonView
    from gpuguard.core.status.report import StatusReport
    from gpuguard.core.unitcontainers import ContainerVerdict
    from gpuguard.core.values import GpuHealth, GpuReading


SCHEMA_VERSION = 3


def to_json(report: StatusReport) -> dict[str, Any]:
    """The same report as a versioned document (docs/status.md, JSON)."""
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
                "releases": [gpu.to_json() for gpu in unit.releases],
            }
            for unit in report.units
        ],
        "since": None if report.since is None else report.since.isoformat(timespec="seconds"),
        "xid_events": [
            {**_as_stored(event.xid.to_json()), "gpu": event.gpu}
            for event in xid_events(inventory, report.daemon, report.since)
        ],
        "daemon": None if report.daemon is None else _daemon_json(report.daemon),
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


def _opt_mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


def _daemon_json(daemon: DaemonView) -> dict[str, Any]:
    """The daemon's state and its snapshot; why the snapshot cannot be read, when it cannot."""
    snapshot = {} if daemon.snapshot is None else _as_stored(daemon.snapshot.to_json())
    document: dict[str, Any] = {"state": daemon.state, "snapshot": snapshot}
    if daemon.unreadable is not None:
        document["unreadable"] = {
            "problem": daemon.unreadable.problem.value,
            "reason": daemon.unreadable.reason,
        }
    return document


def _as_stored(value: Any) -> Any:  # noqa: ANN401 - any JSON value
    """A snapshot's JSON with its keys in the order daemon.json stores them (sorted)."""
    if isinstance(value, dict):
        return {key: _as_stored(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_as_stored(item) for item in value]
    return value
