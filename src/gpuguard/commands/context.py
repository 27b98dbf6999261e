"""What the gate and reap commands share: who asks, the unit's settings, the policy's request."""

from __future__ import annotations

import difflib
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import dropin, ledgerstore, peer, procfs, systemd, unitenv
from gpuguard.commands.output import Said
from gpuguard.core.escaping import escape
from gpuguard.core.exits import EX_USAGE
from gpuguard.core.gpuset import resolve_gpu_set
from gpuguard.core.policy import PlanRequest, Scope

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from gpuguard.adapters.systemd import UnitState
    from gpuguard.config import Settings
    from gpuguard.core.gateauth import Caller
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.ledger import UnitLedger
    from gpuguard.core.values import GpuReading, ReapResult, UnitProvenance
    from gpuguard.unitsettings import UnitSettings


def unknown_unit(settings: Settings, unit: str, command: str, *, force: bool) -> Said | None:
    """Exit 64, saying so, for a unit neither configured, gated nor known to systemd.

    A typo (``sglang.servce``) would get the defaults - every GPU, the default patterns - and a
    reap of scope ``patterns`` would reach processes the real unit spares. ``--force`` goes
    ahead anyway. Only systemd's own answer (``LoadState=not-found``) refuses: when it cannot
    be asked the command goes on and its plan says so (nothing in the unit's cgroup is reaped).
    """
    if force or unit in settings.units or dropin.installed(unit):
        return None
    if not systemd.show_unit(unit).not_found:
        return None

    why = "not in the configuration, no gate drop-in, and systemd has no such unit"
    lines = [f"gpuguard {command}: unknown unit {escape(unit)!r}: {why} (LoadState=not-found)"]
    nearest = did_you_mean(unit, (*settings.units, *systemd.known_units()))
    if nearest:
        lines.append(f"  did you mean {' or '.join(nearest)}?")
    lines.append(f"  --force {command}s it anyway (with the defaults: every GPU)")
    return Said(EX_USAGE, notices=tuple(lines))


def did_you_mean(unit: str, candidates: Sequence[str]) -> list[str]:
    """At most three names close to ``unit`` (difflib's ratio), the closest first."""
    names = list(dict.fromkeys(candidates))
    return [escape(n) for n in difflib.get_close_matches(unit, names, n=3, cutoff=0.75)]


def unit_settings(settings: Settings, unit: str) -> UnitSettings:
    """The unit's entry in the configuration, else the defaults."""
    from gpuguard.unitsettings import UnitSettings  # noqa: PLC0415 - see the package doc

    return settings.units.get(unit) or UnitSettings()


def untouchable(caller: Caller | None = None) -> frozenset[int]:
    """Our own PID and every ancestor's, and the caller's: the gate's client runs in the unit."""
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
    return PlanRequest(
        unit=unit,
        scope=Scope(scope),
        patterns=unit_settings(settings, unit).patterns,
        gpu_set=gpu_set.indices,
        protected_names=settings.protected_processes,
        untouchable_pids=untouchable(caller),
        provenance=provenance,
        live_invocation=live,
        adopt=unit_settings(settings, unit).adopt,
    )


def asker(caller: Caller | None) -> Caller:
    """Who the command runs for: the gate server's caller, else this process itself."""
    return caller if caller is not None else peer.own_caller()


def unit_environment(
    caller: Caller, unit: str, runtime_dir: Path
) -> tuple[dict[str, str] | None, str | None]:
    """The unit's real environment when the caller is one of its processes (else None).

    An ExecStartPre=/ExecStopPost= process has the unit's environment, EnvironmentFile= values
    included. Root records its GPU variables for the daemon's recoveries (unitenv); the second
    value says why that failed, for the command's notices.
    """
    if not caller.runs_in(unit) or caller.environment is None:
        return None, None
    if os.geteuid() == 0:
        try:
            unitenv.record(runtime_dir, unit, caller.environment, caller.pid)
        except OSError as err:
            return caller.environment, f"gpuguard: cannot record {unit}'s GPU variables: {err}"
    return caller.environment, None


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


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """What a gate or reap knows of the unit before the policy decides."""

    request: PlanRequest
    gpu_set: GpuSet
    unit_state: UnitState
    environment: dict[str, str]
    """The unit's environment the GPU set was resolved from (its own, else systemd's)."""
    notices: tuple[str, ...]
    """What went wrong on the way that the command should say (recording the environment)."""

    @property
    def automatic(self) -> bool:
        """Whether systemd restarted the unit itself: an operator's start sets NRestarts to 0.

        Only an automatic restart meets the Xids and the out-of-memory device of the run before.
        """
        return bool(self.unit_state.n_restarts)


def unit_plan(
    settings: Settings, unit: str, scope: str, caller: Caller | None, gpus: Sequence[GpuReading]
) -> UnitPlan:
    """The policy's request for ``unit`` as ``caller`` stands to it (the gate's and reap's rule).

    The unit's own control process (its ExecStartPre=/ExecStopPost=) has its real environment,
    EnvironmentFile= included, and for it the run is over even while systemd still says
    "deactivating": everything else in the cgroup is left over. Anyone else: systemd's
    Environment= only, and the running invocation's processes are kept. Either way systemd
    names the unit's user and runs, and the daemon's ledger (read from the runtime directory)
    what descended from each run: the evidence for its left-overs.
    """
    who = asker(caller)
    unit_state = systemd.show_unit(unit)
    inside = who.runs_in(unit) and systemd.is_control_process(
        unit_state, who.pid, trust_unknown=caller is None
    )
    own, problem = unit_environment(who, unit, settings.runtime_dir)
    environment = unit_state.environment if own is None else own
    live = unit_state.invocation_id if unit_state.running and not inside else None
    gpu_set = resolve_gpu_set(unit_settings(settings, unit).gpus, environment, gpus)
    recorded, noted = _ledger_evidence(settings.runtime_dir, unit, unit_state, inside=inside)
    provenance = replace(
        systemd.provenance(unit_state, inside=inside),
        ledger=recorded.claims,
        elsewhere=recorded.elsewhere,
    )
    if inside and unit_state.error is not None and provenance.problem is None:
        # systemd cannot say the unit's User=; the unit's own control process runs as it (the
        # in-cgroup gate as root: root), so only processes of that uid may be its left-overs.
        provenance = replace(provenance, uid=who.uid)
    request = plan_request(settings, unit, scope, gpu_set, live, provenance, caller=who)
    notices = tuple(line for line in (problem, noted) if line is not None)
    return UnitPlan(request, gpu_set, unit_state, environment, notices)


def _ledger_evidence(
    runtime_dir: Path, unit: str, unit_state: UnitState, *, inside: bool
) -> tuple[UnitLedger, str | None]:
    """The ledger's evidence for ``unit``, after adding what root sees of its runs now.

    Root (the gate server, an in-process gate or reap) records as the daemon does: the live
    descendants of every recorded process of the unit's runs, and, serving the unit's own
    stop-reap, the ending run's cgroup and what descends from it (ledgerstore.record_seen). So
    the gate alone, with no daemon, still knows a worker that a left-over in the cgroup started
    and that moved into a scope of its own. Not recorded: a notice, and the file as it is.
    """
    if os.geteuid() != 0:
        return ledgerstore.evidence(runtime_dir, unit), None
    ending = systemd.ending_run(unit_state) if inside else None
    try:
        seen = ledgerstore.record_seen(
            runtime_dir, unit, ending, unit_state.control_group, time.time()
        )
    except OSError as err:
        problem = f"gpuguard: cannot record {unit}'s processes in the provenance ledger: {err}"
        return ledgerstore.evidence(runtime_dir, unit), problem
    return seen.for_unit(unit), None
