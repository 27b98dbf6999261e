"""When the daemon may break a restart loop, and when it must stop trying (pure, clock passed in).

A recovery stops the unit, reaps its stale GPU holders and starts it again. It is worth doing
only for a loop with a GPU cause; it is spaced out by a growing backoff; and after a few that
did not help, the unit is marked *needs operator* and left alone — repeating a recovery that
does not work would only hide the real problem behind more model loads.

Times are monotonic seconds (``time.monotonic()``, the journal's clock): a wall-clock step
neither ends a backoff early nor stretches it. They mean nothing in another boot, so the saved
time of the last recovery is only taken back in the boot that wrote it.

``resume_problem`` decides whether a recovery interrupted by the daemon's death may be finished:
only in the same boot, soon after it began, and while the unit is as the recovery left it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeGuard

from gpuguard.core.detector import Cause
from gpuguard.core.escaping import escape
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.core.detector import Diagnosis
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import KillPlan
    from gpuguard.core.values import ProcessIdentity


class Action(StrEnum):
    """What to do about a diagnosis."""

    NONE = "none"
    RECOVER = "recover"
    REPORT = "report"
    WAIT = "wait"
    NEEDS_OPERATOR = "needs-operator"


@dataclass(frozen=True, slots=True)
class RecoveryLimits:
    """How often recoveries may happen."""

    max_attempts: int = 3
    backoff_s: float = 120.0
    stable_s: float = 300.0


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    """The action with its reason; ``not_before_s`` says when a WAIT ends."""

    action: Action
    reason: str
    not_before_s: float | None = None


class RecoveryPlanner:
    """Tracks one unit's recoveries and decides the next action."""

    def __init__(self, limits: RecoveryLimits) -> None:
        """Start with no recoveries behind us."""
        self._limits = limits
        self._unhelped = 0
        self._last_s: float | None = None
        self.needs_operator = False

    @property
    def attempts_without_help(self) -> int:
        """Recoveries since the unit last ran stably."""
        return self._unhelped

    def decide(self, diagnosis: Diagnosis, now: float) -> RecoveryDecision:
        """The action for a fresh diagnosis at ``now``."""
        if not diagnosis.looping:
            return RecoveryDecision(Action.NONE, diagnosis.reason)
        if diagnosis.cause is Cause.GPU_NEEDS_RESET:
            # Not counted as a recovery and not sticky: once the GPU is reset the next
            # diagnosis no longer says so, and nothing gpuguard did needs forgiving.
            return RecoveryDecision(
                Action.NEEDS_OPERATOR,
                f"{diagnosis.cause_detail}: no kill or restart can help; reset the GPU or reboot "
                "(see `gpuguard status` and the runbook)",
            )
        if diagnosis.cause is not Cause.STALE_GPU_HOLDERS:
            # Unknown is not "no GPU cause": the evidence could not rule the GPUs out.
            what = (
                "whose cause is not known"
                if diagnosis.cause is Cause.UNKNOWN
                else ("without a GPU cause")
            )
            return RecoveryDecision(
                Action.REPORT,
                f"restart loop {what} ({diagnosis.cause.value}: "
                f"{diagnosis.cause_detail}); gpuguard does not act on it",
            )
        return self._limited(now) or RecoveryDecision(
            Action.RECOVER, f"restart loop caused by stale GPU holders: {diagnosis.reason}"
        )

    def decide_engine_dead(self, summary: str, now: float) -> RecoveryDecision:
        """The action for a unit that opted in to recovery of a dead engine (core.liveness)."""
        return self._limited(now) or RecoveryDecision(Action.RECOVER, summary)

    def _limited(self, now: float) -> RecoveryDecision | None:
        """Needs operator after max_attempts, or wait out the backoff; None: may recover now."""
        if self.needs_operator or self._unhelped >= self._limits.max_attempts:
            self.needs_operator = True
            return RecoveryDecision(
                Action.NEEDS_OPERATOR,
                f"{self._unhelped} recoveries did not help; needs an operator "
                "(see `gpuguard status` and the runbook)",
            )
        if self._last_s is not None:
            wait = self._limits.backoff_s * 2 ** max(self._unhelped - 1, 0)
            if now < self._last_s + wait:
                return RecoveryDecision(
                    Action.WAIT,
                    f"last recovery {now - self._last_s:.0f} s ago; next not before {wait:.0f} s",
                    self._last_s + wait,
                )
        return None

    def recovered(self, now: float) -> None:
        """A recovery was carried out at ``now`` (whatever its outcome)."""
        self._last_s = now
        self._unhelped += 1

    def healthy(self, now: float) -> None:
        """The unit is not looping at ``now``: a recovery long enough ago has helped."""
        if self._last_s is not None and now - self._last_s >= self._limits.stable_s:
            self._unhelped = 0
            self.needs_operator = False

    def export(self) -> dict[str, object]:
        """The bookkeeping that must survive a daemon restart (times are monotonic seconds)."""
        return {
            "attempts_without_help": self._unhelped,
            "last_recovery_monotonic_s": self._last_s,
            "needs_operator": self.needs_operator,
        }

    def restore(self, saved: Mapping[str, object], *, same_boot: bool) -> tuple[str, ...]:
        """Take back what ``export`` saved; each malformed value is ignored and named.

        The last recovery's time is a monotonic stamp: from another boot it is dropped (the
        backoff it measured ended with that boot). Returns one line per value left out.
        """
        problems: list[str] = []
        attempts = saved.get("attempts_without_help")
        if _is_count(attempts):
            self._unhelped = attempts
        elif attempts is not None:
            problems.append(f"attempts_without_help is {_kind(attempts)}, not a count")
        last = saved.get("last_recovery_monotonic_s")
        if _is_time(last):
            if same_boot:
                self._last_s = float(last)
        elif last is not None:
            problems.append(f"last_recovery_monotonic_s is {_kind(last)}, not a time")
        operator = saved.get("needs_operator")
        if isinstance(operator, bool):
            self.needs_operator = operator
        elif operator is not None:
            problems.append(f"needs_operator is {_kind(operator)}, not true or false")
        return tuple(problems)


@dataclass(frozen=True, slots=True)
class Interrupted:
    """What a recovery record says about itself and what holds now, for ``resume_problem``."""

    record_boot: object
    """The boot ID the record was written in (from the state file: any JSON)."""
    record_started_s: object
    """Monotonic seconds when the recovery began (from the state file: any JSON)."""
    boot: str | None
    """This boot's ID, None when unknown."""
    now: float
    """Monotonic seconds now."""
    active_state: str | None
    """The unit's ActiveState now, None when systemd could not be asked."""


def resume_problem(found: Interrupted, *, dry_run: bool, within_s: float) -> str | None:
    """Why an interrupted recovery must not be finished, or None when it may.

    A record from another boot, older than ``within_s`` (the longest a recovery can take, plus
    a daemon restart), without the fields that say so, or facing a unit that runs again (someone
    started it) would stop and start a unit nobody asked gpuguard to touch; ``dry_run`` acts on
    nothing, whatever a record from an earlier configuration says.
    """
    if dry_run:
        return "dry_run is set"
    if found.boot is None or found.record_boot != found.boot:
        return "it began in another boot (or the record does not say which)"
    if not _is_time(found.record_started_s):
        return "the record does not say when it began"
    age = found.now - float(found.record_started_s)
    if not 0 <= age <= within_s:
        return f"it began {age:.0f} s ago; only a recovery younger than {within_s:.0f} s is resumed"
    return _unit_problem(found)


def _unit_problem(found: Interrupted) -> str | None:
    """Why the unit is not as the interrupted recovery left it: stopped, or its stop under way.

    The stop is not matched to an invocation: in a restart loop systemd starts a new one every
    few seconds, and the recovery's stop may have met any of them.
    """
    if found.active_state is None:
        return "systemd cannot say what state the unit is in"
    if found.active_state in {"inactive", "failed", "deactivating"}:
        return None
    return f"the unit is {found.active_state}: someone or something started it since"


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_time(value: object) -> TypeGuard[float]:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _kind(value: object) -> str:
    """A JSON value's type, for a warning (never the value: a state file may be hostile)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else "something else"
    )


# What systemd's stop does to the processes of the unit's cgroup, by KillMode= (systemd.kill(5)):
# control-group signals every process in it, SIGTERM then SIGKILL; mixed SIGTERMs the main
# process and SIGKILLs all that remain; process signals the main process only; none signals
# nothing (only ExecStop= runs). Anything else, or not known, is taken as none.
_STOP_KILLS_THE_CGROUP: Final = frozenset({"control-group", "mixed"})


def stop_frees(
    process: ProcessIdentity, kill_mode: str | None, main: ProcessIdentity | None
) -> bool:
    """Whether systemd's stop of the unit kills a process of its cgroup, by its KillMode=.

    Under KillMode=process only the main process: the same process (PID and start time), not
    one that was given its PID between the two reads.
    """
    if kill_mode in _STOP_KILLS_THE_CGROUP:
        return True
    return kill_mode == "process" and main is not None and process == main


def unfreeable(
    kill_plan: KillPlan,
    inventory: Inventory,
    idle_threshold_bytes: int,
    *,
    kill_mode: str | None = None,
    main: ProcessIdentity | None = None,
) -> tuple[str, ...]:
    """What holds the unit's GPUs that neither its stop nor its plan would free, one phrase each.

    A recovery stops the unit and reaps what the plan chose; everything else holding memory on
    the unit's GPUs stays: a spared process outside the unit's cgroup that NVML lists with more
    than the idle threshold (or an unknown amount) - or, inside a PID namespace, where NVML's
    PIDs name nobody here, one holding the device file of a GPU whose memory is credited to its
    holders - and memory used from outside the container. A process the plan spares in the
    unit's own cgroup (another uid's job in a shared service, a protected name) goes with the
    stop only as the unit's ``kill_mode`` says (:func:`stop_frees`: every one with
    control-group or mixed, the main process ``main`` alone with process, none with none or
    when systemd could not say). When any remains, stopping the unit cannot help and only risks
    leaving it down: the daemon asks an operator instead, and the gate's refusal names them.
    """
    request = kill_plan.request
    wanted = request.gpu_set
    gpus = {
        g.reading.index: g for g in inventory.gpus if wanted is None or g.reading.index in wanted
    }
    in_namespace = inventory.containment.foreign_pids
    found = []
    for decision in kill_plan.spared:
        holder = decision.holder
        attribution = holder.attribution
        if (
            attribution.unit == request.unit
            and not attribution.user_unit
            and attribution.container is None
            and not attribution.unknown
            and stop_frees(holder.identity, kill_mode, main)
        ):
            continue
        held = [
            use.gpu_index
            for use in holder.gpus
            if use.gpu_index in gpus
            and (
                (
                    use.listed_by_nvml
                    and (use.used_bytes is None or use.used_bytes > idle_threshold_bytes)
                )
                or (
                    in_namespace
                    and use.holds_device_file
                    and bool(gpus[use.gpu_index].container_bytes)
                )
            )
        ]
        if held:
            found.append(
                f"PID {holder.pid} ({escape(holder.comm)}) on GPU "
                f"{','.join(map(str, held))}: {decision.reason}"
            )
    found.extend(
        f"GPU {index}: {gpu.outside_bytes // 2**20} MiB used from outside this container"
        for index, gpu in gpus.items()
        if gpu.outside_bytes
    )
    return tuple(found)
