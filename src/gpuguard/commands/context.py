"""What the gate and reap commands share: who asks, the unit's settings, the policy's request."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import dropin, peer, procfs, systemd, unitfacts
from gpuguard.commands.output import Said
from gpuguard.core.escaping import escape
from gpuguard.core.exits import EX_USAGE
from gpuguard.core.gpuset import resolve_gpu_set
from gpuguard.core.policy import PlanRequest, Scope
from gpuguard.core.unitname import unit_syntax_problem

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.config import Settings
    from gpuguard.core.gate.auth import Caller
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import GpuReading, ReapResult, UnitProvenance
    from gpuguard.unitsettings import UnitSettings


def unknown_unit(settings: Settings, unit: str, command: str, *, force: bool) -> Said | None:
    """Exit 64, saying so, for a unit neither configured, gated nor known to systemd.

    A typo (``sglang.servce``) would get the defaults - every GPU, the default patterns - and a
    reap of scope ``patterns`` would reach processes the real unit spares. ``--force`` goes
    ahead anyway. A name no unit can have (``.servce`` is no unit type) is refused without
    asking systemd; otherwise only systemd's own answer (``LoadState=not-found``) refuses: when
    it cannot be asked the command goes on and its plan says so (nothing in the unit's cgroup
    is reaped).
    """
    if force or unit in settings.units or dropin.installed(unit):
        return None
    syntax = unit_syntax_problem(unit)
    if syntax is not None:
        lines = [f"gpuguard {command}: unknown unit {escape(unit)!r}: {syntax}"]
    elif not systemd.show_unit(unit).not_found:
        return None
    else:
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


def viewer_uid(caller: Caller | None) -> int | None:
    """Whom the answer is for: None for root (told every holder), else the asker's UID.

    The gate's and reap's answers reach the unit's journal, which the unit's user reads: other
    users' processes are named to root only (core/gate/run.may_name).
    """
    uid = asker(caller).uid
    return None if uid == 0 else uid


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

    Gathered first, in one adapter call (unitfacts.gather), then decided from that value.

    The unit's own control process (its ExecStartPre=/ExecStopPost=) has its real environment,
    EnvironmentFile= included, and for it the run is over even while systemd still says
    "deactivating": everything else in the cgroup is left over. Anyone else: systemd's
    Environment= only, and the running invocation's processes are kept. Either way systemd
    names the unit's user and runs, and the daemon's ledger (read from the runtime directory)
    what descended from each run: the evidence for its left-overs.
    """
    who = asker(caller)
    facts = unitfacts.gather(unit, who, settings.runtime_dir, trust_unknown=caller is None)
    unit_state, inside, provenance = facts.state, facts.inside, facts.provenance
    gpu_set = resolve_gpu_set(unit_settings(settings, unit).gpus, facts.environment, gpus)
    if inside and unit_state.error is not None and provenance.problem is None:
        # systemd cannot say the unit's User=; the unit's own control process runs as it (the
        # in-cgroup gate as root: root), so only processes of that uid may be its left-overs.
        provenance = replace(provenance, uid=who.uid)
    request = plan_request(settings, unit, scope, gpu_set, facts.live, provenance, caller=who)
    return UnitPlan(request, gpu_set, unit_state, facts.environment, facts.notices)
