"""A unit's history as doctor reads it from the journal: its stops, loads, failures, survivors.

Only PID 1's own messages count (``events.is_trusted``: a user's forged entry claiming to be
systemd counts for nothing; a survivor also only through journald's native protocol,
``_TRANSPORT=journal``, the one PID 1 logs by), plus the daemon's "survivors of an ended run"
lines when journald says root's gpuguard.service wrote them to its standard error or the native
protocol. The unit's own output is its word: the holders its out-of-memory lines name are kept
apart (``History.named``), never counted as survivors, since any process of the unit can print
such a line. Runs are matched by INVOCATION_ID within one boot, and durations are the journal's
per-boot monotonic stamps, so a wall clock that steps cannot stretch a drain.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Final

from gpuguard.core.doctor.facts import History, Stop
from gpuguard.core.doctor.findings import show
from gpuguard.core.events import EventKind, UnitEvent, decode_message, is_trusted, parse_entry
from gpuguard.core.startfailure import named_holders

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

_SURVIVOR = re.compile(
    r"Unit process (?P<pid>\d{1,10}) \((?P<comm>.{0,64})\) remains running after unit stopped"
)


def build_history(entries: Iterable[Mapping[str, object]], unit: str) -> History:
    """Stops, load times, failed runs and survivors from ``journalctl -o json`` entries.

    Only entries PID 1 wrote count (``events.is_trusted``); runs are matched by INVOCATION_ID
    within one boot, times are the per-boot monotonic stamps (a wall clock that steps cannot
    stretch a drain).
    """
    events: list[UnitEvent] = []
    survivors: list[tuple[int, str]] = []
    swept: list[tuple[tuple[int, ...], str]] = []
    named: dict[int, None] = {}
    count = 0
    for entry in entries:
        count += 1
        if (sweep := _daemon_sweep(entry, unit)) is not None:
            swept.append(sweep)
            continue
        event = parse_entry(entry, unit)
        if event is not None and event.kind is EventKind.GPU_OOM_OUTPUT:
            named.update(dict.fromkeys(named_holders(event.message)))
        elif event is not None:
            events.append(event)
            native = entry.get("_TRANSPORT") == _PID1_TRANSPORT
            if event.kind is EventKind.LEFT_OVER_PROCESS and event.pid is not None and native:
                survivors.append((event.pid, event.comm or ""))
        elif is_trusted(entry, unit) and entry.get("_TRANSPORT") == _PID1_TRANSPORT:
            text = decode_message(entry.get("MESSAGE"), limit=512) or ""
            if match := _SURVIVOR.search(text):
                survivors.append((int(match["pid"]), match["comm"]))
    return History(
        entries=count,
        stops=tuple(_stops(events)),
        load_times_s=tuple(_between(events, EventKind.STARTING, EventKind.STARTED)),
        failed_runs_s=tuple(_failed_runs(events)),
        survivors=tuple(dict.fromkeys(survivors)),  # one left-over is logged once per step
        swept=tuple(swept),
        restarts=sum(e.kind is EventKind.RESTART_SCHEDULED for e in events),
        start_limit_hits=sum(e.kind is EventKind.START_LIMIT_HIT for e in events),
        named=tuple(pid for pid in named if pid not in {p for p, _ in survivors}),
    )


DAEMON_UNIT: Final = "gpuguard.service"
SWEEP_EVENT: Final = "survivors of an ended run"
# How journald received an entry (systemd.journal-fields(7)): PID 1 logs through the native
# protocol; the daemon writes to its standard error (a stream, "stdout"), or natively.
_PID1_TRANSPORT: Final = "journal"
_DAEMON_TRANSPORTS: Final = frozenset({"stdout", "journal"})


def _daemon_sweep(entry: Mapping[str, object], unit: str) -> tuple[tuple[int, ...], str] | None:
    """The daemon's "survivors of an ended run" line about ``unit``, else None.

    Only from gpuguard.service as root, by its standard error or the native protocol (journald's
    fields): the unit's output can print the same JSON.
    """
    if entry.get("_SYSTEMD_UNIT") != DAEMON_UNIT or entry.get("_UID") != "0":
        return None
    if entry.get("_TRANSPORT") not in _DAEMON_TRANSPORTS:
        return None
    text = decode_message(entry.get("MESSAGE"), limit=64 * 1024)
    if not text or not text.startswith("{"):
        return None
    try:
        line = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(line, dict) or line.get("event") != SWEEP_EVENT or line.get("unit") != unit:
        return None
    raw = line.get("pids")
    pids = tuple(p for p in raw if isinstance(p, int))[:100] if isinstance(raw, list) else ()
    return pids, show(str(line.get("summary", "")), 300)


def _run_key(event: UnitEvent) -> tuple[str | None, str | None]:
    return (event.boot_id, event.invocation_id)


_STOP_ENDS: Final = frozenset(
    {EventKind.MAIN_EXITED, EventKind.DEACTIVATED, EventKind.FAILED, EventKind.STOPPED}
)


def _stops(events: Sequence[UnitEvent]) -> list[Stop]:
    """Each "Stopping" to the main process's exit, else to the end of the run.

    systemd logs "Main process exited" only when the exit is a failure (a clean exit is a debug
    message), so a clean drain ends at "Deactivated successfully": later by the ExecStopPost=
    time, which TimeoutStopSec= covers too. A process that never exits ends at "Stopped".

    A stop is killed only when systemd's own timeout cut it ("State 'stop-sigterm' timed out"):
    SGLang ends its clean drain with ``kill_process_tree(…, include_parent=True)``, so its main
    process dies of SIGKILL (status=9/KILL) by its own hand, and that stop drained in full.
    """
    open_stops: dict[tuple[str | None, str | None], tuple[float, bool]] = {}
    stops: list[Stop] = []
    for event in events:
        key = _run_key(event)
        if event.kind is EventKind.STOPPING and event.invocation_id:
            open_stops[key] = (event.monotonic_s, False)
        elif key in open_stops:
            begun, killed = open_stops[key]
            if event.kind is EventKind.STOP_TIMED_OUT:
                open_stops[key] = (begun, True)
            elif event.kind in _STOP_ENDS:
                stops.append(Stop(event.invocation_id, max(0.0, event.monotonic_s - begun), killed))
                del open_stops[key]
    return stops


def _between(events: Sequence[UnitEvent], first: EventKind, then: EventKind) -> list[float]:
    begun: dict[tuple[str | None, str | None], float] = {}
    found: list[float] = []
    for event in events:
        key = _run_key(event)
        if event.kind is first and event.invocation_id:
            begun[key] = event.monotonic_s
        elif event.kind is then and key in begun:
            found.append(max(0.0, event.monotonic_s - begun.pop(key)))
    return found


def _failed_runs(events: Sequence[UnitEvent]) -> list[float]:
    """From "Started" to a failing main exit, for runs nobody asked to stop: what a loop repeats."""
    started: dict[tuple[str | None, str | None], float] = {}
    found: list[float] = []
    for event in events:
        key = _run_key(event)
        if event.kind is EventKind.STARTED and event.invocation_id:
            started[key] = event.monotonic_s
        elif event.kind is EventKind.STOPPING:
            started.pop(key, None)
        elif event.kind is EventKind.MAIN_EXITED and key in started:
            begun = started.pop(key)
            if event.exit_code != "exited" or event.exit_status != 0:
                found.append(max(0.0, event.monotonic_s - begun))
    return found
