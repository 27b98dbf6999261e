"""What the gate and reap commands share: who asks, the unit's settings and environment."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from gpuguard.config import Settings, UnitSettings
    from gpuguard.core.gateauth import Caller
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.values import ReapResult, UnitProvenance


def unit_settings(settings: Settings, unit: str) -> UnitSettings:
    """The unit's entry in the configuration, else the defaults."""
    from gpuguard.config import UnitSettings  # noqa: PLC0415 - see the package doc

    return settings.units.get(unit) or UnitSettings()


def untouchable(caller: Caller | None = None) -> frozenset[int]:
    """Our own PID and every ancestor's, and the caller's: the gate's client runs in the unit."""
    from gpuguard.adapters import procfs  # noqa: PLC0415 - see the package doc

    return procfs.lineage(os.getpid(), *(() if caller is None else (caller.pid,)))


def plan_request(  # noqa: PLR0913, PLR0917 - one plan request, assembled from what each command learned
    settings: Settings,
    unit: str,
    scope: str,
    gpu_set: GpuSet,
    live: str | None,
    provenance: UnitProvenance,
    *,
    caller: Caller | None = None,
) -> PlanRequest:
    """The kill policy's request for ``unit``, assembled from what the command learned."""
    from gpuguard.core.policy import PlanRequest, Scope  # noqa: PLC0415 - see the package doc

    return PlanRequest(
        unit=unit,
        scope=Scope(scope),
        patterns=unit_settings(settings, unit).patterns,
        gpu_set=gpu_set.indices,
        protected_names=settings.protected_processes,
        untouchable_pids=untouchable(caller),
        provenance=provenance,
        live_invocation=live,
    )


def asker(caller: Caller | None) -> Caller:
    """Who the command runs for: the gate server's caller, else this process itself."""
    from gpuguard.adapters import peer  # noqa: PLC0415 - see the package doc

    return caller if caller is not None else peer.own_caller()


def unit_environment(caller: Caller, unit: str, runtime_dir: Path) -> dict[str, str] | None:
    """The unit's real environment when the caller is one of its processes (else None).

    An ExecStartPre=/ExecStopPost= process has the unit's environment, EnvironmentFile= values
    included. Root records its GPU variables for the daemon's recoveries (unitenv).
    """
    if not caller.runs_in(unit) or caller.environment is None:
        return None
    if os.geteuid() == 0:
        from gpuguard.adapters import unitenv  # noqa: PLC0415 - see the package doc

        try:
            unitenv.record(runtime_dir, unit, caller.environment, caller.pid)
        except OSError as err:
            sys.stderr.write(f"gpuguard: cannot record {unit}'s GPU variables: {err}\n")
    return caller.environment


def result_json(result: ReapResult) -> dict[str, Any]:
    """One reap result as the gate record and ``reap --json`` write it."""
    return {
        "pid": result.target.identity.pid,
        "command": result.target.command,
        "reason": result.target.reason,
        "outcome": result.outcome.value,
        "signals": list(result.signals),
        "detail": result.detail,
    }
