"""Whose left-over a GPU holder is, and what blocks a unit's GPUs: one answer for every view (pure).

``status`` names left-overs, the metrics count them, a restart loop's blockers and the gate's
refusal name the operator's next command: all from here, so they cannot disagree. The kill
policy decides (``policy.plan``, unit scope): a holder it would reap is a *proven* left-over.
A holder it keeps that only its command line ties to a unit is a *suspected* one: never
reaped on that word, named with the command an operator runs after checking it. A process of
any watched unit's running invocation is never a left-over of any unit, and a process in a
watched unit's cgroup is only ever that unit's business.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape
from gpuguard.core.ledger import ledger_evidence
from gpuguard.core.policy import PlanRequest, Scope, Verdict, matching_pattern, plan
from gpuguard.core.protection import is_protected
from gpuguard.core.values import StrEnum, UnitProvenance

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence

    from gpuguard.core.inventory import Holder, Inventory

NOT_ASKED = UnitProvenance("systemd was not asked")
"""The provenance of a unit nobody asked systemd about: nothing of its cgroup is proven."""


@dataclass(frozen=True, slots=True)
class WatchedUnit:
    """A watched unit as every view sees it: its patterns, GPU set, live run and provenance.

    ``gpu_set`` None: all GPUs. ``live_invocation``: the invocation running now (None: not
    running, or systemd could not say: then ``provenance.problem`` says why).
    """

    name: str
    patterns: tuple[str, ...]
    gpu_set: frozenset[int] | None = None
    live_invocation: str | None = None
    provenance: UnitProvenance = NOT_ASKED
    gpu_source: str = ""
    """Where ``gpu_set`` came from ("from config", "CUDA_VISIBLE_DEVICES=2,3", …); empty:
    not resolved (then the set is not judged against the other units')."""


class Kind(StrEnum):
    """How sure gpuguard is that a holder is a unit's left-over."""

    PROVEN = "proven"
    """The unit-scope policy reaps it: the gate and the daemon free it on their own."""
    SUSPECTED = "suspected"
    """Only its command line says so: kept; an operator checks it, then reaps by patterns."""


@dataclass(frozen=True, slots=True)
class LeftOver:
    """A holder named as a watched unit's left-over, how sure that is, and why."""

    holder: Holder
    unit: str
    kind: Kind
    reason: str


def live_owner(holder: Holder, units: Sequence[WatchedUnit]) -> str | None:
    """The watched unit whose running invocation ``holder`` belongs to, if any.

    Its cgroup, or the daemon's ledger, says so; an ``INVOCATION_ID`` that names the live run
    counts outside the cgroup only with the unit's uid, since a process sets its own
    environment (anyone can read a unit's invocation id and pose as its live run). A process in
    a running unit's cgroup whose invocation cannot be read counts as live, as the policy keeps
    it.
    """
    for unit in units:
        live = unit.live_invocation
        if live is None:
            continue
        if ledger_evidence(unit.provenance.ledger, holder.identity) == live:
            return unit.name
        inside = _in_cgroup(holder, unit.name)
        if holder.invocation_id == live and (inside or _runs_as(holder, unit.provenance.uid)):
            return unit.name
        if holder.invocation_id is None and inside:
            return unit.name
    return None


def _runs_as(holder: Holder, uid: int | None) -> bool:
    return uid is not None and set(holder.uids) == {uid}


def left_overs(
    inventory: Inventory,
    units: Sequence[WatchedUnit],
    protected_names: Collection[str],
    container_units: Mapping[str, str] | None = None,
) -> tuple[LeftOver, ...]:
    """Every holder that is some watched unit's left-over, once, proven before suspected.

    ``container_units``: containers the engine confirms are a unit's (``docker:<id12>`` → unit):
    their processes are that unit's business (status says whether the container is left over).
    """
    owned = container_units or {}
    found: dict[int, LeftOver] = {}
    for unit in units:
        for decision in plan(inventory.holders, _request(unit, protected_names)).decisions:
            holder = decision.holder
            proven = decision.verdict is Verdict.REAP and live_owner(holder, units) is None
            if proven and holder.pid not in found:
                found[holder.pid] = LeftOver(holder, unit.name, Kind.PROVEN, decision.reason)
    for unit in units:
        for holder in inventory.holders:
            if holder.pid in found or not _suspect(holder, unit, units, protected_names, owned):
                continue
            pattern = matching_pattern(holder, unit.patterns)
            found[holder.pid] = LeftOver(
                holder,
                unit.name,
                Kind.SUSPECTED,
                f"matches {unit.name}'s pattern {pattern!r} but runs outside it ({holder.owner}); "
                "no evidence ties it to an ended run",
            )
    order = {h.pid: i for i, h in enumerate(inventory.holders)}
    return tuple(sorted(found.values(), key=lambda left: order[left.holder.pid]))


def _suspect(
    holder: Holder,
    unit: WatchedUnit,
    units: Sequence[WatchedUnit],
    protected_names: Collection[str],
    owned: Mapping[str, str],
) -> bool:
    """Matches the unit's patterns on its GPUs, belongs to no watched unit or its container.

    And runs as the unit's user when that is known: another uid is never the unit's.
    """
    if is_protected(holder, protected_names) or holder.kernel_thread:
        return False
    if matching_pattern(holder, unit.patterns) is None or not on_gpus(holder, unit.gpu_set):
        return False
    uid = unit.provenance.uid
    if uid is not None and not _runs_as(holder, uid):
        return False  # another user's process is never the unit's, whatever its name (policy)
    if live_owner(holder, units) is not None or holder.attribution.unknown:
        return False
    if any(_in_cgroup(holder, other.name) for other in units):
        return False
    return (holder.attribution.container or "") not in owned


def needs_history(inventory: Inventory, units: Collection[str]) -> bool:
    """Whether a unit's logged runs could matter to judging ``inventory``.

    Only a holder outside every watched unit's cgroup that carries an INVOCATION_ID is judged
    by the ended runs' ids. Lets status and the metrics skip the journal on an idle host, and
    both ask alike.
    """
    return any(
        holder.invocation_id is not None and not any(_in_cgroup(holder, u) for u in units)
        for holder in inventory.holders
    )


def on_gpus(holder: Holder, gpu_set: frozenset[int] | None) -> bool:
    """Whether ``holder`` uses a GPU of the set (one holding only control nodes counts)."""
    if gpu_set is None or not holder.gpus:
        return True
    return any(use.gpu_index in gpu_set for use in holder.gpus)


def _in_cgroup(holder: Holder, unit: str) -> bool:
    attribution = holder.attribution
    return (
        attribution.unit == unit
        and not attribution.user_unit
        and attribution.container is None
        and not attribution.unknown
    )


def _request(unit: WatchedUnit, protected_names: Collection[str]) -> PlanRequest:
    return PlanRequest(
        unit=unit.name,
        scope=Scope.UNIT,
        patterns=unit.patterns,
        gpu_set=unit.gpu_set,
        protected_names=tuple(protected_names),
        untouchable_pids=frozenset(),
        provenance=unit.provenance,
        live_invocation=unit.live_invocation,
    )


@dataclass(frozen=True, slots=True)
class Blockers:
    """What holds a unit's GPUs that its own gate and the daemon will not free.

    ``holders``: kept processes on the unit's GPUs (not its live run's, not protected), each with
    the policy's reason (another user's: that it is its owner's to stop). ``command``: what an
    operator runs after checking them, only when every one of the unit's user matches the unit's
    patterns; None when some such process is not the unit's by any sign (no gpuguard command
    should end it), when all are other users', or when another watched unit's live run holds
    the GPUs (``live_elsewhere``).
    """

    unit: str
    holders: tuple[tuple[Holder, str], ...]
    command: str | None
    live_elsewhere: tuple[str, ...] = ()

    def phrase(self) -> str:
        """``PID 41 (sglang::schedul, no unit) on GPU 0: <why kept>; …``, names escaped."""
        return "; ".join(
            f"PID {h.pid} ({escape(h.comm)}, {h.owner}) on {_gpus(h)}: {why}"
            for h, why in self.holders
        )


def blockers(
    inventory: Inventory,
    unit: WatchedUnit,
    units: Sequence[WatchedUnit],
    protected: Collection[str],
) -> Blockers:
    """The holders on ``unit``'s GPUs that unit-scope reaping keeps, and the way out.

    ``--scope patterns`` when that scope would reap every one that runs as the unit's user
    (another user's holder, in the unit's own cgroup or not, is named as its owner's to stop:
    no scope reaps it for the unit, and that command spares it). Never ``--scope all``: a
    holder that does not even look like the unit's is somebody else's, stopped by its owner.
    """
    kept: list[tuple[Holder, str]] = []
    ours: list[Holder] = []
    elsewhere: set[str] = set()
    request = _request(unit, protected)
    uid = unit.provenance.uid
    for decision in plan(inventory.holders, request).decisions:
        holder = decision.holder
        if decision.verdict is not Verdict.KEEP or not holder.gpus:
            continue
        if not on_gpus(holder, unit.gpu_set):
            continue
        owner = live_owner(holder, units)
        if owner == unit.name:
            continue
        if owner is not None:
            elsewhere.add(owner)
            continue
        if uid is not None and not _runs_as(holder, uid):
            # Another user's: never the unit's, so no gpuguard command for the unit ends it.
            uids = "/".join(map(str, holder.uids)) or "unknown"
            why = f"runs as uid {uids}, not as {unit.name}'s user (uid {uid}): its owner's to stop"
            kept.append((holder, why))
            continue
        kept.append((holder, decision.reason))
        ours.append(holder)
    by_patterns = plan(inventory.holders, replace(request, scope=Scope.PATTERNS)).to_reap
    freed = {decision.holder.identity for decision in by_patterns}
    patterns_only = bool(ours) and all(h.identity in freed for h in ours)
    command = reap_command(unit.name, Scope.PATTERNS) if patterns_only and not elsewhere else None
    return Blockers(unit.name, tuple(kept), command, tuple(sorted(elsewhere)))


def reap_command(unit: str, scope: Scope) -> str:
    """The operator's command line (the unit name comes from the configuration: a unit name)."""
    return f"gpuguard reap --unit {unit} --scope {scope.value}"


def _gpus(holder: Holder) -> str:
    return "GPU " + ",".join(str(u.gpu_index) for u in holder.gpus)
