"""The restart gate: free a unit's GPUs of stale holders and wait until they are idle.

Runs as ``ExecStartPre=`` of the watched unit, so a start never meets GPU memory held by the
previous run. The loop is written against injected callables (gather, reap, clock, sleep,
report) so it is tested with real processes and with in-memory twins alike; it never signals
anything itself. What waiting cannot change (NVML not answering, a GPU of the set lost or
absent) refuses the start at once; while it waits, it says who holds what at a steady interval,
so a 300 s wait is never silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape
from gpuguard.core.health import reset_reasons
from gpuguard.core.idle import is_idle
from gpuguard.core.leftovers import WatchedUnit
from gpuguard.core.leftovers import blockers as kept_blockers
from gpuguard.core.policy import Decision, PlanRequest, Verdict, plan
from gpuguard.core.reaploop import ReapUntilIdle
from gpuguard.core.values import MIB, NvmlHealth, ReapOutcome, ReapTarget, ReservedSource
from gpuguard.core.xid.faults import blockers as xid_blockers
from gpuguard.core.xid.stuck import named_by, stuck_phrase

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Sequence

    from gpuguard.core.inventory import Holder, Inventory, PartialProcess
    from gpuguard.core.values import ProcessIdentity, ReapResult
    from gpuguard.core.xid.faults import XidFault
    from gpuguard.core.xid.stuck import XidClaim


@dataclass(frozen=True, slots=True)
class GateOutcome:
    """How a gate run ended: passed or not, how long it waited, whom it reaped and spared."""

    unit: str
    passed: bool
    fast_path: bool
    waited_s: float
    reaped: tuple[ReapResult, ...]
    spared: tuple[Decision, ...]
    blockers: tuple[str, ...]
    hopeless: bool = False
    """Refused without waiting out the timeout: waiting could not have made the GPUs idle."""
    way_out: str | None = None
    """The operator's command that frees what the gate keeps (holders only the unit's patterns
    tie to it), named after checking them; None when no reap of the unit's would help."""

    @property
    def message(self) -> str:
        """One line for the journal."""
        unit = self.unit
        if self.passed and self.fast_path:
            return f"GPUs of {unit} idle: start allowed"
        if self.passed:
            return (
                f"GPUs of {unit} idle after {self.waited_s:.1f} s, "
                f"{len(self.reaped)} stale holder(s) reaped: start allowed"
            )
        if self.hopeless:
            return (
                f"start of {unit} refused at once: "
                + "; ".join(self.blockers)
                + ". Waiting cannot help; Restart= retries until the unit's start limit ends it"
                " (gpuguard doctor checks that it does)."
            )
        # The command first: a cut line (journald's LineMax, the gate's limit) still names it.
        step = (
            f" (gpuguard keeps holders that only {unit}'s patterns tie to it: after checking "
            f"them, `{self.way_out}` frees them)"
            if self.way_out
            else ""
        )
        return (
            f"GPUs of {unit} still busy after {self.waited_s:.1f} s{step}: "
            + "; ".join(self.blockers)
            + ". Start refused; Restart= retries until the unit's start limit ends it"
            " (gpuguard doctor checks that it does)."
        )


@dataclass(frozen=True, slots=True)
class GateSettings:
    """What one gate run needs to know."""

    request: PlanRequest
    idle_threshold_bytes: int
    timeout_s: float
    poll_s: float = 0.1
    report_every_s: float = 10.0
    xid_faults: tuple[XidFault, ...] = ()
    """Reset-class kernel Xids since the unit last came up (the daemon's, for an automatic
    restart only: see xid.faults); each on a GPU of the set refuses the start."""
    xid_claims: tuple[XidClaim, ...] = ()
    """Application Xids naming a process (the daemon's): one SIGKILL leaves alive is stuck in
    the driver (xid.stuck), and the start is refused at once rather than waited out."""
    clock_ticks: int = 100
    """The unit of process start times (USER_HZ), to compare them with the Xids' seconds."""
    oom: tuple[int, int] | None = None
    """(CUDA device, NVML index): the GPU the unit's last failed run ran out of memory on, as
    the daemon read it from its output and the unit's CUDA_VISIBLE_DEVICES maps it; its
    blocker comes first and says so."""
    viewer_uid: int | None = None
    """The asker's UID when it is not root: the gate's answer (which the unit's journal keeps)
    names no process of another user to it - no PID, no name, only how many; None: root, who
    is told every holder."""


def hopeless(inventory: Inventory, settings: GateSettings) -> tuple[str, ...]:
    """Why waiting cannot make the set idle: NVML cannot answer, a GPU of the set is gone.

    Gone includes needing a reset: lost, a pending row remap or page retirement, the driver
    asking for it, or a reset-class kernel Xid since the unit last came up. Empty when waiting
    may help. Such a GPU keeps its memory until a reset or
    reboot, and without NVML idleness cannot be known at all: a 300 s wait would only delay the
    same refusal.
    """
    nvml = inventory.nvml
    if nvml.health not in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD):
        return (nvml.reason or f"NVML {nvml.health.value}",)
    gpu_set = settings.request.gpu_set
    missing = sorted((gpu_set or frozenset()) - {g.reading.index for g in inventory.gpus})
    return (
        *(f"GPU {index} is not present" for index in missing),
        *(
            f"GPU {gpu.reading.index}: {gpu.reading.problem or 'lost'}"
            for gpu in inventory.gpus
            if gpu.reading.lost and (gpu_set is None or gpu.reading.index in gpu_set)
        ),
        *(
            f"GPU {gpu.reading.index} needs a reset: " + "; ".join(reasons)
            for gpu in inventory.gpus
            if not gpu.reading.lost
            and (gpu_set is None or gpu.reading.index in gpu_set)
            and (reasons := reset_reasons(gpu.reading))
        ),
        *xid_blockers(settings.xid_faults, [g.reading for g in inventory.gpus], gpu_set),
    )


def set_blockers(
    inventory: Inventory,
    settings: GateSettings,
    *,
    killed: Collection[ProcessIdentity] = frozenset(),
) -> tuple[str, ...]:
    """Why the unit's GPUs are not idle, one phrase per cause; empty means idle.

    ``killed``: holders this wait already SIGKILLed that are not gone: dying, not to be reaped.
    """
    nvml = inventory.nvml
    if nvml.health not in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD):
        return (nvml.reason or f"NVML {nvml.health.value}",)
    gpu_set = settings.request.gpu_set
    wanted = [g for g in inventory.gpus if gpu_set is None or g.reading.index in gpu_set]
    missing = sorted((gpu_set or frozenset()) - {g.reading.index for g in inventory.gpus})
    blockers = [f"GPU {index} is not present" for index in missing]
    for gpu in wanted:
        blockers.extend(
            f"GPU {gpu.reading.index}: {_partial_phrase(other, settings.viewer_uid)} could hold "
            f"it and was not fully inspected: {other.reason}"
            for other in inventory.partial_on(gpu.reading.index)
        )
        if is_idle(gpu.reading, settings.idle_threshold_bytes):
            continue
        reading = gpu.reading
        used = (
            f"{reading.memory.used_bytes // MIB} MiB used"
            if reading.memory
            else (reading.problem or "memory unreadable")
        )
        if reading.memory and reading.memory.reserved_source is ReservedSource.UNCONFIRMED:
            used += (
                " (the v1 reserve estimate is not confirmed yet: a second idle reading a "
                "minute after the first confirms it)"
            )
        holders = [h for pid in gpu.holder_pids if (h := inventory.holder(pid)) is not None]
        shown = [h for h in holders if may_name(h.uids, settings.viewer_uid)]
        phrases = [_holder_phrase(h, settings.request, killed) for h in shown]
        if len(shown) < len(holders):
            phrases.append(_others(len(holders) - len(shown)))
        named = "; ".join(phrases)
        phrase = f"GPU {reading.index}: {used}" + (f", held by {named}" if named else "")
        if settings.oom is not None and settings.oom[1] == reading.index:
            # The GPU the last run failed on: first, so the one-line verdict names it.
            blockers.insert(
                0,
                f"{phrase} (cuda:{settings.oom[0]} of the unit: its last run "
                "ran out of memory there)",
            )
        else:
            blockers.append(phrase)
        if gpu.unattributed_bytes:
            blockers.append(
                f"GPU {reading.index}: {gpu.unattributed_bytes // MIB} MiB that no visible "
                "process explains"
            )
        if gpu.outside_bytes:
            blockers.append(
                f"GPU {reading.index}: {gpu.outside_bytes // MIB} MiB used from outside this "
                "container (another container or the host), which gpuguard cannot reap"
            )
    # A PID whose owner gpuguard cannot tell is named to root only.
    pid = "PID {}" if settings.viewer_uid is None else "a process"
    if not inventory.containment.foreign_pids:
        # Inside a PID namespace NVML's PIDs are host PIDs: the memory lines above say it all.
        blockers.extend(
            f"GPU {gone.gpu_index}: NVML lists PID {gone.pid}, which /proc does not have"
            for gone in inventory.vanished
            if gpu_set is None or gone.gpu_index in gpu_set
        )
        blockers.extend(
            f"GPU {other.gpu_index}: NVML lists {pid.format(other.pid)}, an unrelated process here"
            for other in inventory.foreign
            if gpu_set is None or other.gpu_index in gpu_set
        )
    blockers.extend(
        f"GPU {hidden.gpu_index}: NVML lists {pid.format(hidden.pid)}, which /proc does not let "
        "gpuguard inspect"
        for hidden in inventory.uninspectable
        if gpu_set is None or hidden.gpu_index in gpu_set
    )
    return tuple(blockers)


def may_name(uids: tuple[int, ...], viewer_uid: int | None) -> bool:
    """Whether a process of these UIDs may be named (PID, name) to the viewer.

    Root sees all; another asker only processes wholly its own (every one of the four UIDs).
    """
    return viewer_uid is None or (bool(uids) and all(uid == viewer_uid for uid in uids))


def _others(count: int) -> str:
    return "another user's process" if count == 1 else f"{count} processes of other users"


def _partial_phrase(other: PartialProcess, viewer_uid: int | None) -> str:
    """A process not fully inspected: named to root, to anyone else only as "a process".

    Its UIDs were not read, so it may be another user's.
    """
    if viewer_uid is None:
        return f"PID {other.pid} ({escape(other.comm)}, {escape(other.user)})"
    return "a process"


def wait_until_idle(  # noqa: PLR0913 - the wait's whole world, injected
    settings: GateSettings,
    inventory: Inventory,
    gather: Callable[[], Inventory],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    *,
    wait_s: float,
) -> tuple[Inventory, tuple[str, ...]]:
    """Reap's wait: look again every ``poll_s`` until the set is idle or ``wait_s`` has passed.

    Done early once only live holders the plan keeps remain (``only_kept``): the memory of what
    was reaped is gone, and waiting on a tenant's job would only delay the stop it runs in.
    Reaps nothing (``run_gate`` reaps and waits for a start); returns the last inventory and its
    blockers, empty when the unit's GPUs are idle.
    """
    deadline = clock() + wait_s

    def done(found: Inventory) -> tuple[Inventory, tuple[str, ...]] | None:
        blockers = set_blockers(found, settings)
        if not blockers or clock() >= deadline or only_kept(found, settings):
            return found, blockers
        return None

    return ReapUntilIdle(settings.request, gather, lambda: sleep(settings.poll_s), done).run(
        inventory
    )


def only_kept(inventory: Inventory, settings: GateSettings) -> bool:
    """Every busy GPU of the set is held only by live, fully inspected processes the plan keeps.

    Nothing is on its way out then: no memory unexplained or from outside, no PID NVML lists
    that /proc lacks (a reaped process whose memory the driver has not released yet), nothing
    the plan would still reap.
    """
    if inventory.nvml.health not in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD):
        return False
    gpu_set = settings.request.gpu_set
    if gpu_set is not None and gpu_set - {g.reading.index for g in inventory.gpus}:
        return False
    releasing = [
        *(p.gpu_index for p in inventory.vanished),
        *(p.gpu_index for p in inventory.foreign),
        *(p.gpu_index for p in inventory.uninspectable),
    ]
    if any(gpu_set is None or index in gpu_set for index in releasing):
        return False
    for gpu in inventory.gpus:
        index = gpu.reading.index
        if gpu_set is not None and index not in gpu_set:
            continue
        if inventory.partial_on(index):
            return False
        if is_idle(gpu.reading, settings.idle_threshold_bytes):
            continue
        holders = [inventory.holder(pid) for pid in gpu.holder_pids]
        kept = [h for h in holders if h is not None]
        if (
            gpu.unattributed_bytes
            or gpu.outside_bytes
            or not kept
            or len(kept) < len(holders)
            or any(d.verdict is Verdict.REAP for d in plan(kept, settings.request).decisions)
        ):
            return False
    return True


def _holder_phrase(
    holder: Holder, request: PlanRequest, killed: Collection[ProcessIdentity] = frozenset()
) -> str:
    if holder.identity in killed:
        why = "dying: SIGKILLed, gone once its kernel wait ends"
        return f"PID {holder.pid} ({escape(holder.comm)}, {holder.owner}) - {why}"
    decision = plan([holder], request).decisions[0]
    why = (
        "would be reaped" if decision.verdict is Verdict.REAP else f"not touched: {decision.reason}"
    )
    return f"PID {holder.pid} ({escape(holder.comm)}, {holder.owner}) - {why}"


def run_gate(  # noqa: PLR0913 - the loop's whole world, injected
    settings: GateSettings,
    gather: Callable[[], Inventory],
    reap: Callable[[Sequence[ReapTarget]], tuple[ReapResult, ...]],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    *,
    report: Callable[[str], None] | None = None,
    containers: Callable[[Inventory], bool] | None = None,
) -> GateOutcome:
    """Pass at once when the set is idle; else reap stale holders and wait, up to the timeout.

    Refuses at once when waiting cannot help (see ``hopeless``). While waiting, ``report`` gets
    one line per blocker every ``report_every_s``. ``containers`` stops the unit's left-over
    containers through their engine (adapters/containerstop) and says whether it stopped one.
    """
    unit = settings.request.unit
    started = clock()
    inventory = gather()
    if at_once := hopeless(inventory, settings):
        return outcome(unit, clock() - started, blockers=at_once, hopeless=True)
    if not set_blockers(inventory, settings):
        return outcome(unit, clock() - started, fast_path=True)
    progress = _Progress(settings, report)
    waited = 0.0

    def first(found: Inventory) -> Inventory:
        return gather() if containers is not None and containers(found) else found

    def stuck(results: tuple[ReapResult, ...]) -> GateOutcome | None:
        if at_once := stuck_blockers(results, settings):
            return ended(clock() - started, at_once, hopeless=True)
        return None

    def done(found: Inventory) -> GateOutcome | None:
        nonlocal waited
        waited = clock() - started
        if at_once := hopeless(found, settings):
            return ended(waited, at_once, hopeless=True)
        killed = {
            r.target.identity for r in loop.reaped if "SIGKILL" in r.signals and not r.outcome.gone
        }
        blockers = set_blockers(found, settings, killed=killed)
        if not blockers or waited >= settings.timeout_s:
            way_out = operator_command(found, settings.request) if blockers else None
            return ended(waited, blockers, way_out=way_out)
        progress.tell(waited, blockers)
        return None

    def ended(
        waited_s: float,
        blockers: tuple[str, ...],
        *,
        hopeless: bool = False,
        way_out: str | None = None,
    ) -> GateOutcome:
        return outcome(
            unit,
            waited_s,
            reaped=loop.reaped,
            spared=list(loop.spared.values()),
            blockers=blockers,
            hopeless=hopeless,
            way_out=way_out,
        )

    loop: ReapUntilIdle[GateOutcome] = ReapUntilIdle(
        settings.request,
        gather,
        lambda: sleep(min(settings.poll_s, max(settings.timeout_s - waited, 0.0))),
        done,
        reap=lambda fresh: reap(reap_targets(fresh)),
        first=first,
        after_reap=stuck,
    )
    return loop.run(inventory)


def stuck_blockers(results: Sequence[ReapResult], settings: GateSettings) -> tuple[str, ...]:
    """Reaped processes SIGKILL left alive that an application Xid named: stuck in the driver.

    Waiting for their GPUs to free would only wait out the timeout: no reap will end them.
    """
    found = []
    for result in results:
        if result.outcome is not ReapOutcome.UNKILLABLE:
            continue
        identity = result.target.identity
        started_s = identity.start_time / max(settings.clock_ticks, 1)
        claim = named_by(identity.pid, started_s, settings.xid_claims)
        if claim is not None:
            found.append(
                f"PID {identity.pid} is {stuck_phrase(claim)}: SIGKILL did not end it; its GPU "
                "needs a reset or a reboot"
            )
    return tuple(found)


@dataclass(slots=True)
class _Progress:
    """Says who still blocks the start, one line per blocker, every ``report_every_s``."""

    settings: GateSettings
    sink: Callable[[str], None] | None
    due: float = 0.0

    def __post_init__(self) -> None:
        self.due = self.settings.report_every_s

    def tell(self, waited: float, blockers: Sequence[str]) -> None:
        if self.sink is None or waited < self.due:
            return
        for blocker in blockers:
            self.sink(f"waiting {waited:.0f} s of {self.settings.timeout_s:g} s: {blocker}")
        while self.due <= waited:
            self.due += self.settings.report_every_s


def outcome(  # noqa: PLR0913 - the pieces of one outcome
    unit: str,
    waited_s: float,
    *,
    reaped: Sequence[ReapResult] = (),
    spared: Sequence[Decision] = (),
    blockers: tuple[str, ...] = (),
    hopeless: bool = False,
    fast_path: bool = False,
    way_out: str | None = None,
) -> GateOutcome:
    """The gate's outcome, built here only: it passed when nothing blocks the start."""
    return GateOutcome(
        unit,
        passed=not blockers,
        fast_path=fast_path,
        waited_s=waited_s,
        reaped=tuple(reaped),
        spared=tuple(spared),
        blockers=blockers,
        hopeless=hopeless,
        way_out=way_out,
    )


def operator_command(inventory: Inventory, request: PlanRequest) -> str | None:
    """The patterns reap when every holder the gate keeps on the unit's GPUs matches them.

    ``gpuguard reap --unit U --scope patterns`` (leftovers.blockers); None otherwise.

    Never for a holder that does not look like the unit's: a tenant's job is its owner's.
    """
    unit = WatchedUnit(
        request.unit,
        request.patterns,
        request.gpu_set,
        request.live_invocation,
        request.provenance,
    )
    return kept_blockers(inventory, unit, (unit,), request.protected_names).command


def _system_unit(holder: Holder) -> str | None:
    """The holder's system unit, for the reaper's log lines (explain reads them by unit name).

    A user's own units and containers may take any name, a watched unit's too: never logged as
    one, so a tenant's ``a.service`` cannot pose in ``a.service``'s story.
    """
    where = holder.attribution
    if where.user_unit or where.container is not None or where.unknown:
        return None
    return where.unit


def reap_targets(decisions: Sequence[Decision]) -> list[ReapTarget]:
    """The reaper's view of the holders a plan chose."""
    return [
        ReapTarget(
            identity=d.holder.identity,
            ppid=d.holder.ppid,
            command=d.holder.command,
            unit=_system_unit(d.holder),
            reason=d.reason,
        )
        for d in decisions
    ]
