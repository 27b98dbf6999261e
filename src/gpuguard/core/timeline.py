"""One unit's incident, told from its journal: entries in, a timeline out (pure: no I/O, no clock).

``gpuguard explain`` works after the fact, from the journal alone, so who wrote an entry decides
what it may say (docs/security.md):

* **systemd**: PID 1's entries about the unit, only as journald's trusted fields prove them
  (``events.is_trusted``): a unit that prints a MESSAGE_ID, or ``logger --journald`` with
  ``UNIT=``, forges nothing here. Its text-only lines "Killing process N (comm) with signal
  SIGKILL." and "Unit process N (comm) remains running after unit stopped." name what systemd
  killed and what outlived the run.
* **unit**: the unit's own output (``_SYSTEMD_UNIT``, not PID 1), kept only when it matches a
  start-failure signature (``events.START_FAILURE_SIGNATURES``) or is the gate's verdict line
  (``gpuguard gate: …``, which the gate prints into the unit's output). The unit chooses that
  text: it is shown as the unit's word, never as systemd's or gpuguard's.
* **gpuguard**: the daemon's structured JSON lines, only from ``gpuguard.service`` running as
  root (``_SYSTEMD_UNIT``, ``_UID``: journald's fields), and the gate server's "accepted" lines
  for gate and reap requests from ``gpuguard-gate.service`` (``gpuguard-gate@….service``, one
  instance per request, before 0.1.0-3).
* **kernel**: Xids (``xidevents``), only with ``_TRANSPORT=kernel``.

Every text shown is escaped (``gpuguard.escaping``) and cut; every parser is bounded and never
raises. Time is the journal's per-boot monotonic stamp; rows of several boots are told boot by
boot, each in its own order. When gpuguard left no line at all (it was not installed yet, or
not running), the pure detector and recovery planner are replayed over systemd's events to say
what gpuguard would have decided.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Final

from gpuguard.core.detector import Cause, Detector, LoopSettings
from gpuguard.core.enginelines import BY_KEY
from gpuguard.core.escaping import escape
from gpuguard.core.events import (
    OUTPUT_KINDS,
    START_FAILURE_SIGNATURES,
    EventKind,
    UnitEvent,
    decode_message,
    is_trusted,
    parse_entry,
)
from gpuguard.core.recovery import Action, RecoveryLimits, RecoveryPlanner
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
_FAILED_RUN_KINDS: Final = frozenset({EventKind.FAILED, EventKind.START_FAILED})
_JUDGED_AT: Final = frozenset(
    {
        EventKind.FAILED,
        EventKind.START_FAILED,
        EventKind.MAIN_EXITED,
        EventKind.START_LIMIT_HIT,
        EventKind.LEFT_OVER_PROCESS,
        EventKind.STARTED,
    }
)
# The daemon's log events worth a row, and the fields that say what it decided or did.
_DAEMON_EVENTS: Final = frozenset(
    {
        "restart loop",
        "needs operator",
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
    "summary",
)
# The reaper's lines: what was signalled first (the reason is long: it comes last).
_REAP_FIELDS: Final = ("signal", "pid", "outcome", "signals", "detail", "command", "reason")
_REAP_EVENTS: Final = frozenset({"signal", "reap outcome"})
_FIELD_CHARS: Final = 100


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
    failed_starts: tuple[str, ...]
    gpuguard: tuple[str, ...]
    would: tuple[str, ...]
    healthy: str | None


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
    would = () if gpuguard_seen else _replay(events, unit, loop, limits)
    rows += [row for row, _ in would]
    rows.sort(key=_order(rows))
    story = _story(rows, events, tuple(text for _, text in would))
    return Timeline(unit, tuple(rows), story, gpuguard_seen)


def _order(
    items: Sequence[Row | UnitEvent],
) -> Callable[[Row | UnitEvent], tuple[float, str, float]]:
    """A sort key: boots in the order of their first wall-clock stamp, then monotonic time."""
    first: dict[str | None, float] = {}
    for item in items:
        stamp = item.realtime_s if item.realtime_s is not None else float("inf")
        first[item.boot_id] = min(first.get(item.boot_id, stamp), stamp)

    def key(item: Row | UnitEvent) -> tuple[float, str, float]:
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
    elif _string(entry, "_SYSTEMD_UNIT") == unit and _string(entry, "_PID") != "1":
        text = decode_message(entry.get("MESSAGE"), limit=_SCAN) or ""
        at = text.find(GATE_LINE_PREFIX, 0, 200)
        if at >= 0:
            run = _string(entry, "_SYSTEMD_INVOCATION_ID")
            acc.rows.append(Row(*where, UNIT, "gate-said", escape(text[at:], _TEXT_LIMIT), run))
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
        signature = _signature(event.message)
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


def _signature(message: str) -> str:
    """Which server's start-failure signature a line matched (for people)."""
    for signature in START_FAILURE_SIGNATURES:
        if match := re.search(signature.pattern, message):
            return f"{signature.server}: {match.group(0)}"
    return "start-failure signature"


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
        asked = text.startswith((f"gate for {unit} from PID ", f"reap for {unit} from PID "))
        if asked and len(text) < _TEXT_LIMIT:
            acc.rows.append(Row(*where, GPUGUARD, "gate-server", escape(text, _TEXT_LIMIT)))
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
    keys = _REAP_FIELDS if event in _REAP_EVENTS else _DAEMON_FIELDS
    parts = [f"{key}={_shown(line[key])}" for key in keys if line.get(key) is not None]
    kind = event.replace(": ", "-").replace(" ", "-")
    said = f"{event}: {' '.join(parts)}" if parts else event
    acc.rows.append(Row(*where, GPUGUARD, kind, escape(said, _TEXT_LIMIT)))


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


def _replay(
    events: list[UnitEvent],
    unit: str,
    loop: LoopSettings | None,
    limits: RecoveryLimits | None,
) -> tuple[tuple[Row, str], ...]:
    """What the daemon would have decided on these events: its first decision to act, if any.

    The detector judges at each event that ends or starts a run, as the daemon would; with no
    GPU inventory (the journal has none) a loop has a GPU cause only when the unit printed a
    start-failure signature.
    """
    detector = Detector(unit, loop)
    planner = RecoveryPlanner(limits or RecoveryLimits())
    said: list[tuple[Row, str]] = []
    last: tuple[bool, Action | None] = (False, None)
    for event in events:
        detector.observe(event, live=False)
        if event.kind not in _JUDGED_AT:
            continue
        diagnosis = detector.diagnose(event.monotonic_s, None)
        decision = planner.decide(diagnosis, event.monotonic_s)
        now = (diagnosis.looping, decision.action)
        if now == last or not diagnosis.looping:
            last = now
            continue
        last = now
        text = (
            f"gpuguard would have acted: {decision.action.value} ({diagnosis.cause.value}): "
            f"{decision.reason}"
        )
        if diagnosis.cause is Cause.UNKNOWN:
            text += (
                "; the journal holds no GPU inventory: had stale holders held the unit's GPUs "
                "then, it would have recovered"
            )
        row = Row(
            event.monotonic_s,
            event.realtime_s,
            event.boot_id,
            WOULD,
            decision.action.value,
            escape(text, _TEXT_LIMIT),
            event.invocation_id,
        )
        said.append((row, row.text))
        if decision.action is Action.RECOVER:
            break  # what a recovery would have changed, the journal cannot say
    return tuple(said)


def _story(rows: list[Row], events: list[UnitEvent], would: tuple[str, ...]) -> Story:
    stops = [f"{_short(r.run)}: {r.text}" for r in rows if r.kind == EventKind.STOP_TIMED_OUT]
    killed = [r.text for r in rows if r.kind == "killed"]
    survivors = [
        r.text
        for r in rows
        if r.kind in {"remains-running", EventKind.LEFT_OVER_PROCESS, EventKind.SURVIVED_SIGKILL}
        or (r.source == GPUGUARD and r.kind in {"reap-outcome", "survivors-of-an-ended-run"})
    ]
    failed = _failed_starts(rows, events)
    ours = [
        r.text
        for r in rows
        if r.source == GPUGUARD and r.kind not in {"signal", "reap-outcome", "verdict"}
    ]
    return Story(
        stop_timeouts=tuple(stops),
        sigkilled=tuple(killed),
        survivors=tuple(survivors),
        failed_starts=tuple(failed),
        gpuguard=tuple(ours),
        would=would,
        healthy=_healthy(events, rows),
    )


def _failed_starts(rows: list[Row], events: list[UnitEvent]) -> list[str]:
    """Each run that failed, with the first start-failure signature it printed."""
    said: dict[str | None, str] = {}
    for row in rows:
        if row.kind == EventKind.GPU_OOM_OUTPUT and row.run not in said:
            said[row.run] = row.text
    lines: list[str] = []
    done: set[str | None] = set()
    for event in events:
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
            "word only; gpuguard = gpuguard.service as root; kernel = Xids; would = gpuguard's "
            "detector replayed"
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
    block("survivors and left-overs", story.survivors, "none seen in the journal")
    block("failed starts", story.failed_starts, "none")
    if timeline.gpuguard_seen:
        block("what gpuguard decided and did", story.gpuguard, "only verdicts and signals")
    else:
        lines.append("  gpuguard: left no line in this journal (not installed or not running)")
        block("what gpuguard would have done", story.would, "nothing: no restart loop")
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
            "failed_starts": list(story.failed_starts),
            "gpuguard": list(story.gpuguard),
            "would": list(story.would),
            "healthy": story.healthy,
        },
    }


def _clock(realtime_s: float | None) -> str:
    if realtime_s is None:
        return "?"
    try:
        return datetime.fromtimestamp(realtime_s, timezone.utc).strftime("%H:%M:%S.%f")[:12]
    except (OverflowError, OSError, ValueError):
        return "?"
