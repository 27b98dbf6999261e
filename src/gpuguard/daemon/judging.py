"""Judging a unit that loops, and acting on the verdict: the daemon's recovery.

``Judging`` turns a unit's detector verdict into a decision (core.recovery's planner, never
starting a unit stopped on purpose, never stopping one whose GPUs it cannot free), gathers the
GPU evidence the detector weighs (stale holders, busy or broken GPUs, reset-class Xids, a
process SIGKILL left stuck), logs each verdict once, and carries a recovery out (recover.py's
steps) or resumes one interrupted by the daemon's own death. This module owns those decisions'
wiring; the rules themselves are the core's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gpuguard.core.detector import GpuEvidence
from gpuguard.core.escaping import escape
from gpuguard.core.gate.run import operator_command, set_blockers
from gpuguard.core.gpuset import cuda_view
from gpuguard.core.health import reset_reasons
from gpuguard.core.oomdevice import device_phrases
from gpuguard.core.policy import plan
from gpuguard.core.records import bound_record
from gpuguard.core.recovery import (
    Action,
    Interrupted,
    RecoveryDecision,
    resume_problem,
    unfreeable,
)
from gpuguard.core.values import MIB, nvml_usable
from gpuguard.core.xid.faults import XidFault, blockers
from gpuguard.core.xid.stuck import claims, named_by, stuck_phrase
from gpuguard.daemon import recover
from gpuguard.daemon.publishing import Publishing, action_of, iso, iso_or_none
from gpuguard.daemon.watchdog import CONTAINER_SLACK_S

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuguard.core.detector import Diagnosis
    from gpuguard.core.gate.run import GateSettings
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import PlanRequest
    from gpuguard.core.unitstate import UnitState
    from gpuguard.daemon.watches import Watch

# An interrupted recovery is resumed only if it could still be running: the stop wait, the
# gate's timeout and one restart of the daemon.
_RESUME_SLACK_S = 60.0
# The unit of /proc's process start times (USER_HZ): compared with the journal's seconds.
_TICKS = os.sysconf("SC_CLK_TCK")


def _nvml_reason(inventory: Inventory) -> str:
    """Why NVML gave no reading, in its own words."""
    return escape(inventory.nvml.reason or f"NVML {inventory.nvml.health.value}")


class Judging(Publishing):
    """Verdicts, decisions and recoveries (``loop.Daemon`` calls ``_judge`` and ``_recover``)."""

    def _judge(self, watch: Watch) -> None:
        now = self._ports.monotonic()
        if watch.not_found:  # events about it: it may exist now
            self._note_state(watch, self._show_unit(watch.name))
        quick = watch.detector.diagnose(now, None)
        watch.up.stayed_up(quick.good_start_s)
        if not quick.looping:
            watch.planner.healthy(now)
            self._say(watch, quick, None)
            return
        inventory = self._gather()
        state = self._show_unit(watch.name)
        self._note_state(watch, state)
        evidence = self._gpu_evidence(watch, inventory, state)
        diagnosis = watch.detector.diagnose(now, evidence)
        decision = watch.planner.decide(diagnosis, now)
        if decision.action is Action.RECOVER and state.active_state == "inactive":
            # Nothing will start it again (a restart pending is "activating"): someone stopped
            # it, and gpuguard does not start a unit that was stopped on purpose.
            decision = RecoveryDecision(
                Action.REPORT,
                f"{watch.name} is inactive with no restart pending: it was stopped on purpose, "
                "and gpuguard does not start it",
            )
        if decision.action is Action.RECOVER:
            decision = self._never_worse(watch, inventory, state, decision)
        if decision.action is Action.RECOVER:
            decision = self._within_breaker(watch.name, decision)
        self._say(watch, diagnosis, decision)
        if decision.action is Action.RECOVER:
            self._recover(watch, diagnosis, inventory, state)
        self._save(watch)

    def _never_worse(
        self, watch: Watch, inventory: Inventory, state: UnitState, decision: RecoveryDecision
    ) -> RecoveryDecision:
        """Recover only when the plan can free what holds the unit's GPUs; else needs operator.

        Stopping a unit whose GPUs others hold (a left-over gpuguard cannot prove is the unit's)
        frees nothing and risks an outage: the unit is left as systemd has it, and the operator
        is told the blockers and the command to run after checking them (CRITICAL).
        """
        request = self._request(watch.name, inventory, self._facts(watch.name, state), None)
        blockers = unfreeable(
            plan(inventory.holders, request),
            inventory,
            self._settings.idle_threshold_mib * MIB,
            kill_mode=state.kill_mode,
            main=state.main,
        )
        if not blockers:
            return decision
        # The gate's refusal and status name the same way out (or none: a tenant's job).
        command = operator_command(inventory, request)
        way_out = (
            f"After checking them: {command}"
            if command
            else "No gpuguard command frees them: their owners must end them"
        )
        reason = (
            f"{watch.name} is not stopped: its plan cannot free its GPUs, held by "
            + "; ".join(blockers)
            + f". {way_out}"
        )
        if watch.decision is None or watch.decision.reason != reason:
            self._ports.log.critical(
                "needs operator: gpuguard cannot prove who holds the GPUs",
                unit=watch.name,
                blockers=list(blockers),
                command=command,
            )
        return RecoveryDecision(Action.NEEDS_OPERATOR, reason)

    def _within_breaker(self, unit: str, decision: RecoveryDecision) -> RecoveryDecision:
        """The decision to recover, if the host-wide breaker lets it through; else REPORT."""
        if self._settings.daemon.dry_run:
            return decision
        refused = self._admit(unit, "recovery", iso(self._ports.wall()))
        return decision if refused is None else RecoveryDecision(Action.REPORT, refused)

    def _say(self, watch: Watch, diagnosis: Diagnosis, decision: RecoveryDecision | None) -> None:
        """Log a verdict once when it changes, not on every event."""
        before = (watch.diagnosis.reason if watch.diagnosis else None, action_of(watch.decision))
        watch.diagnosis, watch.decision = diagnosis, decision
        if before == (diagnosis.reason, action_of(decision)):
            return
        fields: dict[str, object] = {
            "unit": watch.name,
            "looping": diagnosis.looping,
            "reason": diagnosis.reason,
            "cause": diagnosis.cause.value,
            "cause_detail": diagnosis.cause_detail,
            "starts_in_window": diagnosis.starts_in_window,
            "n_restarts": diagnosis.n_restarts,
            "read_through_s": watch.read_through_s,
        }
        if diagnosis.findings:  # no loop, but worth saying (a left-over at an operator's start)
            fields["findings"] = list(diagnosis.findings)
        if decision is not None:
            fields |= {"action": decision.action.value, "action_reason": decision.reason}
        if decision is None or not diagnosis.looping:
            # No loop once the GPUs were looked at (a left-over that holds nothing): a verdict,
            # never a "restart loop" warning that says looping=false.
            self._ports.log.info("verdict", **fields)
            return
        if decision.action is Action.NEEDS_OPERATOR:
            self._ports.log.error("needs operator", evidence=list(diagnosis.evidence), **fields)
        else:
            self._ports.log.warning("restart loop", evidence=list(diagnosis.evidence), **fields)

    def _gpu_evidence(self, watch: Watch, inventory: Inventory, state: UnitState) -> GpuEvidence:
        """Stale holders of the unit's GPUs: what a reap would take while the unit runs.

        A GPU of the set needs a reset when NVML says so, or after a reset-class kernel Xid
        since the unit last came up (xid.faults).
        """
        facts = self._facts(watch.name, state)
        request = self._request(watch.name, inventory, facts, facts.live)
        stale = tuple(
            f"PID {d.holder.pid} ({escape(d.holder.comm)}) holds GPU "
            + ",".join(str(u.gpu_index) for u in d.holder.gpus)
            + f": {d.reason}"
            for d in plan(inventory.holders, request).to_reap
        )
        settings = self._gate_settings(request)
        wanted = request.gpu_set
        needs_reset = tuple(
            f"GPU {gpu.reading.index}: " + "; ".join(reasons)
            for gpu in inventory.gpus
            if (wanted is None or gpu.reading.index in wanted)
            and (reasons := reset_reasons(gpu.reading))
        )
        needs_reset += self._stuck(watch, inventory, wanted)
        faults = [
            XidFault(e.pci_bus_id, e.code, iso_or_none(e.realtime_s))
            for e in self._faults.since(watch.up.since_s)
        ]
        needs_reset += blockers(faults, inventory.nvml.gpus, wanted)
        view = cuda_view(facts.environment, inventory.nvml.gpus)
        busy = set_blockers(inventory, settings)
        # The gate's refusal names why it refused then; what holds the GPUs now is today's.
        refused = self._ports.gate_refusal(watch.name) is not None
        return GpuEvidence(
            stale_holders=stale,
            gpus_busy=bool(busy),
            gate_refused=busy if refused else (),
            needs_reset=needs_reset,
            cuda_devices=device_phrases(view, inventory),
            cuda_note=view.note,
            holder_pids=frozenset(
                pid
                for gpu in inventory.gpus
                if wanted is None or gpu.reading.index in wanted
                for pid in gpu.holder_pids
            ),
            unreadable=None if nvml_usable(inventory.nvml) else _nvml_reason(inventory),
        )

    def _stuck(
        self, watch: Watch, inventory: Inventory, wanted: frozenset[int] | None
    ) -> tuple[str, ...]:
        """Holders of the set the last recovery's SIGKILL left alive after an Xid naming them.

        Alive after SIGKILL, a process is in R or D inside the kernel by necessity; the same
        process still holding a GPU (it started before the Xid) is stuck. Reaping it again
        cannot help: the unit needs a GPU reset (needs operator).
        """
        last = watch.recoveries[-1] if watch.recoveries else {}
        stuck_pids = {
            r.get("pid")
            for r in last.get("reaped") or ()
            if isinstance(r, dict) and r.get("stuck_after_xid") is not None
        }
        xid_claims = claims(self._xids)
        found = []
        for holder in inventory.holders:
            gpus = [u.gpu_index for u in holder.gpus if wanted is None or u.gpu_index in wanted]
            if holder.pid not in stuck_pids or not gpus:
                continue
            claim = named_by(holder.pid, holder.identity.start_time / _TICKS, xid_claims)
            if claim is not None:
                found.append(
                    f"GPU {','.join(map(str, gpus))}: PID {holder.pid} ({escape(holder.comm)}) "
                    f"is {stuck_phrase(claim)}; SIGKILL did not end it"
                )
        return tuple(found)

    def _recover(
        self, watch: Watch, diagnosis: Diagnosis, inventory: Inventory, state: UnitState
    ) -> None:
        ports = self._ports
        now = ports.monotonic()
        request = self._request(watch.name, inventory, self._facts(watch.name, state), None)
        planned = [d.holder.pid for d in plan(inventory.holders, request).to_reap]
        record: dict[str, Any] = {
            "started_at": iso(ports.wall()),
            "started_monotonic_s": now,
            "boot_id": ports.boot_id,
            "invocation_id": state.invocation_id,
            "reason": diagnosis.reason,
            "evidence": list(diagnosis.evidence),
            "planned_pids": planned,
        }
        watch.planner.recovered(now)
        if self._settings.daemon.dry_run:
            record |= {"result": "dry-run", "finished_at": iso(ports.wall())}
            ports.log.warning(
                "dry run: would recover",
                unit=watch.name,
                steps=[
                    "systemctl stop",
                    f"reap {planned}",
                    "wait for idle GPUs",
                    "reset-failed",
                    "systemctl start",
                ],
            )
            watch.recoveries.append(bound_record(record))
            return
        watch.in_progress = record
        self._save(watch)
        self._carry_out(watch, record)

    def _resume_recovery(self, watch: Watch) -> None:
        """A recovery interrupted by our own death (SIGKILL, crash) is finished, not repeated.

        Only when it is this boot's, young, the unit is as the recovery left it and dry_run is
        off (``recovery.resume_problem``); otherwise it is closed as abandoned, untouched.
        """
        record = watch.in_progress
        assert record is not None  # noqa: S101 - checked by the caller
        ports = self._ports
        state = self._show_unit(watch.name)
        problem = resume_problem(
            Interrupted(
                record_boot=record.get("boot_id"),
                record_started_s=record.get("started_monotonic_s"),
                boot=ports.boot_id,
                now=ports.monotonic(),
                active_state=None if state.error else state.active_state,
            ),
            dry_run=self._settings.daemon.dry_run,
            within_s=recover.STOP_WAIT_S + self._settings.gate_timeout_s + _RESUME_SLACK_S,
        )
        if problem is not None:
            ports.log.warning(
                "interrupted recovery not resumed",
                unit=watch.name,
                since=record.get("started_at"),
                reason=problem,
            )
            record |= {
                "finished_at": iso(ports.wall()),
                "result": "abandoned",
                "problem": f"not resumed: {problem}",
            }
            watch.in_progress = None
            watch.recoveries.append(record)
            self._save(watch)
            return
        ports.log.warning(
            "resuming interrupted recovery", unit=watch.name, since=record.get("started_at")
        )
        self._carry_out(watch, record)

    def _carry_out(self, watch: Watch, record: dict[str, Any]) -> None:
        ports = self._ports
        ports.notifier.status(f"recovering {watch.name}")
        ports.log.warning("recovery: stopping unit", unit=watch.name)
        done = recover.carry_out(watch.name, self._recovery_steps())
        record |= {"finished_at": iso(ports.wall())} | done.record(claims(self._xids))
        watch.detector.reset(done.restarted_at)
        watch.in_progress = None
        watch.recoveries.append(bound_record(record))
        self._save(watch)
        log = ports.log.info if done.problem is None else ports.log.error
        log(
            "recovery finished",
            unit=watch.name,
            result=done.result,
            problem=done.problem,
            reaped=len(record["reaped"]),
        )
        ports.notifier.status(self._status_line())

    def _recovery_steps(self) -> recover.Steps:
        def gate_settings(unit: str, inventory: Inventory, state: UnitState) -> GateSettings:
            return self._gate_settings(
                self._request(unit, inventory, self._facts(unit, state), None)
            )

        return recover.Steps(
            control=self._control,
            show_unit=self._show_unit,
            gather=self._gather,
            gate_settings=gate_settings,
            reap=self._reap,
            containers=self._fed_containers,
            monotonic=self._ports.monotonic,
            sleep=self._feeder.sleep,
        )

    def _fed_containers(self, request: PlanRequest) -> Callable[[Inventory], bool] | None:
        """The unit's container stopper, fed like the reaper: an engine's stop can take a while."""
        stopper = self._ports.containers(request)
        if stopper is None:
            return None
        return self._feeder.fed(self._settings.reap_grace_s + CONTAINER_SLACK_S, stopper)
