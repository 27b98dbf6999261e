"""Who may be killed to free a unit's GPUs: reap, keep or refuse, always with a reason (pure).

The rules refuse first. PID 1 and 2, kernel threads, gpuguard and its ancestors (the gate runs
inside the unit's own cgroup) and protected processes are never touched whatever the scope.
Holders only of GPUs outside the unit's set are kept: two servers often share a host, and one's
gate must never reap the other's workers. Only then does the scope decide.

Provenance before pattern: in unit scope a process outside the unit's cgroup is the unit's only
with positive evidence that it came from an ended run of this unit: its ``INVOCATION_ID`` (set
by systemd for every process of a run and inherited by children) names such a run, and it runs
as the unit's user, so no tenant can hand its own server to the gate by naming it ``sglang``
(and a forged id only exposes processes its own user could kill anyway). An invocation id
belongs to one unit, so two gates never claim one process. The daemon's provenance ledger
(core.ledger) is the same evidence for a process that moved to a cgroup of its own while the run
lived: its (PID, start time) recorded in an ended run, again only with the unit's uid; an
operator's ``adopt`` globs name scopes whose processes are the unit's while nothing of it is
live, never one whose own ``INVOCATION_ID`` names a run of another watched unit (the ledger
knows every watched unit's runs), nor a login session or a ``run-*`` scope (core.adopt).
Processes whose cgroup is unknown,
and everything in the cgroup while systemd's view of the unit is unknown, are never reaped by
unit scope. Command-line patterns reach further only with the explicit ``patterns`` scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuguard.core.adopt import adopting_glob
from gpuguard.core.ledger import ledger_evidence
from gpuguard.core.liverun import live_reason
from gpuguard.core.protection import never_signal
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from gpuguard.core.inventory import Holder
    from gpuguard.core.values import UnitProvenance


class Scope(StrEnum):
    """How far a reap may reach."""

    UNIT = "unit"
    """The unit's own cgroup, plus processes proven to come from its earlier runs."""
    PATTERNS = "patterns"
    """Also any holder whose command matches the unit's patterns, wherever it runs."""
    ALL = "all"
    """Every holder that is not protected: the old `fuser -k /dev/nvidia*`, opt-in only."""


class Verdict(StrEnum):
    """What happens to one holder."""

    REAP = "reap"
    KEEP = "keep"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict on one holder and why."""

    holder: Holder
    verdict: Verdict
    reason: str


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Everything the policy needs besides the holders.

    ``live_invocation`` is the invocation of the unit that is running right now, whose processes
    are live and must be kept; None when nothing of the unit is live (it is stopped, or the gate
    runs before its start, where everything in the cgroup but the gate is left over).
    ``provenance`` is what ties a process outside the cgroup to an ended run of the unit.
    ``only_invocation`` narrows the plan to one ended run's processes (the daemon's sweep of a
    run that just ended): any other process is kept, whatever else would make it stale.
    """

    unit: str
    scope: Scope
    patterns: tuple[str, ...]
    gpu_set: frozenset[int] | None
    protected_names: tuple[str, ...]
    untouchable_pids: frozenset[int]
    provenance: UnitProvenance
    live_invocation: str | None = None
    only_invocation: str | None = None
    adopt: tuple[str, ...] = ()
    """Globs of other cgroups (scopes) the operator says the unit's processes move to."""


@dataclass(frozen=True, slots=True)
class KillPlan:
    """A decision for every holder, in holder order."""

    request: PlanRequest
    decisions: tuple[Decision, ...]

    @property
    def to_reap(self) -> tuple[Decision, ...]:
        """The holders to signal."""
        return tuple(d for d in self.decisions if d.verdict is Verdict.REAP)

    @property
    def spared(self) -> tuple[Decision, ...]:
        """The holders left alone (kept or refused), with reasons."""
        return tuple(d for d in self.decisions if d.verdict is not Verdict.REAP)


def plan(holders: Iterable[Holder], request: PlanRequest) -> KillPlan:
    """Decide for every holder; the result never contains a refused process under REAP.

    A holder kept only for want of its own evidence (outside the unit, no provenance) is reaped
    when its parent is: a TP worker forked by a stale server inherited its device fds and its
    staleness. Only a child in the same cgroup and with the same uids inherits. Refusals and
    the GPU set still win over inheritance.
    """
    decisions = {holder.pid: decide(holder, request) for holder in holders}
    changed = True
    while changed:
        changed = False
        for pid, decision in decisions.items():
            parent = decisions.get(decision.holder.ppid)
            if (
                parent is not None
                and parent.verdict is Verdict.REAP
                and decision.verdict is Verdict.KEEP
                and _outside_gpu_set(decision.holder, request) is None
                and not _in_unit(decision.holder, request.unit)
                and decision.holder.attribution == parent.holder.attribution
                and decision.holder.uids == parent.holder.uids
                and _other_run(decision.holder, request) is None
            ):
                decisions[pid] = Decision(
                    decision.holder,
                    Verdict.REAP,
                    f"child of reaped PID {parent.holder.pid}, holding the GPU it inherited",
                )
                changed = True
    return KillPlan(request, tuple(decisions.values()))


def decide(holder: Holder, request: PlanRequest) -> Decision:
    """One holder's verdict: the refusals, then the GPU set, then the scope."""
    refusal = never_signal(holder, request.protected_names, request.untouchable_pids)
    if refusal is not None:
        return Decision(holder, Verdict.REFUSE, refusal)
    outside = _outside_gpu_set(holder, request)
    if outside is not None:
        return Decision(holder, Verdict.KEEP, outside)
    other = _other_run(holder, request)
    if other is not None:
        return Decision(holder, Verdict.KEEP, other)
    return _by_scope(holder, request)


def _outside_gpu_set(holder: Holder, request: PlanRequest) -> str | None:
    gpu_set = request.gpu_set
    if gpu_set is None or not holder.gpus:
        return None
    used = {use.gpu_index for use in holder.gpus}
    if used & gpu_set:
        return None
    return f"uses only GPU {_indices(used)}, outside {request.unit}'s GPUs {_indices(gpu_set)}"


def _other_run(holder: Holder, request: PlanRequest) -> str | None:
    only = request.only_invocation
    if only is None or only in {holder.invocation_id, _recorded_run(holder, request)}:
        return None
    invocation = holder.invocation_id[:12] if holder.invocation_id else "unknown"
    return f"not of the ended run {only[:12]} of {request.unit} (invocation {invocation})"


def _by_scope(holder: Holder, request: PlanRequest) -> Decision:
    if _in_unit(holder, request.unit):
        return _in_unit_decision(holder, request)
    pattern = matching_pattern(holder, request.patterns)
    owner = holder.owner
    attribution = holder.attribution
    foreign_service = attribution.unit is not None and attribution.unit.endswith(".service")
    if request.scope is Scope.ALL:
        verdict, reason = Verdict.REAP, f"scope all: every unprotected holder ({owner})"
    elif pattern is not None and request.scope is Scope.PATTERNS:
        stranger = _uid_problem(holder, request)
        verdict = Verdict.REAP if stranger is None else Verdict.KEEP
        reason = f"scope patterns: matches {pattern!r} ({owner})"
        if stranger is not None:  # the operator asked for the unit's processes, not a tenant's
            reason += f", but {stranger}: never its"
    elif attribution.unknown:
        verdict = Verdict.KEEP
        reason = "its cgroup could not be read or parsed: owner unknown, never reaped by scope unit"
    elif foreign_service or attribution.container is not None:
        verdict, reason = Verdict.KEEP, f"belongs to {owner}, not {request.unit}"
    else:
        return _provenance_decision(holder, request, pattern)
    return Decision(holder, verdict, reason)


def _recorded_run(holder: Holder, request: PlanRequest) -> str | None:
    """The run of the unit the ledger saw this very process (PID and start time) descend from."""
    return ledger_evidence(request.provenance.ledger, holder.identity)


def _uid_problem(holder: Holder, request: PlanRequest) -> str | None:
    """Why the holder does not run as the unit's user (every uid of it), or None when it does."""
    uid = request.provenance.uid
    if uid is None:
        return f"{request.unit}'s User= could not be resolved to a uid"
    if set(holder.uids) != {uid}:
        uids = "/".join(str(u) for u in holder.uids) or "unknown"
        return f"it runs as uid {uids}, not as {request.unit}'s user (uid {uid})"
    return None


def _moved_decision(holder: Holder, request: PlanRequest, where: str) -> Decision | None:
    """A holder the ledger recorded or an adopted cgroup holds: its verdict, else None.

    The ledger's record of an ended run is evidence wherever the process moved; an adopted
    cgroup (``adopt``) is, while nothing of the unit is live (while it runs, the INVOCATION_ID
    rule decides as for any other cgroup). Either way only with the unit's uid, and never for
    a process of the run systemd runs now (core.liverun): its own ``INVOCATION_ID`` naming the
    live run keeps it, whatever run a late record filed it under.
    """
    unit = request.unit
    recorded = _recorded_run(holder, request)
    glob = adopting_glob(
        None if holder.attribution.user_unit else holder.attribution.unit, request.adopt
    )
    if recorded is None and glob is None:
        return None
    live = live_reason(unit, holder.invocation_id, recorded, request.live_invocation)
    if live is not None:
        return Decision(holder, Verdict.KEEP, live)
    if recorded is None and request.live_invocation is not None:
        return None  # adopted, but the unit runs: only its INVOCATION_ID can tell which run
    if recorded is None and (others := _another_units(holder, request)) is not None:
        return Decision(holder, Verdict.KEEP, f"{where}; {others}")
    problem = _uid_problem(holder, request)
    if problem is not None:
        return Decision(holder, Verdict.KEEP, f"{where}; {problem}")
    uid = request.provenance.uid
    if recorded is not None:
        # "{unit} " with a space after: explain finds the reaper's lines by the unit's name.
        reason = (
            f"left over from an earlier run of {unit} (the ledger saw it descend from run "
            f"{recorded[:12]}, uid {uid}; it moved to {holder.owner})"
        )
    else:
        reason = f"left over from {unit} in a cgroup adopted by {glob!r} (uid {uid})"
    return Decision(holder, Verdict.REAP, reason)


def _another_units(holder: Holder, request: PlanRequest) -> str | None:
    """Why an adopted holder is another watched unit's, or None: never adopted then."""
    if holder.identity in request.provenance.elsewhere:
        return "the ledger recorded it in a run of another unit"
    invocation = holder.invocation_id
    if invocation is not None and invocation in request.provenance.other_runs:
        return (
            f"its INVOCATION_ID {invocation[:12]} names a run of another watched unit: never "
            "adopted"
        )
    return None


def _provenance_decision(holder: Holder, request: PlanRequest, pattern: str | None) -> Decision:
    """A process outside the unit's cgroup: reaped only if it provably came from an ended run."""
    unit = request.unit
    provenance = request.provenance
    invocation = holder.invocation_id
    where = f"not in {unit}'s cgroup ({holder.owner})"
    if pattern is not None:
        where += f"; matching {pattern!r} is no evidence"
    moved = None if provenance.problem is not None else _moved_decision(holder, request, where)
    if moved is not None:
        return moved
    if provenance.problem is not None:
        why = f"systemd's view of {unit} is unknown ({provenance.problem})"
    elif invocation is None:
        why = f"no evidence it came from {unit}: its environment names no INVOCATION_ID"
    elif invocation == request.live_invocation:
        return Decision(holder, Verdict.KEEP, f"live process of the running {unit}")
    elif invocation not in provenance.invocations:
        why = f"its INVOCATION_ID {invocation[:12]} names no ended run of {unit}"
    elif provenance.uid is None:
        why = f"{unit}'s User= could not be resolved to a uid"
    elif set(holder.uids) != {provenance.uid}:
        uids = "/".join(str(uid) for uid in holder.uids) or "unknown"
        why = f"it runs as uid {uids}, not as {unit}'s user (uid {provenance.uid})"
    else:
        return Decision(
            holder,
            Verdict.REAP,
            f"left over from an earlier run of {unit} (invocation {invocation[:12]}, "
            f"uid {provenance.uid}) outside its cgroup",
        )
    return Decision(holder, Verdict.KEEP, f"{where}; {why}")


def _in_unit_decision(holder: Holder, request: PlanRequest) -> Decision:
    problem = request.provenance.problem
    if problem is not None:
        return Decision(
            holder,
            Verdict.KEEP,
            f"systemd's view of {request.unit} is unknown ({problem}): "
            "nothing in its cgroup is reaped",
        )
    stranger = _not_the_units_user(holder, request)
    if stranger is not None:
        return Decision(holder, Verdict.KEEP, stranger)
    live = _live(holder, request)
    if live is not None:
        return Decision(holder, Verdict.KEEP, live)
    invocation = f" (invocation {holder.invocation_id[:12]})" if holder.invocation_id else ""
    return Decision(
        holder, Verdict.REAP, f"left over from an earlier run of {request.unit}{invocation}"
    )


def _not_the_units_user(holder: Holder, request: PlanRequest) -> str | None:
    """Why a process in the unit's cgroup is not the unit's: it runs as another uid.

    A shared service (Debian's ``cron.service`` holds every user's jobs, ``KillMode=process``)
    keeps other users' processes in its cgroup; none of them is ever the unit's left-over, in
    any scope (``all`` included: the cgroup says nothing about them), and nor is anything when
    the unit's ``User=`` cannot be resolved. All four uids must be the unit's (a setuid
    program's real uid is its caller's).
    """
    uid = request.provenance.uid
    unit = request.unit
    if uid is None:
        return f"{unit}'s User= could not be resolved to a uid: nothing in its cgroup is reaped"
    if set(holder.uids) == {uid}:
        return None
    uids = "/".join(str(each) for each in holder.uids) or "unknown"
    return f"runs as uid {uids}, not as {unit}'s user (uid {uid}): never its, even in its cgroup"


def _in_unit(holder: Holder, unit: str) -> bool:
    attribution = holder.attribution
    return (
        attribution.unit == unit
        and not attribution.user_unit
        and attribution.container is None
        and not attribution.unknown
    )


def _live(holder: Holder, request: PlanRequest) -> str | None:
    """Why a process in the unit's cgroup is live and must be kept, or None if it is stale."""
    live = request.live_invocation
    if live is None:
        return None
    if holder.invocation_id is None:
        # vLLM's engine processes zero what /proc shows of their environment (setproctitle):
        # the ledger's record of the run this very process descended from decides then.
        recorded = _recorded_run(holder, request)
        if recorded is None:
            return f"{request.unit} is running and this process's invocation cannot be read"
        if recorded == live:
            return f"live process of the running {request.unit} (ledger)"
        return None
    if holder.invocation_id == live:
        return f"live process of the running {request.unit}"
    return None


COMM_BYTES: Final = 15
"""The longest process name the kernel keeps (TASK_COMM_LEN, 16 bytes with its NUL): /proc's
``comm`` and systemd's "(COMM)" show vLLM's ``VLLM::EngineCore`` as ``VLLM::EngineCor``."""
_CUT_SHOWN_MIN: Final = 8
"""A pattern the kernel's cut hides in part matches only with this many of its bytes shown."""


def matching_pattern(holder: Holder, patterns: Sequence[str]) -> str | None:
    """The first pattern found in the holder's command line or its name, if any."""
    text = " ".join(holder.cmdline) or holder.comm
    return next((p for p in patterns if p and (p in text or name_shows(holder.comm, p))), None)


def name_shows(comm: str, pattern: str) -> bool:
    """Whether a process name as the kernel shows it holds ``pattern``, or its start at the cut.

    A name of ``COMM_BYTES`` bytes may have been cut: ``VLLM::EngineCor`` shows the pattern
    ``VLLM::EngineCore`` up to the cut (at least ``_CUT_SHOWN_MIN`` bytes of it, its beginning,
    ending the name). A shorter name was not cut and must hold the whole pattern.
    """
    if pattern in comm:
        return True
    shown = comm.encode(errors="replace")
    if len(shown) != COMM_BYTES:
        return False
    wanted = pattern.encode(errors="replace")
    longest = min(len(wanted) - 1, COMM_BYTES)
    return any(shown.endswith(wanted[:size]) for size in range(_CUT_SHOWN_MIN, longest + 1))


def _indices(indices: Iterable[int]) -> str:
    return ",".join(str(i) for i in sorted(indices))
