"""``gpuguard reap``: plan, confirm, signal the stale holders of one unit's GPUs, report."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import containerstop, inventory, logs, reaper, releaselog
from gpuguard.commands.context import (
    result_json,
    unit_plan,
    unit_settings,
    unknown_unit,
    viewer_uid,
)
from gpuguard.commands.output import Said
from gpuguard.core import policy
from gpuguard.core.escaping import escape
from gpuguard.core.exits import EX_USAGE
from gpuguard.core.gate import run as gaterun
from gpuguard.core.gate.run import may_name
from gpuguard.core.release import ReleaseWatch
from gpuguard.core.releaselog import seconds
from gpuguard.core.stopbudget import ReapTimes, fit

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpuguard.adapters.containerstop import ContainerStopper
    from gpuguard.commands.arguments import ReapArgs
    from gpuguard.commands.context import UnitPlan
    from gpuguard.config import Settings
    from gpuguard.core.gate.auth import Caller
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.inventory import GpuOccupancy, Inventory
    from gpuguard.core.logger import Logger
    from gpuguard.core.policy import KillPlan, PlanRequest
    from gpuguard.core.release import Release
    from gpuguard.core.unitcontainers import ContainerResult, ContainerVerdict
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ReapResult

Containers = tuple[tuple["ContainerVerdict", "ContainerResult | None"], ...]


def run(
    settings: Settings,
    args: ReapArgs,
    caller: Caller | None,
    *,
    show: Callable[[str], object],
    ask: Callable[[str], bool],
) -> ReapReport | Said:
    """Plan, confirm, signal and report; the report's exit status says if the GPUs are idle.

    The plan goes to ``show`` (as text, unless --json) before anything is signalled, and
    ``ask`` gets the question when the plan needs a yes and --yes was not given.
    """
    began = time.monotonic()
    unit_name = args.unit or _only_unit(settings)
    if unit_name is None:
        return Said(
            EX_USAGE,
            notices=(
                (
                    "gpuguard reap: several units are watched; name one with --unit "
                    f"({', '.join(settings.units)})"
                ),
            ),
        )
    unknown = unknown_unit(settings, unit_name, "reap", force=args.force)
    if unknown is not None:
        return unknown
    found = inventory.gather(settings)
    planned = unit_plan(settings, unit_name, args.scope, caller, found.nvml.gpus)
    unit_state, gpu_set = planned.unit_state, planned.gpu_set
    kill_plan = policy.plan(found.holders, planned.request)
    notes = (
        [f"cannot ask systemd about {unit_name} ({unit_state.error})"] if unit_state.error else []
    )
    grace = args.grace if args.grace is not None else settings.reap_grace_s
    timeout = wait_limit(settings, args.timeout, caller)

    def logger() -> Logger:
        logs.configure_logging(json=False)
        return logs.get_logger().bind(unit=unit_name, command="reap")

    stopper = _container_stopper(settings, planned.request, args, grace, logger)
    verdicts = stopper.plan(found)
    to_stop = [verdict for verdict in verdicts if verdict.stop]
    times = _fitted(
        ReapTimes(grace, reaper.KILL_WAIT_S, timeout),
        unit_state,
        caller,
        containers=bool(to_stop),
        spent_s=time.monotonic() - began,
    )
    grace, timeout = times.grace_s, times.timeout_s
    stopper.grace_s = grace
    if times.cut_by_s is not None:
        notes.append(
            f"the unit's ExecStopPost= within TimeoutStopSec={times.cut_by_s:g}s: "
            f"{times.in_words()}"
        )
    if not args.json:
        show(
            _plan_text(kill_plan, gpu_set, notes, viewer_uid(caller))
            + _container_plan_text(verdicts)
        )
    if args.dry_run or not (kill_plan.to_reap or to_stop):
        return _reap_finish(
            settings,
            found,
            kill_plan=kill_plan,
            planned=planned,
            results=(),
            args=args,
            timeout=timeout,
            viewer=viewer_uid(caller),
            waited=False,
            containers=_stop_containers(stopper, verdicts) if args.dry_run else _kept(verdicts),
        )
    also = f" and stop {len(to_stop)} container(s)" if to_stop else ""
    if not args.yes and not ask(f"Signal {len(kill_plan.to_reap)} process(es){also}?"):
        declined = "gpuguard reap: nothing signalled (confirm on a terminal, or --yes)"
        return Said(1, notices=(*planned.notices, declined))

    containers = _stop_containers(stopper, verdicts)  # first: as the gate does
    results = reaper.reap(
        gaterun.reap_targets(kill_plan.to_reap),
        grace_s=grace,
        kill_wait_s=times.kill_wait_s,
        logger=logger(),
    )
    return _reap_finish(
        settings,
        found,
        kill_plan=kill_plan,
        planned=planned,
        results=results,
        args=args,
        timeout=timeout,
        viewer=viewer_uid(caller),
        waited=True,
        containers=containers,
    )


def wait_limit(settings: Settings, timeout: float, caller: Caller | None) -> float:
    """How long the reap waits for the memory to go: ``timeout``, capped for a unit's request.

    A unit's own request (its ExecStopPost= through the gate server) waits at most
    gate_timeout_s, as its gate does: it holds one of the server's slots meanwhile. The
    operator's (or an in-process run's) is bounded by --timeout's own range only.
    """
    if caller is not None and not caller.is_operator:
        return min(timeout, settings.gate_timeout_s)
    return timeout


def _fitted(
    asked: ReapTimes,
    unit_state: UnitState,
    caller: Caller | None,
    *,
    containers: bool,
    spent_s: float,
) -> ReapTimes:
    """``asked``, fitted into the unit's TimeoutStopSec= when the asker is its ExecStopPost=.

    systemd kills an ExecStopPost= still running past the unit's stop timeout (stop-post gets
    it afresh), so the unit's own reap in its stop takes what fits (core/stopbudget.py) and
    leaves the rest to the next start's gate; an operator's reap, or one outside a stop, is as
    asked. A left-over container's stop comes first with the same grace: it counts twice.
    """
    asker = caller.pid if caller is not None else os.getpid()
    if unit_state.ending_run() is None or not unit_state.is_control_process(
        asker, trust_unknown=False
    ):
        return asked
    graces = 2 if containers else 1
    times = fit(replace(asked, grace_s=asked.grace_s * graces), unit_state.stop_timeout_s, spent_s)
    return replace(times, grace_s=times.grace_s / graces)


def _only_unit(settings: Settings) -> str | None:
    return next(iter(settings.units)) if len(settings.units) == 1 else None


def _plan_text(kill_plan: KillPlan, gpu_set: GpuSet, notes: list[str], viewer: int | None) -> str:
    """The plan as reap shows it; to a non-root ``viewer`` other users' processes only counted."""
    request = kill_plan.request
    lines = [f"Plan for {request.unit}, scope {request.scope.value}, {gpu_set.describe()}:"]
    lines.extend(f"  note: {note}" for note in notes)
    if gpu_set.note:
        lines.append(f"  note: {gpu_set.note}")
    hidden = {"reap": 0, "spare": 0}
    for verb, decisions in (("reap", kill_plan.to_reap), ("spare", kill_plan.spared)):
        for decision in decisions:
            if not may_name(decision.holder.uids, viewer):
                hidden[verb] += 1
                continue
            command = decision.holder.command_within(60)
            why = (
                decision.reason
                if verb == "reap"
                else f"{decision.verdict.value}: {decision.reason}"
            )
            lines.append(f"  {verb:<5} pid {decision.holder.pid:<7} {command}  - {why}")
    lines.extend(
        f"  {verb:<5} {count} process(es) of other users (named to root only)"
        for verb, count in hidden.items()
        if count
    )
    if not kill_plan.decisions:
        lines.append("  no process holds these GPUs")
    return "".join(f"{escape(line)}\n" for line in lines)


# -- the unit's left-over containers (adapters/containerstop, the gate's one code path) --------


def _container_stopper(
    settings: Settings,
    request: PlanRequest,
    args: ReapArgs,
    grace_s: float,
    logger: Callable[[], Logger],
) -> ContainerStopper:
    """The gate's stopper of the unit's left-over containers, with reap's grace and dry run."""
    return containerstop.for_unit(
        request,
        unit_settings(settings, request.unit).container,
        grace_s=grace_s,
        dry_run=bool(args.dry_run),
        logger=logger,
    )


def _stop_containers(stopper: ContainerStopper, verdicts: Sequence[ContainerVerdict]) -> Containers:
    """Stop (dry run: say it would stop) each left-over container; kept ones are not touched."""
    return tuple((v, stopper.act(v) if v.stop else None) for v in verdicts)


def _kept(verdicts: Sequence[ContainerVerdict]) -> Containers:
    return tuple((verdict, None) for verdict in verdicts)


def _container_plan_text(verdicts: Sequence[ContainerVerdict]) -> str:
    """One plan line per container on the unit's GPUs: ``stop`` only for the unit's left-over."""
    return "".join(
        escape(f"  {'stop ' if v.stop else 'spare'} container {v.reason}") + "\n" for v in verdicts
    )


def _container_lines(containers: Containers) -> list[str]:
    """What was done about each container to stop, as the report's result lines."""
    return [
        f"container {verdict.container} ({verdict.name}): {result.outcome}"
        + (f" - {result.error}" if result.error else "")
        for verdict, result in containers
        if result is not None
    ]


def _container_json(verdict: ContainerVerdict, result: ContainerResult | None) -> dict[str, Any]:
    """One container in ``reap --json``'s ``containers`` (docs/reap.md)."""
    return {
        "container": verdict.container,
        "engine": verdict.engine.value,
        "id": verdict.full_id,
        "name": verdict.name,
        "owned": verdict.owned,
        "stop": verdict.stop,
        "reason": verdict.reason,
        "outcome": None if result is None else result.outcome,
        "error": None if result is None else result.error,
    }


def _reap_finish(  # noqa: PLR0913 - the pieces of one report, passed once
    settings: Settings,
    found: Inventory,
    *,
    kill_plan: KillPlan,
    planned: UnitPlan,
    results: tuple[ReapResult, ...],
    args: ReapArgs,
    timeout: float,
    viewer: int | None,
    waited: bool,
    containers: Containers,
) -> ReapReport:
    gate_settings = gaterun.GateSettings(
        kill_plan.request,
        settings.idle_threshold_mib * 1024 * 1024,
        timeout,
        poll_s=0.2,
        viewer_uid=viewer,
    )
    watch = ReleaseWatch()
    watch.reaped(results, found.nvml)  # the plan's inventory: the GPUs it listed them on
    released: list[tuple[Release, float]] = []

    def gather() -> Inventory:
        """The next inventory, and the GPUs it shows released (ReleaseWatch.observe times them)."""
        begun = time.monotonic()
        fresh = inventory.gather(settings)
        released.extend((release, begun) for release in watch.observe(fresh.nvml, begun))
        return fresh

    current, blockers = gaterun.wait_until_idle(
        gate_settings,
        gather() if waited else found,
        gather,
        time.monotonic,
        time.sleep,
        wait_s=timeout if waited else 0.0,
    )
    gpu_set = planned.gpu_set
    notices = planned.notices + _log_releases(settings, kill_plan.request.unit, released)
    return ReapReport(
        kill_plan=kill_plan,
        gpu_set=gpu_set,
        results=results,
        gpus=tuple(
            g for g in current.gpus if gpu_set.indices is None or g.reading.index in gpu_set.indices
        ),
        blockers=blockers,
        dry_run=bool(args.dry_run),
        notices=notices,
        containers=containers,
        released=tuple(release for release, _ in released),
        viewer_uid=viewer,
    )


def _log_releases(
    settings: Settings, unit: str, released: Sequence[tuple[Release, float]]
) -> tuple[str, ...]:
    """Append the measured releases to the release log, as the daemon and the gate do."""
    try:
        releaselog.record(settings.runtime_dir, releaselog.logged(released, by="reap", unit=unit))
    except OSError as err:
        return (f"gpuguard reap: cannot record the release times in {settings.runtime_dir}: {err}",)
    return ()


@dataclass(frozen=True, slots=True)
class ReapReport:
    """What ``reap`` did and found: the plan, each target's result, the unit's GPUs at the end."""

    kill_plan: KillPlan
    gpu_set: GpuSet
    results: tuple[ReapResult, ...]
    gpus: tuple[GpuOccupancy, ...]
    blockers: tuple[str, ...]
    """What still keeps the unit's GPUs from being idle; empty when they are."""
    dry_run: bool
    notices: tuple[str, ...]
    """What went wrong on the way besides the reap (recording the unit's GPU variables)."""
    containers: Containers = ()
    """Each container on the unit's GPUs: its verdict, and what stopping it did (None: kept)."""
    released: tuple[Release, ...] = ()
    """The GPUs seen letting go of the reaped holders' memory while reap waited (core.release)."""
    viewer_uid: int | None = None
    """The asker's UID when not root: other users' processes in the plan are not named to it."""

    @property
    def exit_status(self) -> int:
        """0 idle; 1 still busy; a dry run's plan was the answer asked for, so 0."""
        return 0 if self.dry_run or not self.blockers else 1

    def to_json(self) -> dict[str, Any]:
        """``reap --json`` (schema_version 1, docs/reap.md)."""
        request = self.kill_plan.request
        return {
            "schema_version": 1,
            "unit": request.unit,
            "scope": request.scope.value,
            "gpu_set": self.gpu_set.describe(),
            "dry_run": self.dry_run,
            "plan": [
                {
                    "pid": d.holder.pid,
                    "command": d.holder.command,
                    "verdict": d.verdict.value,
                    "reason": d.reason,
                }
                if may_name(d.holder.uids, self.viewer_uid)
                else {
                    "pid": None,
                    "command": None,
                    "verdict": d.verdict.value,
                    "reason": "another user's process (named to root only)",
                }
                for d in self.kill_plan.decisions
            ],
            "results": [result_json(r) for r in self.results],
            "gpus": [
                {
                    "index": g.reading.index,
                    "used_mib": None
                    if g.reading.memory is None
                    else g.reading.memory.used_bytes >> 20,
                }
                for g in self.gpus
            ],
            "idle": not self.blockers,
            "blockers": list(self.blockers),
            "containers": [_container_json(v, r) for v, r in self.containers],
            "released": [release.to_json() for release in self.released],
        }

    def to_text(self) -> str:
        """One line per result and per GPU, then what is still busy; every line escaped."""
        lines = [
            f"pid {r.target.identity.pid}: {r.outcome.value}"
            + (f" ({', '.join(r.signals)})" if r.signals else "")
            + (f" - {r.detail}" if r.detail else "")
            for r in self.results
        ]
        lines.extend(_container_lines(self.containers))
        lines.extend(
            f"GPU {r.gpu}: memory released {seconds(r.seconds)} after the last signal"
            for r in self.released
        )
        for g in self.gpus:
            memory = g.reading.memory
            used = "unknown" if memory is None else f"{memory.used_bytes >> 20} MiB"
            lines.append(f"GPU {g.reading.index}: {used} used")
        lines.extend(f"still busy: {b}" for b in self.blockers)
        return "".join(f"{escape(line)}\n" for line in lines)
