"""Journal entries into rows: who wrote an entry decides what it may say (docs/security.md).

systemd's rows are PID 1's entries about the unit as journald's trusted fields prove them
(``events.is_trusted``: a unit that prints a MESSAGE_ID, or ``logger --journald`` with ``UNIT=``,
forges nothing), with its text-only lines about the processes it killed ("Killing process N
(comm) with signal SIGKILL.") and those that outlived the run ("Unit process N (comm) remains
running after unit stopped."); the unit's rows are its own output (``_SYSTEMD_UNIT``, not PID 1)
kept only when it matches a start-failure signature, labelled with the one the daemon's
classifier picks (the most specific, ``startfailure.classify``), or an engine's fatal or phase
line: the unit chose that text, so it is shown as the unit's word, never as systemd's or
gpuguard's, and the gate's verdict is never read from there (the drop-in's client prints it, and
the unit could print the same words); gpuguard's rows are the daemon's structured JSON lines, only
from ``gpuguard.service`` running as root (``_SYSTEMD_UNIT``, ``_UID``: journald's fields), and
the gate server's own lines about gate and reap requests from ``gpuguard-gate.service``
(``gpuguard-gate@….service``, one instance per request, before 0.1.0-3): "accepted", each line
it sent the client (the gate's verdict, the reaper's signals) and the exit status; the kernel's
rows are Xids (``xid.events``), only with ``_TRANSPORT=kernel``. Every text shown is escaped
(``gpuguard.escaping``) and cut; every parser is bounded and never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from gpuguard.core.enginelines import BY_KEY, Phase
from gpuguard.core.escaping import escape
from gpuguard.core.events import (
    OUTPUT_KINDS,
    EventKind,
    UnitEvent,
    decode_message,
    is_trusted,
    parse_entry,
)
from gpuguard.core.gate.proto import CLIENT_GONE
from gpuguard.core.startfailure import named_holders
from gpuguard.core.timeline.model import (
    DAEMON_UNIT,
    GATE_LINE_PREFIX,
    GATE_SERVER_PREFIX,
    GATE_SERVER_UNIT,
    GPUGUARD,
    KERNEL,
    SYSTEMD,
    TEXT_LIMIT,
    UNIT,
    DaemonSaid,
    Row,
)
from gpuguard.core.xid.events import MalformedXid, parse_kernel_entry
from gpuguard.core.xid.hung import parse_hung_entry

if TYPE_CHECKING:
    from collections.abc import Mapping

_JSON_LIMIT: Final = 64 * 1024
_SCAN: Final = 4096
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
# The reaper's console line as the gate server copies it ("… from PID N: <time> [info ] reap
# outcome outcome=exited pid=228 command='…' detail=… reason=…"): its outcome and PID lead
# (adapters/logs.py, LEADING_FIELDS), so they are read at that one place, right after what the
# logger itself wrote; the holder's command and the reason (cgroup names) come after and may
# imitate a pair.
_SAID_AFTER = re.compile(r"\d{1,10}: ")
_REAP_OUTCOME_LINE = re.compile(
    r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?Z "
    r"\[(?:info|warning) {0,9}\] reap outcome {1,30}"  # unkillable and the like: warnings
    r"outcome=(?P<outcome>[a-z-]{1,20}) pid=(?P<pid>\d{1,10})(?: |$)"
)
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


@dataclass(slots=True)
class Acc:
    """What the rows add up to while they are read (private)."""

    rows: list[Row] = field(default_factory=list)
    events: list[UnitEvent] = field(default_factory=list)
    seen: set[tuple[str, str | None, str]] = field(default_factory=set)
    daemon: list[DaemonSaid] = field(default_factory=list)
    """The daemon's verdicts (looping or not) and its finished recoveries, for the replay."""
    named: dict[int, None] = field(default_factory=dict)
    """The holders every out-of-memory line names (also the lines not shown: one per run)."""
    server: str | None = None
    """The unit's server ("sglang", "vllm") when configured: only its ready line counts."""
    ready: set[str | None] = field(default_factory=set)
    """Runs that printed their server's ready line (the unit's word): they came up."""


def read_entry(entry: Mapping[str, object], unit: str, acc: Acc) -> None:
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


def _event_row(event: UnitEvent, acc: Acc) -> None:
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
        if line.phase is Phase.READY and acc.server is not None:
            if line.server != acc.server:
                return  # SGLang prints vLLM's uvicorn line before its warm-up: not its ready
            acc.ready.add(run)
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
        escape(text, TEXT_LIMIT),
        event.invocation_id,
    )


def _systemd_text_row(
    entry: Mapping[str, object], where: tuple[float, float | None, str | None], acc: Acc
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
        acc.rows.append(Row(*where, SYSTEMD, kind, escape(text, TEXT_LIMIT), run))
        return


def _gpuguard_row(  # noqa: PLR0911 - one return per kind of line that is not gpuguard's
    entry: Mapping[str, object],
    unit: str,
    where: tuple[float, float | None, str | None],
    acc: Acc,
) -> None:
    """The daemon's JSON line about ``unit``, or the gate server's acceptance of a request."""
    owner = _string(entry, "_SYSTEMD_UNIT") or ""
    text = decode_message(entry.get("MESSAGE"), limit=_JSON_LIMIT)
    if text is None:
        return
    if owner == GATE_SERVER_UNIT or owner.startswith(GATE_SERVER_PREFIX):
        kind = _gate_server_kind(text, unit)
        reaped = _server_reaped(text, unit) if kind in {"gate-said", "reap-said"} else None
        if reaped is not None:  # the gate or stop-reap reaped it: a survivor, like the daemon's
            kind = "reap-outcome"
            text = f"reap outcome: pid={reaped[1]} outcome={reaped[0]}; {text}"
        if kind is not None:
            acc.rows.append(Row(*where, GPUGUARD, kind, escape(text, TEXT_LIMIT)))
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
    acc.rows.append(Row(*where, GPUGUARD, kind, escape(said, TEXT_LIMIT)))


def _note_daemon(
    line: Mapping[str, object],
    unit: str,
    where: tuple[float, float | None, str | None],
    acc: Acc,
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
        acc.daemon.append(DaemonSaid(*where, looping, _shown(line.get("reason", "")), read_through))
    elif line.get("event") == "recovery finished" and line.get("result") == "restarted":
        acc.daemon.append(DaemonSaid(*where, None, "recovery finished: restarted"))


def _gate_server_kind(text: str, unit: str) -> str | None:
    """What a gate server line about ``unit`` is; None when it is about another unit.

    Its acceptance, the verdict, the exit, or another line it sent the client (the reaper's).
    The server writes "<gate|reap> for U from PID N (uid …): accepted", then each line the
    request sent the client's standard error as "… from PID N: <line>", then "… : exit N" - or,
    when the client went first and the work ended there, CLIENT_GONE (``*-abandoned``: what
    the request did not log is unknown, it never finished).
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
        return f"{command}-{_said_kind(said)}"
    return None


def _said_kind(said: str) -> str:
    """What one line a request sent is: its exit, its end with the client, a verdict, or else."""
    if _GATE_EXIT.fullmatch(said):
        return "exit"
    if said == CLIENT_GONE:
        return "abandoned"
    if said.startswith((GATE_LINE_PREFIX, "gpuguard reap")):
        return "verdict"
    return "said"


def _kernel_row(
    entry: Mapping[str, object], where: tuple[float, float | None, str | None], acc: Acc
) -> None:
    hung = parse_hung_entry(entry)
    if hung is not None:
        acc.rows.append(Row(*where, KERNEL, "gpu-hangs", f"{hung.said}: {hung.text}"))
        return
    parsed = parse_kernel_entry(entry)
    if parsed is None:
        return
    if isinstance(parsed, MalformedXid):
        acc.rows.append(Row(*where, KERNEL, "xid-malformed", f"{parsed.reason}: {parsed.excerpt}"))
        return
    who = "" if parsed.pid is None else f", pid {parsed.pid} ({parsed.name or '?'})"
    text = f"Xid {parsed.code} on {parsed.pci_bus_id}{who}: {parsed.detail}"
    acc.rows.append(Row(*where, KERNEL, "xid", escape(text, TEXT_LIMIT)))


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


def _server_reaped(text: str, unit: str) -> tuple[str, str] | None:
    """(outcome, pid) of a reaper outcome line the gate server copied; None for other lines.

    Only where the reaper's own line begins, right after the server's "… from PID N: ": its
    timestamp, level and event, then the outcome and the PID, which lead the fields. Nothing
    a process chose (its command, a cgroup name in the reason) comes before them, so none can
    stand in for them. One anchored, bounded match: linear.
    """
    for command in ("gate", "reap"):
        head = f"{command} for {unit} from PID "
        if text.startswith(head):
            after = _SAID_AFTER.match(text, len(head))
            found = _REAP_OUTCOME_LINE.match(text, after.end()) if after else None
            return (found["outcome"], found["pid"]) if found else None
    return None
