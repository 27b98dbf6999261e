"""Survivors of a run that just ended: the daemon's sweep of an ended run's GPU holders.

When a live event ends a run (core.runend), ``Sweeping`` looks once for a whole burst of ended
runs, then reaps exactly the ended run's processes that still hold the unit's GPUs, and stops
its left-over container through its engine, under the gate's policy, protections and reaper;
it waits for the set to be released, records what it did for the snapshot, and says, when the
next run starts, whether the GPUs were free before it. This module owns that sweep.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpuguard.core.gate.run import reap_targets, set_blockers
from gpuguard.core.policy import plan
from gpuguard.core.reaploop import ReapUntilIdle
from gpuguard.core.runend import Sweep, describe, live_invocation, next_start, over_problem
from gpuguard.core.unitcontainers import container_of
from gpuguard.core.values import ReapOutcome
from gpuguard.daemon.publishing import Publishing, iso
from gpuguard.daemon.watchdog import CONTAINER_SLACK_S

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.events import UnitEvent
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import Decision, PlanRequest
    from gpuguard.core.runend import RunEnd
    from gpuguard.core.unitcontainers import ContainerResult, ContainerVerdict
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ReapResult
    from gpuguard.daemon.ports import UnitContainers
    from gpuguard.daemon.watches import Watch

# A sweep of an ended run's survivors waits this long for the GPUs to be released once none of
# that run's processes holds them any more; past it, others hold the set and the gate decides.
_RELEASE_S = 5.0


class Sweeping(Publishing):
    """The sweep of an ended run's survivors (``loop.Daemon`` calls ``_sweep_all``)."""

    def _sweep_all(self, ended: Sequence[tuple[Watch, RunEnd]]) -> None:
        """One look for a whole burst of ended runs, then a sweep of those with survivors.

        The common case is that nothing of the ended runs holds a GPU: one inventory, and
        systemd is not asked at all. A run whose processes do hold one is looked at afresh, and
        so is every ended run while a docker/podman container holds a GPU (a container's
        processes carry no INVOCATION_ID: only its engine can say it is the unit's).
        """
        if not ended:
            return
        holders = self._gather().holders
        holding = {h.invocation_id for h in holders}
        for watch, _end in ended:  # moved out, with a scope's own INVOCATION_ID
            recorded = dict(self._keeper.claims(watch.name))
            holding.update(recorded[h.identity] for h in holders if h.identity in recorded)
        in_container = any(container_of(h.attribution.container) for h in holders)
        for watch, end in ended:
            if in_container or end.invocation_id in holding:
                self._sweep(watch, end)

    def _sweep(self, watch: Watch, end: RunEnd) -> None:
        """Reap exactly the ended run's processes that still hold GPUs, then wait for the set.

        Only processes whose INVOCATION_ID is the ended run's (``PlanRequest.only_invocation``),
        under the gate's policy, protections and reaper; the run starting or running now is kept
        by invocation; and the unit's own left-over container, which the engine stops
        (containerstop, the gate's rule). A run stopped on purpose is only reported unless
        ``daemon.reap_stopped_survivors``; ``dry_run`` reaps and stops nothing.
        """
        ports = self._ports
        state = self._show_unit(watch.name)
        not_over = over_problem(
            end,
            active_state=state.active_state,
            sub_state=state.sub_state,
            invocation=state.invocation_id,
        )
        if not_over is not None:
            ports.log.info("run not over", unit=watch.name, reason=not_over)
            return
        inventory = self._gather()
        request = self._survivor_request(watch.name, inventory, state, end)
        planned = plan(inventory.holders, request).to_reap
        stopper = ports.containers(request)
        left_over = self._left_over(stopper, inventory)
        if not planned and not left_over:
            return
        daemon = self._settings.daemon
        base = Sweep(end, 0, len(planned), None, None, containers=_named(left_over))
        if daemon.dry_run:
            self._swept(watch, replace(base, dry_run=True), [d.holder.pid for d in planned])
            return
        if end.stopped_on_purpose and not daemon.reap_stopped_survivors:
            self._swept(watch, replace(base, reported_only=True), [d.holder.pid for d in planned])
            return
        refused = self._admit(watch.name, "sweep", iso(ports.wall()))
        if refused is not None:
            ports.log.error("survivors only reported", unit=watch.name, reason=refused)
            self._swept(watch, replace(base, reported_only=True), [d.holder.pid for d in planned])
            return
        ports.notifier.status(f"reaping survivors of {watch.name}")
        stopped = self._stop_containers(stopper, left_over)
        if stopped:
            inventory = self._gather()
        signalled, reaped_at, idle_at = self._reap_run(request, inventory)
        reaped = [r for r in signalled if r.outcome.gone]
        dying = [r for r in signalled if r.outcome is ReapOutcome.UNKILLABLE]
        sweep = replace(
            base,
            reaped=len(reaped),
            dying=len(dying),
            reaped_after_s=reaped_at - end.ended_s if reaped or stopped else None,
            idle_after_s=None if idle_at is None else idle_at - end.ended_s,
            containers=_named([r.verdict for r in stopped]),
        )
        self._swept(watch, sweep, [r.target.identity.pid for r in reaped])

    def _left_over(
        self, stopper: UnitContainers | None, inventory: Inventory
    ) -> list[ContainerVerdict]:
        """The unit's containers the engine confirms are left over, holding its GPUs."""
        if stopper is None:
            return []
        # Each inspect is bounded by the engine adapter (10 s): fed like any long step.
        verdicts = self._feeder.fed(CONTAINER_SLACK_S, stopper.plan)(inventory)
        return [verdict for verdict in verdicts if verdict.stop]

    def _stop_containers(
        self, stopper: UnitContainers | None, left_over: Sequence[ContainerVerdict]
    ) -> list[ContainerResult]:
        """Stop each left-over container through its engine; those no longer running."""
        if stopper is None:
            return []
        act = self._feeder.fed(self._settings.reap_grace_s + CONTAINER_SLACK_S, stopper.act)
        return [result for v in left_over if (result := act(v)) is not None and result.done]

    def _survivor_request(
        self, unit: str, inventory: Inventory, state: UnitState, end: RunEnd
    ) -> PlanRequest:
        """The gate's request narrowed to the ended run: its invocation is the only ended one."""
        running = state.error is None and state.running
        live = live_invocation(end, running=running, invocation=state.invocation_id)
        request = self._request(unit, inventory, self._facts(unit, state), live)
        return replace(
            request,
            provenance=replace(request.provenance, invocations=frozenset({end.invocation_id})),
            only_invocation=end.invocation_id,
        )

    def _reap_run(
        self, request: PlanRequest, inventory: Inventory
    ) -> tuple[list[ReapResult], float, float | None]:
        """Reap the run's holders as they appear, until the set is idle or they are gone.

        Bounded by the gate's timeout, by ``_RELEASE_S`` once none of the run's processes
        holds a GPU (others hold the set then: the gate, if installed, decides the next start),
        and by the reap itself when SIGKILL left one alive: waiting for a process the kernel
        cannot end (an uninterruptible wait) would hold up every other unit's events for
        nothing. So one sweep holds the loop for at most the reaper's grace, its SIGKILL wait
        and ``_RELEASE_S``, plus the looks in between. Returns what was reaped, when the last
        reap returned and when the set was idle.
        """
        ports = self._ports
        settings = self._gate_settings(request)
        deadline = ports.monotonic() + self._settings.gate_timeout_s
        reaped_at = ports.monotonic()
        released_at: float | None = None

        def reap(fresh: Sequence[Decision]) -> tuple[ReapResult, ...]:
            nonlocal reaped_at
            results = tuple(self._reap(request.unit, reap_targets(fresh)))
            reaped_at = ports.monotonic()
            return results

        def done(found: Inventory) -> tuple[float, float | None] | None:
            nonlocal released_at
            now = ports.monotonic()
            if not set_blockers(found, settings):
                return reaped_at, now
            if plan(found.holders, request).to_reap:
                released_at = None
            elif released_at is None:
                released_at = now
            if now >= deadline or (released_at is not None and now - released_at >= _RELEASE_S):
                return reaped_at, None
            return None

        def stuck(results: tuple[ReapResult, ...]) -> tuple[float, float | None] | None:
            alive = any(r.outcome is ReapOutcome.UNKILLABLE for r in results)
            return (reaped_at, None) if alive else None

        loop: ReapUntilIdle[tuple[float, float | None]] = ReapUntilIdle(
            request,
            self._gather,
            lambda: self._feeder.sleep(settings.poll_s),
            done,
            reap=reap,
            after_reap=stuck,
        )
        last_reap, idle_at = loop.run(inventory)
        return loop.reaped, last_reap, idle_at

    def _swept(self, watch: Watch, sweep: Sweep, pids: list[int]) -> None:
        """Record and say what a sweep did; the next start's time is added when it comes."""
        ports = self._ports
        watch.last_sweep = sweep
        watch.sweeps.append(_sweep_record(sweep, pids, iso(ports.wall())))
        log = ports.log.info if sweep.reaped_after_s is not None else ports.log.warning
        log(
            "survivors of an ended run",
            unit=watch.name,
            invocation_id=sweep.end.invocation_id,
            pids=pids,
            summary=describe(sweep),
        )
        ports.notifier.status(self._status_line())

    def _note_next_start(self, watch: Watch, event: UnitEvent) -> None:
        """The next run started: say whether the swept run's GPUs were free before it."""
        sweep = watch.last_sweep
        if sweep is None:
            return
        started = next_start(event, sweep.end)
        if started is None:
            return
        done = replace(sweep, next_start_after_s=started - sweep.end.ended_s)
        watch.last_sweep = None
        if watch.sweeps and watch.sweeps[-1]["invocation_id"] == sweep.end.invocation_id:
            watch.sweeps[-1] |= {
                "next_start_after_s": round(started - sweep.end.ended_s, 2),
                "summary": describe(done),
            }
        self._ports.log.info("next run started", unit=watch.name, summary=describe(done))


def _sweep_record(sweep: Sweep, pids: list[int], at: str) -> dict[str, Any]:
    """A sweep as the snapshot keeps it (plain JSON; times in seconds after the run's end)."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    if sweep.dry_run:
        result = "dry-run"
    elif sweep.reported_only:
        result = "reported"
    else:
        result = "reaped" if sweep.idle_after_s is not None else "reaped, GPUs not idle"
    return {
        "at": at,
        "invocation_id": sweep.end.invocation_id,
        "ended_by": sweep.end.how,
        "stopped_on_purpose": sweep.end.stopped_on_purpose,
        "result": result,
        "pids": pids,
        "reaped_after_s": rounded(sweep.reaped_after_s),
        "idle_after_s": rounded(sweep.idle_after_s),
        "next_start_after_s": None,
        "containers": list(sweep.containers),
        "summary": describe(sweep),
    }


def _named(verdicts: Sequence[ContainerVerdict]) -> tuple[str, ...]:
    """``NAME (docker <id12>)`` for each container, as a sweep says it."""
    return tuple(f"{v.name} ({v.engine} {v.short_id})" for v in verdicts)
