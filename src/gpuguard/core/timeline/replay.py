"""The incident judged by the daemon's own pure detector and recovery planner, replayed.

The same code on the same entries gives the same verdict. When gpuguard left no line at all (it
was not installed yet, or not running), the replay says what gpuguard would have decided, and
only what the ownership rule (``core.policy``) would have let it do: a recovery is said to free
the GPUs only when the journal shows a holder the rule allows (a process systemd saw in the
unit's cgroup), never for holders outside it with no provenance, and with such a holder it says
*needs operator*, as the daemon does. When the daemon's verdicts are in the journal, each is
compared with the replay at the same moment, and a difference is printed with its reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gpuguard.core.detector import Cause, Detector, GpuEvidence, LoopSettings, asks_for_judgement
from gpuguard.core.escaping import escape
from gpuguard.core.events import (
    EventKind,
    UnitEvent,
)
from gpuguard.core.recovery import Action, RecoveryLimits, RecoveryPlanner
from gpuguard.core.timeline.model import (
    GATE_LINE_PREFIX,
    SURVIVOR_PID,
    TEXT_LIMIT,
    WOULD,
    DaemonSaid,
    Row,
    chronological,
    clock,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence


@dataclass(frozen=True, slots=True)
class Holders:
    """Who the journal shows holding on after a run, as the ownership rule would see them."""

    in_cgroup: tuple[int, ...]
    """PIDs systemd saw in the unit's cgroup after a run (remains running, left over at start):
    the unit's, if they run as its ``User=``."""
    named_outside: tuple[int, ...]
    """PIDs the server's out-of-memory lines name as holders that systemd never saw in the
    cgroup: outside it, and without gpuguard's ledger nothing proves they are the unit's."""


@dataclass(frozen=True, slots=True)
class Replayed:
    """What the replay concluded: the would-rows, the final verdict, the disagreements."""

    would: tuple[tuple[Row, str], ...]
    verdict: str
    disagreements: tuple[str, ...]
    findings: tuple[str, ...]


def holders_seen(
    rows: Sequence[Row], events: Sequence[UnitEvent], named_by_server: Iterable[int]
) -> Holders:
    """Who the journal shows holding on after a run: in the cgroup, or named by the server."""
    in_cgroup = dict.fromkeys(
        event.pid
        for event in events
        if event.kind is EventKind.LEFT_OVER_PROCESS and event.pid is not None
    )
    for row in rows:
        if row.kind == "remains-running" and (match := SURVIVOR_PID.search(row.text)):
            in_cgroup[int(match[1])] = None
    named = tuple(pid for pid in named_by_server if pid not in in_cgroup)
    return Holders(tuple(in_cgroup), named)


def replay_journal(  # noqa: PLR0913 - the daemon's settings, what the journal shows, what it said
    events: list[UnitEvent],
    unit: str,
    loop: LoopSettings | None,
    limits: RecoveryLimits | None,
    *,
    holders: Holders,
    daemon: Sequence[DaemonSaid],
    rows: Sequence[Row],
) -> Replayed:
    """The daemon's detector and planner over these events, as the daemon ran them.

    Its first decision to act, if any, its verdict at the end, and where the daemon's own
    logged verdicts differ.
    The detector judges at each event that ends or starts a run, as the daemon would; with no
    GPU inventory (the journal has none) a loop has a GPU cause only when the unit printed a
    start-failure signature. A finished recovery of the daemon resets the count, as it does.
    """
    detector = Detector(unit, loop)
    planner = RecoveryPlanner(limits or RecoveryLimits())
    said: list[tuple[Row, str]] = []
    last: tuple[bool, Action | None] = (False, None)
    pending = sorted(daemon, key=chronological(daemon))
    differ: list[str] = []
    findings: dict[str, None] = {}
    acted = False
    for index, event in enumerate(events):
        while pending and _before(pending[0], event):
            said_now = pending.pop(0)
            was_idle = _left_idle(events[:index], rows, unit, until_s=said_now.monotonic_s)
            _compare(detector, said_now, differ, idle=was_idle)
        detector.observe(event, live=False)
        if not asks_for_judgement(event.kind):
            continue
        diagnosis = detector.diagnose(event.monotonic_s, None)
        findings.update(dict.fromkeys(diagnosis.findings))
        if acted:
            continue
        decision = planner.decide(diagnosis, event.monotonic_s)
        # The daemon stops a unit only when its plan can free the GPUs: never with a holder no
        # rule lets it reap (daemon: "needs operator: gpuguard cannot prove who holds the GPUs").
        blocked = decision.action is Action.RECOVER and bool(holders.named_outside)
        action = Action.NEEDS_OPERATOR if blocked else decision.action
        now = (diagnosis.looping, action)
        if now == last or not diagnosis.looping:
            last = now
            continue
        last = now
        reason = _BLOCKED if blocked else decision.reason
        text = (
            f"gpuguard would have acted: {action.value} ({diagnosis.cause.value}): {reason}"
        ) + _what_it_could_reap(diagnosis.cause, decision.action, holders, unit)
        row = Row(
            event.monotonic_s,
            event.realtime_s,
            event.boot_id,
            WOULD,
            action.value,
            escape(text, TEXT_LIMIT * 3),
            event.invocation_id,
        )
        if all(row.text != earlier for _, earlier in said):  # a loop judged again says it once
            said.append((row, row.text))
        acted = action is Action.RECOVER  # what it would have changed, none can say
    for left in pending:
        _compare(detector, left, differ, idle=_left_idle(events, rows, unit, left.monotonic_s))
    final = detector.diagnose(_newest(events, rows), None) if events else None
    if final is not None and final.looping and _left_idle(events, rows, unit):
        # The gate (or the daemon's sweep) found the GPUs idle after the newest run's left-overs
        # were named: none of those still there holds one. Only the left-over rule reads that;
        # its loop alone goes.
        idle = detector.diagnose(_newest(events, rows), GpuEvidence())
        final = final if idle.looping else idle
        findings.update(dict.fromkeys(idle.findings))
    if final is None:
        verdict = "no lifecycle event of the unit in the journal"
    else:
        verdict = ("restart loop: " if final.looping else "no loop: ") + final.reason
    return Replayed(tuple(said), escape(verdict, TEXT_LIMIT * 2), tuple(differ), tuple(findings))


def _left_idle(
    events: Sequence[UnitEvent], rows: Sequence[Row], unit: str, until_s: float | None = None
) -> bool:
    """Whether the unit's GPUs were found idle after the newest run's first left-over line.

    The gate allows a start only once the unit's GPUs are idle (it reaps what it can prove is
    left over first): the left-overs systemd names again at ``ExecStart=`` hold none of them.
    The daemon's sweep of an ended run's survivors says the same when it found the set idle
    ("GPUs idle at +2.0 s"): the left-overs still there hold nothing. Only gpuguard's own
    lines count (root's ``gpuguard-gate`` unit: a row the reading made ``gate-verdict``; the
    daemon's sweep rows), read where gpuguard puts the verdict. ``until_s``: only rows stamped
    no later (a verdict the daemon logged is compared with what it had done before it).
    """
    if not events:
        return False
    newest = events[-1].invocation_id
    named = [
        e.monotonic_s
        for e in events
        if e.kind is EventKind.LEFT_OVER_PROCESS and e.invocation_id == newest
    ]
    if not named:
        return False
    boot = events[-1].boot_id
    allowed = re.compile(
        rf"gate for {re.escape(unit)} from PID \d{{1,10}}: {re.escape(GATE_LINE_PREFIX)}"
        rf"GPUs of {re.escape(unit)} idle"
        r"(?: after \d{1,10}\.\d s, \d{1,10} stale holder\(s\) reaped)?: start allowed \["
    )
    return any(
        row.boot_id == boot
        and row.monotonic_s >= min(named)
        and (until_s is None or row.monotonic_s <= until_s)
        and (
            (row.kind == "gate-verdict" and allowed.match(row.text) is not None)
            or (row.kind in _SWEEP_ROWS and _SWEPT_IDLE.search(row.text) is not None)
        )
        for row in rows
    )


_SWEEP_ROWS: Final = frozenset({"survivors-of-an-ended-run", "next-run-started"})
# The daemon's sweep summary (core.runend.describe): "...; GPUs idle at +2.0 s", "GPUs idle
# before the restart at ...", never "GPUs not idle".
_SWEPT_IDLE: Final = re.compile(r"summary=[^;]{0,400}; GPUs idle (?:at|before|after) ")


def _newest(events: Sequence[UnitEvent], rows: Sequence[Row]) -> float:
    """The newest moment the journal shows in the last event's boot: the verdict is judged then.

    The daemon judges on its timer too: a run that stayed up for ``stable_s`` is healthy.
    """
    boot = events[-1].boot_id
    return max([events[-1].monotonic_s, *(r.monotonic_s for r in rows if r.boot_id == boot)])


def _before(said: DaemonSaid, event: UnitEvent) -> bool:
    """Whether the daemon judged before ``event`` (same boot: by the monotonic clock).

    What it judged is what it had read (``judged_s``): entries that reached the journal while it
    was busy sweeping come after its verdict, however early their own stamps.
    """
    return said.boot_id != event.boot_id or said.judged_s < event.monotonic_s


def _compare(detector: Detector, said: DaemonSaid, differ: list[str], *, idle: bool) -> None:
    """Judge as the daemon did at its line; note a different verdict, or reset as it did.

    ``idle``: gpuguard had found the unit's GPUs idle after the newest run's left-overs were
    named (``_left_idle``), as the daemon's own inventory showed it when it judged.
    """
    if said.looping is None:
        detector.reset(said.monotonic_s)
        return
    mine = detector.diagnose(said.monotonic_s, None)
    if mine.looping and idle:
        mine = detector.diagnose(said.monotonic_s, GpuEvidence())
    if mine.looping == said.looping:
        return
    differ.append(
        f"at {clock(said.realtime_s)} the daemon said {'a' if said.looping else 'no'} restart "
        f"loop ({said.reason}); replayed from the journal: "
        f"{'a' if mine.looping else 'no'} loop ({mine.reason}). Why they can differ: the daemon "
        "had entries the journal range here does not (set --since earlier), or its settings "
        "differ from this configuration's"
    )


def _what_it_could_reap(  # noqa: PLR0911 - one sentence per case of what the journal shows
    cause: Cause, action: Action, holders: Holders, unit: str
) -> str:
    """What a recovery could have freed under the ownership rule, from what the journal shows."""
    if action is not Action.RECOVER and cause is not Cause.UNKNOWN:
        return ""
    check = (
        f"check them (`gpuguard reap --unit {unit} --dry-run`), then "
        f"`gpuguard reap --unit {unit} --scope patterns`"
    )
    outside = ", ".join(str(pid) for pid in holders.named_outside[:_SHOWN_PIDS])
    unprovable = (
        f"; but the server names PID {outside} as holding GPU memory and systemd never saw it "
        "in the unit's cgroup: outside it, with no provenance (gpuguard's ledger records a "
        "run's processes only while it runs), no rule lets gpuguard reap it, so a recovery "
    )
    if holders.in_cgroup:
        pids = ", ".join(str(pid) for pid in holders.in_cgroup[:_SHOWN_PIDS])
        proven = (
            f"; systemd saw PID {pids} in the unit's cgroup after a run: the ownership rule lets "
            "gpuguard reap those if they run as the unit's User="
        )
        if holders.named_outside:
            return proven + (
                f"; but PID {outside}, which the server names as holding GPU memory, systemd "
                "never saw in the cgroup: with no provenance no rule lets gpuguard reap it, so "
                "it would not stop the unit, it would need an operator: " + check
            )
        if action is Action.RECOVER:
            return proven
        return proven + ", had they held the unit's GPUs then, it would have recovered"
    if holders.named_outside:
        return unprovable + (
            "would reap nothing: it would not stop the unit, it would need an operator: " + check
        )
    if action is Action.RECOVER:
        return (
            "; the journal shows no holder the ownership rule would let it reap (none systemd "
            "saw in the unit's cgroup): it would recover only if its inventory then proved the "
            "holders the unit's; holders outside the cgroup with no provenance it never touches: "
            + check
        )
    return (
        "; the journal holds no GPU inventory: had the unit's own left-overs (in its cgroup, or "
        "recorded by gpuguard while the run lived) held its GPUs then, it would have recovered; "
        "holders outside the cgroup with no provenance it never touches"
    )


_SHOWN_PIDS: Final = 5
_BLOCKED: Final = "its plan could not free the GPUs, so the unit is left as systemd has it"
