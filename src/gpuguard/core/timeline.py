"""One unit's incident, told from its journal: entries in, a timeline out (pure: no I/O, no clock).

``gpuguard explain`` works after the fact, from the journal alone, so who wrote an entry decides
what it may say (docs/security.md):

* **systemd**: PID 1's entries about the unit, only as journald's trusted fields prove them
  (``events.is_trusted``): a unit that prints a MESSAGE_ID, or ``logger --journald`` with
  ``UNIT=``, forges nothing here. Its text-only lines "Killing process N (comm) with signal
  SIGKILL." and "Unit process N (comm) remains running after unit stopped." name what systemd
  killed and what outlived the run.
* **unit**: the unit's own output (``_SYSTEMD_UNIT``, not PID 1), kept only when it matches a
  start-failure signature (``events.START_FAILURE_SIGNATURES``), labelled with the one the
  daemon's classifier picks (the most specific, ``startfailure.classify``). The unit chooses
  that text: it is shown as the unit's word, never as systemd's or gpuguard's. The gate's
  verdict reaches the unit's output too (the drop-in's client prints it), but there the unit
  could print the same words: it is never read from there.
* **gpuguard**: the daemon's structured JSON lines, only from ``gpuguard.service`` running as
  root (``_SYSTEMD_UNIT``, ``_UID``: journald's fields), and the gate server's own lines about
  gate and reap requests from ``gpuguard-gate.service`` (``gpuguard-gate@….service``, one
  instance per request, before 0.1.0-3): "accepted", each line it sent the client (the gate's
  verdict, the reaper's signals) and the exit status.
* **kernel**: Xids (``xidevents``), only with ``_TRANSPORT=kernel``.

Every text shown is escaped (``gpuguard.escaping``) and cut; every parser is bounded and never
raises. Time is the journal's per-boot monotonic stamp; rows of several boots are told boot by
boot, each in its own order.

The incident is judged by the daemon's own pure detector and recovery planner, replayed over
systemd's events (``_replay``): the same code on the same entries gives the same verdict. When
gpuguard left no line at all (it was not installed yet, or not running), the replay says what
gpuguard would have decided, and only what the ownership rule (``core.policy``) would have let it
do: a recovery is said to free the GPUs only when the journal shows a holder the rule allows (a
process systemd saw in the unit's cgroup), never for holders outside it with no provenance. When
the daemon's verdicts are in the journal, each is compared with the replay at the same moment,
and a difference is printed with its reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Final

from gpuguard.core.detector import Cause, Detector, LoopSettings, asks_for_judgement
from gpuguard.core.enginelines import BY_KEY
from gpuguard.core.escaping import escape
from gpuguard.core.events import (
    OUTPUT_KINDS,
    EventKind,
    UnitEvent,
    decode_message,
    is_trusted,
    parse_entry,
)
from gpuguard.core.recovery import Action, RecoveryLimits, RecoveryPlanner
from gpuguard.core.startfailure import named_holders
from gpuguard.core.xidevents import MalformedXid, parse_kernel_entry

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

SYSTEMD: Final = "systemd"
UNIT: Final = "unit"
GPUGUARD: Final = "gpuguard"
KERNEL: Final = "kernel"
WOULD: Final = "would"
"""Sources of a row: who wrote it (``would``: gpuguard's replayed decision, not a journal line)."""

DAEMON_UNIT: Final = "gpuguard.service"
GATE_SERVER_UNIT: Final = "gpuguard-gate.service"
#: The per-connection instances that served requests before 0.1.0-3 (an older journal).
GATE_SERVER_PREFIX: Final = "gpuguard-gate@"
GATE_LINE_PREFIX: Final = "gpuguard gate: "
_TEXT_LIMIT: Final = 300
_JSON_LIMIT: Final = 64 * 1024
_SCAN: Final = 4096
_SHORT_ID: Final = 8
_KILLING = re.compile(
    r"Killing process (?P<pid>\d{1,10}) \((?P<comm>.{0,64}?)\) "
    r"with signal SIG(?P<sig>[A-Z0-9+-]{1,12})\."
)
_REMAINS = re.compile(
    r"Unit process (?P<pid>\d{1,10}) \((?P<comm>.{0,64}?)\) remains running after unit stopped\."
)
# After "<command> for U from PID ": the PID, then the acceptance or a line the request said.
_GATE_SERVER_LINE = re.compile(r"\d{1,10}(?: \(uid \d{1,10}, .{0,400}\): accepted$|: (?P<said>.+))")
_GATE_EXIT = re.compile(r"exit \d{1,3}")
_FAILED_RUN_KINDS: Final = frozenset({EventKind.FAILED, EventKind.START_FAILED})
# The daemon's log events worth a row, and the fields that say what it decided or did.
_DAEMON_EVENTS: Final = frozenset(
    {
        "restart loop",
        "needs operator",
        "needs operator: gpuguard cannot prove who holds the GPUs",
        "verdict",
        "dry run: would recover",
        "recovery: stopping unit",
        "resuming interrupted recovery",
        "interrupted recovery not resumed",
        "recovery finished",
        "survivors of an ended run",
        "next run started",
        "signal",
        "reap outcome",
        "engine dead",
        "engine dead: decision",
        "start stuck",
    }
)
_DAEMON_FIELDS: Final = (
    "reason",
    "cause",
    "action",
    "action_reason",
    "result",
    "problem",
    "reaped",
    "pids",
    "summary",
    "findings",
    "command",
    "blockers",
)
# The reaper's lines: what was signalled first (the reason is long: it comes last).
_REAP_FIELDS: Final = ("signal", "pid", "outcome", "signals", "detail", "command", "reason")
_REAP_EVENTS: Final = frozenset({"signal", "reap outcome"})
_FIELD_CHARS: Final = 100
# gpuguard's rows told in the table only: single signals, the daemon's every-event verdicts, the
# gate server's acceptances, exits and the reaper lines it copied (its verdicts are the story).
_TABLE_ONLY: Final = frozenset(
    {"signal", "reap-outcome", "verdict", "gate-server", "gate-said", "reap-said"}
    | {"gate-exit", "reap-exit"}
)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the story: when, who said it, what kind of thing, and the escaped text."""

    monotonic_s: float
    realtime_s: float | None
    boot_id: str | None
    source: str
    kind: str
    text: str
    run: str | None = None
    """The invocation ID the row belongs to, when the entry names one."""


@dataclass(frozen=True, slots=True)
class Story:
    """The incident in a few sentences, built from the rows: what people ask first."""

    stop_timeouts: tuple[str, ...]
    sigkilled: tuple[str, ...]
    survivors: tuple[str, ...]
    """One line per distinct PID systemd or gpuguard saw outlive a run (a PID systemd names
    three times is one line), then gpuguard's sweep summaries, which name no PID."""
    failed_starts: tuple[str, ...]
    gpuguard: tuple[str, ...]
    would: tuple[str, ...]
    healthy: str | None
    start_limit: tuple[str, ...] = ()
    """Each start-limit hit: a loop systemd ended, and what to do."""
    operator: tuple[str, ...] = ()
    """Stop jobs (an operator's ``stop`` or ``restart``, a conflict, gpuguard): never a loop."""
    findings: tuple[str, ...] = ()
    """What is no loop but worth a look: left-overs found at a start."""
    survivor_pids: int = 0
    """How many distinct PIDs ``survivors`` names (its PID-less lines not counted)."""
    verdict: str = ""
    """The detector's verdict on the newest entries, replayed (the daemon's own code)."""
    disagreements: tuple[str, ...] = ()
    """Where a verdict the daemon logged differs from the replay at the same moment, and why."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """The rows of one unit, oldest first, and the story they tell."""

    unit: str
    rows: tuple[Row, ...]
    story: Story
    gpuguard_seen: bool
    """Whether gpuguard itself left a trusted line (else ``story.would`` is the replay)."""


@dataclass(slots=True)
class _Acc:
    """What the rows add up to while they are read (private)."""

    rows: list[Row] = field(default_factory=list)
    events: list[UnitEvent] = field(default_factory=list)
    seen: set[tuple[str, str | None, str]] = field(default_factory=set)
    daemon: list[_DaemonSaid] = field(default_factory=list)
    """The daemon's verdicts (looping or not) and its finished recoveries, for the replay."""
    named: dict[int, None] = field(default_factory=dict)
    """The holders every out-of-memory line names (also the lines not shown: one per run)."""


@dataclass(frozen=True, slots=True)
class _DaemonSaid:
    """A daemon line the replay compares with (``looping``) or follows (a recovery's reset)."""

    monotonic_s: float
    realtime_s: float | None
    boot_id: str | None
    looping: bool | None
    """None: a finished recovery that restarted the unit (the daemon then resets its count)."""
    reason: str
    read_through_s: float | None = None
    """The newest journal moment the daemon had read when it judged (its line's
    ``read_through_s``); None in lines of older versions, then the line's own moment counts."""

    @property
    def judged_s(self) -> float:
        """The moment up to which the replay feeds entries before comparing."""
        return self.monotonic_s if self.read_through_s is None else self.read_through_s


def build(
    entries: Iterable[Mapping[str, object]],
    unit: str,
    *,
    loop: LoopSettings | None = None,
    limits: RecoveryLimits | None = None,
) -> Timeline:
    """The timeline of ``unit`` from journal entries in any order (journalctl's JSON objects).

    ``loop`` and ``limits`` are the daemon's settings, used only to say what gpuguard would
    have done when it left no line itself.
    """
    acc = _Acc()
    cursors: set[str] = set()
    for entry in entries:
        cursor = entry.get("__CURSOR") if isinstance(entry, dict) else None
        if isinstance(cursor, str):
            if cursor in cursors:
                continue  # two queries that both match an entry print it twice
            cursors.add(cursor)
        _read(entry, unit, acc)
    rows = sorted(acc.rows, key=_order(acc.rows))
    events = sorted(acc.events, key=_order(acc.events))
    gpuguard_seen = any(row.source == GPUGUARD for row in rows)
    holders = _holders_seen(rows, events, acc.named)
    replayed = _replay(events, unit, loop, limits, holders=holders, daemon=acc.daemon, rows=rows)
    would = () if gpuguard_seen else replayed.would
    rows += [row for row, _ in would]
    rows.sort(key=_order(rows))
    story = _story(rows, events, tuple(text for _, text in would), replayed, holders)
    return Timeline(unit, tuple(rows), story, gpuguard_seen)


def _order(
    items: Sequence[Row | UnitEvent | _DaemonSaid],
) -> Callable[[Row | UnitEvent | _DaemonSaid], tuple[float, str, float]]:
    """A sort key: boots in the order of their first wall-clock stamp, then monotonic time."""
    first: dict[str | None, float] = {}
    for item in items:
        stamp = item.realtime_s if item.realtime_s is not None else float("inf")
        first[item.boot_id] = min(first.get(item.boot_id, stamp), stamp)

    def key(item: Row | UnitEvent | _DaemonSaid) -> tuple[float, str, float]:
        return (first.get(item.boot_id, float("inf")), item.boot_id or "", item.monotonic_s)

    return key


def _read(entry: Mapping[str, object], unit: str, acc: _Acc) -> None:
    """Add the row (and event) one entry gives, if any; never raises for what it holds."""
    if not isinstance(entry, dict):
        return
    event = parse_entry(entry, unit)
    if event is not None:
        _event_row(event, acc)
        return
    where = _where(entry)
    if where is None:
        return
    if entry.get("_TRANSPORT") == "kernel":
        _kernel_row(entry, where, acc)
    elif is_trusted(entry, unit):
        _systemd_text_row(entry, where, acc)
    elif _string(entry, "_UID") == "0" and _string(entry, "_PID") != "1":
        _gpuguard_row(entry, unit, where, acc)


def _where(entry: Mapping[str, object]) -> tuple[float, float | None, str | None] | None:
    monotonic = _micros(entry.get("__MONOTONIC_TIMESTAMP"))
    if monotonic is None:
        return None
    return monotonic, _micros(entry.get("__REALTIME_TIMESTAMP")), _string(entry, "_BOOT_ID")


def _event_row(event: UnitEvent, acc: _Acc) -> None:
    """A lifecycle event (systemd) or a start-failure signature (the unit's output)."""
    run = event.invocation_id
    if event.kind is EventKind.GPU_OOM_OUTPUT:
        acc.named.update(dict.fromkeys(named_holders(event.message)))
        signature = event.signature or "start-failure signature"
        key = ("oom", run, signature)
        if key in acc.seen:
            return  # every rank prints it: the first line of each kind per run tells the story
        acc.seen.add(key)
        acc.events.append(event)
        text = f"[{signature}] {event.message}"
        acc.rows.append(_row(event, UNIT, event.kind.value, text))
        return
    if event.kind in OUTPUT_KINDS:  # an engine's fatal or phase line (core.enginelines)
        line = BY_KEY.get(event.line or "")
        key = (event.kind.value, run, event.line or "")
        if line is None or key in acc.seen:
            return  # every rank prints it: the first of each kind per run tells the story
        acc.seen.add(key)
        acc.rows.append(_row(event, UNIT, event.kind.value, f"[{line.cause}] {event.message}"))
        return
    acc.events.append(event)
    acc.rows.append(_row(event, SYSTEMD, event.kind.value, event.message))


def _row(event: UnitEvent, source: str, kind: str, text: str) -> Row:
    return Row(
        event.monotonic_s,
        event.realtime_s,
        event.boot_id,
        source,
        kind,
        escape(text, _TEXT_LIMIT),
        event.invocation_id,
    )


def _systemd_text_row(
    entry: Mapping[str, object], where: tuple[float, float | None, str | None], acc: _Acc
) -> None:
    """PID 1's text-only lines about the processes it killed and those that outlived the run."""
    text = decode_message(entry.get("MESSAGE"), limit=_SCAN)
    if text is None:
        return
    run = _string(entry, "INVOCATION_ID")
    for pattern, kind in ((_KILLING, "killed"), (_REMAINS, "remains-running")):
        match = pattern.search(text)
        if match is None:
            continue
        key = (kind, run, match["pid"])
        if key in acc.seen:
            return  # systemd logs each kill of the cgroup's processes twice
        acc.seen.add(key)
        acc.rows.append(Row(*where, SYSTEMD, kind, escape(text, _TEXT_LIMIT), run))
        return


def _gpuguard_row(  # noqa: PLR0911 - one return per kind of line that is not gpuguard's
    entry: Mapping[str, object],
    unit: str,
    where: tuple[float, float | None, str | None],
    acc: _Acc,
) -> None:
    """The daemon's JSON line about ``unit``, or the gate server's acceptance of a request."""
    owner = _string(entry, "_SYSTEMD_UNIT") or ""
    text = decode_message(entry.get("MESSAGE"), limit=_JSON_LIMIT)
    if text is None:
        return
    if owner == GATE_SERVER_UNIT or owner.startswith(GATE_SERVER_PREFIX):
        kind = _gate_server_kind(text, unit)
        if kind is not None:
            acc.rows.append(Row(*where, GPUGUARD, kind, escape(text, _TEXT_LIMIT)))
        return
    if owner != DAEMON_UNIT or not text.startswith("{"):
        return
    try:
        line = json.loads(text)
    except (ValueError, RecursionError):
        return
    if not isinstance(line, dict):
        return
    event, reason = line.get("event"), line.get("reason")
    if not isinstance(event, str) or event not in _DAEMON_EVENTS:
        return
    # The reaper's lines name the holder's own unit; its reason names the run it came from.
    named = isinstance(reason, str) and f" {unit} " in f" {reason[:_SCAN]} "
    if line.get("unit") != unit and not named:
        return
    _note_daemon(line, unit, where, acc)
    keys = _REAP_FIELDS if event in _REAP_EVENTS else _DAEMON_FIELDS
    parts = [f"{key}={_shown(line[key])}" for key in keys if line.get(key) is not None]
    kind = event.replace(": ", "-").replace(" ", "-")
    said = f"{event}: {' '.join(parts)}" if parts else event
    acc.rows.append(Row(*where, GPUGUARD, kind, escape(said, _TEXT_LIMIT)))


def _note_daemon(
    line: Mapping[str, object],
    unit: str,
    where: tuple[float, float | None, str | None],
    acc: _Acc,
) -> None:
    """Keep the daemon's verdicts on ``unit`` and its restarting recoveries for the replay."""
    if line.get("unit") != unit:
        return
    looping = line.get("looping")
    if isinstance(looping, bool):
        through = line.get("read_through_s")
        read_through = (
            float(through)
            if isinstance(through, (int, float))
            and not isinstance(through, bool)
            and 0 <= through <= where[0]
            else None
        )
        acc.daemon.append(
            _DaemonSaid(*where, looping, _shown(line.get("reason", "")), read_through)
        )
    elif line.get("event") == "recovery finished" and line.get("result") == "restarted":
        acc.daemon.append(_DaemonSaid(*where, None, "recovery finished: restarted"))


def _gate_server_kind(text: str, unit: str) -> str | None:
    """What a gate server line about ``unit`` is; None when it is about another unit.

    Its acceptance, the verdict, the exit, or another line it sent the client (the reaper's).
    The server writes "<gate|reap> for U from PID N (uid …): accepted", then each line the
    request sent the client's standard error as "… from PID N: <line>", then "… : exit N".
    """
    for command in ("gate", "reap"):
        head = f"{command} for {unit} from PID "
        if not text.startswith(head):
            continue
        match = _GATE_SERVER_LINE.match(text, len(head))
        if match is None:
            return None
        said = match["said"]
        if said is None:
            return "gate-server"
        if _GATE_EXIT.fullmatch(said):
            return f"{command}-exit"
        if said.startswith((GATE_LINE_PREFIX, "gpuguard reap")):
            return f"{command}-verdict"
        return f"{command}-said"
    return None


def _kernel_row(
    entry: Mapping[str, object], where: tuple[float, float | None, str | None], acc: _Acc
) -> None:
    parsed = parse_kernel_entry(entry)
    if parsed is None:
        return
    if isinstance(parsed, MalformedXid):
        acc.rows.append(Row(*where, KERNEL, "xid-malformed", f"{parsed.reason}: {parsed.excerpt}"))
        return
    who = "" if parsed.pid is None else f", pid {parsed.pid} ({parsed.name or '?'})"
    text = f"Xid {parsed.code} on {parsed.pci_bus_id}{who}: {parsed.detail}"
    acc.rows.append(Row(*where, KERNEL, "xid", escape(text, _TEXT_LIMIT)))


@dataclass(frozen=True, slots=True)
class _Holders:
    """Who the journal shows holding on after a run, as the ownership rule would see them."""

    in_cgroup: tuple[int, ...]
    """PIDs systemd saw in the unit's cgroup after a run (remains running, left over at start):
    the unit's, if they run as its ``User=``."""
    named_outside: tuple[int, ...]
    """PIDs the server's out-of-memory lines name as holders that systemd never saw in the
    cgroup: outside it, and without gpuguard's ledger nothing proves they are the unit's."""


@dataclass(frozen=True, slots=True)
class _Replayed:
    """What the replay concluded: the would-rows, the final verdict, the disagreements."""

    would: tuple[tuple[Row, str], ...]
    verdict: str
    disagreements: tuple[str, ...]
    findings: tuple[str, ...]


_SURVIVOR_PID = re.compile(r"(?:process|Process) (\d{1,10}) \(|\bpid=(\d{1,10})\b")


def _holders_seen(
    rows: Sequence[Row], events: Sequence[UnitEvent], named_by_server: Iterable[int]
) -> _Holders:
    in_cgroup = dict.fromkeys(
        event.pid
        for event in events
        if event.kind is EventKind.LEFT_OVER_PROCESS and event.pid is not None
    )
    for row in rows:
        if row.kind == "remains-running" and (match := _SURVIVOR_PID.search(row.text)):
            in_cgroup[int(match[1])] = None
    named = tuple(pid for pid in named_by_server if pid not in in_cgroup)
    return _Holders(tuple(in_cgroup), named)


def _replay(  # noqa: PLR0913 - the daemon's settings, what the journal shows, what it said
    events: list[UnitEvent],
    unit: str,
    loop: LoopSettings | None,
    limits: RecoveryLimits | None,
    *,
    holders: _Holders,
    daemon: Sequence[_DaemonSaid],
    rows: Sequence[Row],
) -> _Replayed:
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
    pending = sorted(daemon, key=_order(daemon))
    differ: list[str] = []
    findings: dict[str, None] = {}
    acted = False
    for event in events:
        while pending and _before(pending[0], event):
            _compare(detector, pending.pop(0), differ)
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
            escape(text, _TEXT_LIMIT * 3),
            event.invocation_id,
        )
        if all(row.text != earlier for _, earlier in said):  # a loop judged again says it once
            said.append((row, row.text))
        acted = action is Action.RECOVER  # what it would have changed, none can say
    for left in pending:
        _compare(detector, left, differ)
    final = detector.diagnose(_newest(events, rows), None) if events else None
    if final is None:
        verdict = "no lifecycle event of the unit in the journal"
    else:
        verdict = ("restart loop: " if final.looping else "no loop: ") + final.reason
    return _Replayed(tuple(said), escape(verdict, _TEXT_LIMIT * 2), tuple(differ), tuple(findings))


def _newest(events: Sequence[UnitEvent], rows: Sequence[Row]) -> float:
    """The newest moment the journal shows in the last event's boot: the verdict is judged then.

    The daemon judges on its timer too: a run that stayed up for ``stable_s`` is healthy.
    """
    boot = events[-1].boot_id
    return max([events[-1].monotonic_s, *(r.monotonic_s for r in rows if r.boot_id == boot)])


def _before(said: _DaemonSaid, event: UnitEvent) -> bool:
    """Whether the daemon judged before ``event`` (same boot: by the monotonic clock).

    What it judged is what it had read (``judged_s``): entries that reached the journal while it
    was busy sweeping come after its verdict, however early their own stamps.
    """
    return said.boot_id != event.boot_id or said.judged_s < event.monotonic_s


def _compare(detector: Detector, said: _DaemonSaid, differ: list[str]) -> None:
    """Judge as the daemon did at its line; note a different verdict, or reset as it did."""
    if said.looping is None:
        detector.reset(said.monotonic_s)
        return
    mine = detector.diagnose(said.monotonic_s, None)
    if mine.looping == said.looping:
        return
    differ.append(
        f"at {_clock(said.realtime_s)} the daemon said {'a' if said.looping else 'no'} restart "
        f"loop ({said.reason}); replayed from the journal: "
        f"{'a' if mine.looping else 'no'} loop ({mine.reason}). Why they can differ: the daemon "
        "had entries the journal range here does not (set --since earlier), or its settings "
        "differ from this configuration's"
    )


def _what_it_could_reap(  # noqa: PLR0911 - one sentence per case of what the journal shows
    cause: Cause, action: Action, holders: _Holders, unit: str
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


def _story(
    rows: list[Row],
    events: list[UnitEvent],
    would: tuple[str, ...],
    replayed: _Replayed,
    holders: _Holders,
) -> Story:
    stops = [f"{_short(r.run)}: {r.text}" for r in rows if r.kind == EventKind.STOP_TIMED_OUT]
    killed = [r.text for r in rows if r.kind == "killed"]
    ours = [r.text for r in rows if r.source == GPUGUARD and r.kind not in _TABLE_ONLY]
    survivors = _survivors(rows, holders)
    return Story(
        stop_timeouts=tuple(stops),
        sigkilled=tuple(killed),
        survivors=tuple(survivors),
        survivor_pids=sum(line.startswith("PID ") for line in survivors),
        failed_starts=tuple(_failed_starts(rows, events)),
        gpuguard=tuple(ours),
        would=would,
        healthy=_healthy(events, rows),
        start_limit=tuple(_start_limit(events)),
        operator=tuple(_operator(events)),
        findings=replayed.findings,
        verdict=replayed.verdict,
        disagreements=replayed.disagreements,
    )


def _survivors(rows: list[Row], holders: _Holders) -> list[str]:
    """One line per distinct PID that outlived a run, with everything said about it.

    A holder only the server's out-of-memory line names (outside the cgroup: systemd never saw
    it) is one too, said to be the server's word.
    """
    by_pid: dict[str, list[str]] = {}
    other: list[str] = []
    for row in rows:
        systemd = row.kind in {"remains-running", EventKind.LEFT_OVER_PROCESS}
        ours = row.source == GPUGUARD and row.kind in {"reap-outcome", "survivors-of-an-ended-run"}
        if row.kind == EventKind.SURVIVED_SIGKILL:
            other.append(f"run {_short(row.run)}: {row.text}")
            continue
        if not (systemd or ours):
            continue
        swept = _SWEPT_PIDS.search(row.text) if row.kind == "survivors-of-an-ended-run" else None
        match = _SURVIVOR_PID.search(row.text) if swept is None else None
        pids = swept["pids"].split(",") if swept else [match[1] or match[2]] if match else []
        if not pids:
            other.append(row.text)
            continue
        what = _SURVIVOR_WORDS.get(row.kind, row.kind)
        if swept is not None and (summary := row.text.find("summary=")) >= 0:
            what = f"swept by gpuguard's daemon: {row.text[summary + len('summary=') :]}"
        said = f"{what} (run {_short(row.run)})" if row.run else what
        for pid in pids:
            if said not in by_pid.setdefault(pid, []):
                by_pid[pid].append(said)
    lines = [f"PID {pid}: {'; '.join(said)}" for pid, said in by_pid.items()]
    lines += [
        f"PID {pid}: named by the server's out-of-memory line as holding GPU memory (its word); "
        "systemd never saw it in the unit's cgroup"
        for pid in holders.named_outside
        if str(pid) not in by_pid
    ]
    return lines + other


_SURVIVOR_WORDS: Final = {
    "remains-running": "remained running after the run stopped",
    EventKind.LEFT_OVER_PROCESS.value: "left over at the start",
    "reap-outcome": "reaped by gpuguard",
}
_SHOWN_PIDS: Final = 5
_BLOCKED: Final = "its plan could not free the GPUs, so the unit is left as systemd has it"
_SWEPT_PIDS = re.compile(r"\bpids=\[(?P<pids>\d{1,10}(?:,\d{1,10}){0,19})\]")


def _start_limit(events: list[UnitEvent]) -> list[str]:
    """Each start-limit hit: systemd ended a loop; what the operator does next."""
    return [
        f"run {_short(event.invocation_id)}: start request repeated too quickly: systemd ended "
        f"the loop and will not start {escape(event.unit)} again; fix the cause, then "
        f"`systemctl reset-failed {escape(event.unit)}` (and start it)"
        for event in events
        if event.kind is EventKind.START_LIMIT_HIT
    ]


def _operator(events: list[UnitEvent]) -> list[str]:
    """The stop jobs: someone asked for the stop (an operator's stop or restart): never a loop."""
    lines: dict[str | None, str] = {}
    for event in events:
        if event.kind in {EventKind.STOPPING, EventKind.STOPPED} and event.job_type == "stop":
            lines.setdefault(
                event.invocation_id,
                f"run {_short(event.invocation_id)}: stopped by a stop job (an operator's "
                "`systemctl stop` or `restart`, a conflicting unit, or gpuguard): not a failure",
            )
    return list(lines.values())


def _failed_starts(rows: list[Row], events: list[UnitEvent]) -> list[str]:
    """Each run that failed, with the first start-failure signature it printed."""
    said: dict[str | None, str] = {}
    for row in rows:
        if row.kind == EventKind.GPU_OOM_OUTPUT and row.run not in said:
            said[row.run] = row.text
    lines: list[str] = []
    done: set[str | None] = set()
    clean = {e.invocation_id for e in events if e.kind is EventKind.DEACTIVATED}
    asked = {e.invocation_id for e in events if e.job_type == "stop"}
    for event in events:
        restarted = (
            event.kind is EventKind.RESTART_SCHEDULED
            and event.invocation_id in clean
            and event.invocation_id not in asked
        )
        if restarted and event.invocation_id not in done:
            done.add(event.invocation_id)
            lines.append(
                f"run {_short(event.invocation_id)}: exited cleanly and systemd restarted it "
                f"(restart counter at {event.n_restarts}): a server that exits is not serving"
            )
            continue
        if event.kind not in _FAILED_RUN_KINDS or event.invocation_id in done:
            continue
        done.add(event.invocation_id)
        if event.kind is EventKind.FAILED and event.result == "timeout":
            continue  # a stop that timed out: told as such, not as a failed start
        why = f"result '{event.result}'" if event.result else "failed"
        signature = said.get(event.invocation_id)
        lines.append(
            f"run {_short(event.invocation_id)}: {why}"
            + (f"; it printed {signature}" if signature else "; no start-failure signature")
        )
    return lines


def _healthy(events: list[UnitEvent], rows: list[Row]) -> str | None:
    """The newest run that started and did not fail afterwards, as far as the journal goes."""
    ended: set[str | None] = {
        e.invocation_id
        for e in events
        if e.kind in _FAILED_RUN_KINDS or e.kind in {EventKind.DEACTIVATED, EventKind.STOPPED}
    }
    started = [e for e in events if e.kind is EventKind.STARTED]
    if not started or started[-1].invocation_id in ended:
        return None
    run = started[-1]
    last = max((r.monotonic_s for r in rows if r.boot_id == run.boot_id), default=0.0)
    return (
        f"run {_short(run.invocation_id)} started and has not failed since "
        f"({last - run.monotonic_s:.1f} s of journal after its start)"
    )


def _short(run: str | None) -> str:
    return "?" if run is None else escape(run[:_SHORT_ID])


def _shown(value: object) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_shown(item) for item in value[:20]) + "]"
    return escape(str(value)[:_SCAN], _FIELD_CHARS)


def _string(entry: Mapping[str, object], key: str) -> str | None:
    value = entry.get(key)
    return value if isinstance(value, str) else None


def _micros(value: object) -> float | None:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        return int(value) / 1_000_000
    return None


# -- showing it --------------------------------------------------------------------------------

_HEAD_ROWS: Final = 40
_TAIL_ROWS: Final = 40
_STORY_ITEMS: Final = 10
JSON_FORMAT: Final = 1


def render_text(timeline: Timeline, *, since: str | None) -> str:
    """The timeline as docs/e2e.md's tables read: time, seconds since the first row, who, what.

    Times are UTC wall-clock stamps journald took (for people); the ``+s`` column is the
    journal's monotonic clock, from the first row of the same boot. A long middle (a loop of
    hundreds of failed starts) is elided; ``--json`` has every row.
    """
    unit = escape(timeline.unit)
    span = f" since {escape(since, 80)}" if since else " (this boot)"
    if not timeline.rows:
        return f"gpuguard explain: {unit}: nothing in the journal{span}\n"
    lines = [
        f"gpuguard explain: {unit}{span}: {len(timeline.rows)} rows",
        (
            "  systemd = PID 1 (journald's trusted fields); unit = the unit's own output, its "
            "word only; gpuguard = gpuguard.service or gpuguard-gate.service as root; "
            "kernel = Xids; would = gpuguard's detector replayed"
        ),
        "",
        f"  {'TIME (UTC)':<12} {'+S':>8}  {'SOURCE':<8}  {'KIND':<22}  TEXT",
    ]
    rendered = _table(timeline.rows)
    if len(rendered) > _HEAD_ROWS + _TAIL_ROWS:
        hidden = len(rendered) - _HEAD_ROWS - _TAIL_ROWS
        rendered = [
            *rendered[:_HEAD_ROWS],
            f"  {'':12} … {hidden} more rows (see --json) …",
            *rendered[-_TAIL_ROWS:],
        ]
    lines += rendered
    lines += ["", *_story_lines(timeline)]
    return "\n".join(lines) + "\n"


def _table(rows: Sequence[Row]) -> list[str]:
    first: dict[str | None, float] = {}
    out: list[str] = []
    for row in rows:
        base = first.setdefault(row.boot_id, row.monotonic_s)
        out.append(
            f"  {_clock(row.realtime_s):<12} {row.monotonic_s - base:>+8.2f}  {row.source:<8}  "
            f"{row.kind:<22}  {row.text}"
        )
    return out


def _story_lines(timeline: Timeline) -> list[str]:
    story = timeline.story
    lines = ["What happened:"]

    def block(title: str, items: Sequence[str], none: str) -> None:
        if not items:
            lines.append(f"  {title}: {none}")
            return
        lines.append(f"  {title}: {len(items)}")
        lines.extend(f"    {item}" for item in items[:_STORY_ITEMS])
        if len(items) > _STORY_ITEMS:
            lines.append(f"    … {len(items) - _STORY_ITEMS} more (see --json)")

    block("stops that timed out", story.stop_timeouts, "none")
    block("processes systemd SIGKILLed", story.sigkilled, "none")
    if story.survivors and story.survivor_pids != len(story.survivors):
        # Lines without a PID (systemd's "Processes still around after SIGKILL"): not counted.
        lines.append(f"  survivors and left-overs: {story.survivor_pids} PIDs")
        lines.extend(f"    {item}" for item in story.survivors[:_STORY_ITEMS])
        if len(story.survivors) > _STORY_ITEMS:
            lines.append(f"    … {len(story.survivors) - _STORY_ITEMS} more (see --json)")
    else:
        block("survivors and left-overs", story.survivors, "none seen in the journal")
    block("failed starts", story.failed_starts, "none")
    if story.start_limit:
        block("systemd ended a restart loop (start limit)", story.start_limit, "")
    block("stopped on request (never a loop)", story.operator, "none")
    if story.findings:
        block("findings (no loop)", story.findings, "")
    if timeline.gpuguard_seen:
        block("what gpuguard decided and did", story.gpuguard, "only verdicts and signals")
    else:
        lines.append("  gpuguard: left no line in this journal (not installed or not running)")
        block("what gpuguard would have done", story.would, "nothing: no restart loop")
    lines.append(f"  verdict (gpuguard's detector on these entries): {story.verdict}")
    if story.disagreements:
        block("where the daemon's logged verdict differs", story.disagreements, "")
    lines.append(f"  healthy: {story.healthy or 'no run started and stayed up in the journal'}")
    return lines


def to_json(timeline: Timeline, *, since: str | None) -> dict[str, object]:
    """The timeline for tools: every row, and the story."""
    story = timeline.story
    return {
        "format": JSON_FORMAT,
        "unit": timeline.unit,
        "since": since,
        "gpuguard_seen": timeline.gpuguard_seen,
        "rows": [
            {
                "realtime_s": row.realtime_s,
                "monotonic_s": row.monotonic_s,
                "boot_id": row.boot_id,
                "source": row.source,
                "kind": row.kind,
                "run": row.run,
                "text": row.text,
            }
            for row in timeline.rows
        ],
        "story": {
            "stop_timeouts": list(story.stop_timeouts),
            "sigkilled": list(story.sigkilled),
            "survivors": list(story.survivors),
            "survivor_pids": story.survivor_pids,
            "failed_starts": list(story.failed_starts),
            "gpuguard": list(story.gpuguard),
            "would": list(story.would),
            "healthy": story.healthy,
            "start_limit": list(story.start_limit),
            "operator": list(story.operator),
            "findings": list(story.findings),
            "verdict": story.verdict,
            "disagreements": list(story.disagreements),
        },
    }


def _clock(realtime_s: float | None) -> str:
    if realtime_s is None:
        return "?"
    try:
        return datetime.fromtimestamp(realtime_s, timezone.utc).strftime("%H:%M:%S.%f")[:12]
    except (OverflowError, OSError, ValueError):
        return "?"
