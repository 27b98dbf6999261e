"""Measure a scenario from the container's journal: runs, failed starts, time to a healthy start.

Everything is read back from the journal, as an operator would:

* a **run** is one invocation of the unit (``INVOCATION_ID`` on PID 1's messages,
  ``_SYSTEMD_INVOCATION_ID`` on the unit's own output); the run that was serving before the
  scenario's trigger is left out (its stop is the incident, not a start);
* a run **failed** when PID 1 logged ``Failed with result`` for it (MESSAGE_ID d9b373ed…) or its
  main process exited non-zero; a failed *start* is such a run;
* a run is **healthy** from the server's ``The server is fired up and ready to roll!`` line;
* times are seconds after the scenario's trigger (``t0``, the `systemctl restart`).

``Timeline`` collects journal lines (PID 1 about the unit, the server's notable lines, the gate's
and the daemon's lines) plus the test's own actions, as ``+12.34 s  who  what`` lines.
``save``/``load_results`` keep each scenario's numbers in ``$GPUGUARD_E2E_CACHE/results/`` and
``render_table`` prints them, for the test output, CI and ``make demo``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from e2e.container import cache_dir

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from pathlib import Path

    from e2e.container import JournalEntry

FAILURE_RESULT = "d9b373ed55a64feb8242e02dbe79a49c"
PROCESS_EXIT = "98e322203f7a4ed290d09fe03c09fe15"
FIRED_UP = "The server is fired up and ready to roll!"
GPU_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|memory capacity is unbalanced")
# Server lines worth a place in the timeline (the rest is model-loading chatter).
_NOTABLE_OUTPUT = re.compile(
    r"fired up|OutOfMemoryError|memory capacity is unbalanced|Gracefully exiting|"
    r"unrecognized arguments|error:|Load weight begin|is already in use"
)
_REPEATED = re.compile(r"Gracefully exiting|memory capacity is unbalanced")
_MESSAGE_WIDTH = 150
_TIMELINE_HEAD = 60
_TIMELINE_TAIL = 12


SESSION_RESULTS: list[dict[str, Any]] = []
"""Results saved by this process, for the end-of-run summary (conftest.py)."""
SESSION_NOTES: list[str] = []
"""Other measurements worth a line in the summary (install timings)."""


def results_dir() -> Path:
    """Where scenario results are kept: `$GPUGUARD_E2E_CACHE/results`."""
    return cache_dir() / "results"


def _realtime_s(entry: JournalEntry) -> float:
    return int(str(entry.get("__REALTIME_TIMESTAMP"))) / 1e6


def _text(entry: JournalEntry) -> str:
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journalctl prints non-UTF-8 / escape-laden text as bytes
        return bytes(int(b) for b in message if isinstance(b, int)).decode(errors="replace")
    return str(message)


def _pid1(entry: JournalEntry) -> bool:
    return entry.get("_PID") == "1" and entry.get("_UID") == "0"


# --- runs ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One invocation of the unit as the journal shows it (times: wall-clock seconds)."""

    invocation: str
    first_s: float
    failed_s: float | None = None
    how: str | None = None
    healthy_s: float | None = None
    oom: bool = False


def runs(entries: Iterable[JournalEntry], *, exclude: Iterable[str] = ()) -> list[Run]:
    """The unit's runs in `entries` (PID 1's lines about it and its output), oldest first."""
    skip = set(exclude)
    found: dict[str, Run] = {}
    for entry in entries:
        pid1 = _pid1(entry)
        invocation = entry.get("INVOCATION_ID" if pid1 else "_SYSTEMD_INVOCATION_ID")
        if not isinstance(invocation, str) or not invocation or invocation in skip:
            continue
        at = _realtime_s(entry)
        run = found.setdefault(invocation, Run(invocation, at))
        run.first_s = min(run.first_s, at)
        text = _text(entry)
        if pid1:
            _fold_pid1(run, entry, at)
        elif FIRED_UP in text and run.healthy_s is None:
            run.healthy_s = at
        elif GPU_OOM.search(text):
            run.oom = True
    return sorted(found.values(), key=lambda run: run.first_s)


def _fold_pid1(run: Run, entry: JournalEntry, at: float) -> None:
    message_id = entry.get("MESSAGE_ID")
    if message_id == FAILURE_RESULT:
        run.failed_s = at if run.failed_s is None else min(run.failed_s, at)
        run.how = run.how or f"result {entry.get('UNIT_RESULT')}"
    elif message_id == PROCESS_EXIT and entry.get("EXIT_CODE") == "exited":
        status = entry.get("EXIT_STATUS")
        if status not in (None, "0"):
            run.failed_s = at if run.failed_s is None else min(run.failed_s, at)
            what = "main process" if "Main process" in _text(entry) else "control process"
            run.how = f"{what} exited {status}"


@dataclass
class Measurement:
    """A scenario's numbers, relative to its trigger `t0`."""

    starts: int
    failed_starts: int
    oom_starts: int
    first_failure_s: float | None
    healthy_s: float | None
    failure_to_healthy_s: float | None
    observed_s: float
    failures: list[str] = field(default_factory=list)


def measure(all_runs: Sequence[Run], t0: float, observed_until: float) -> Measurement:
    """Count the runs that began after `t0` (up to `observed_until`)."""
    after = [run for run in all_runs if t0 <= run.first_s <= observed_until]
    failed = [run for run in after if run.failed_s is not None]
    healthy = [run.healthy_s for run in after if run.healthy_s is not None]
    first_failure = min((run.failed_s for run in failed if run.failed_s is not None), default=None)
    healthy_s = min(healthy, default=None)
    return Measurement(
        starts=len(after),
        failed_starts=len(failed),
        oom_starts=sum(1 for run in failed if run.oom),
        first_failure_s=None if first_failure is None else round(first_failure - t0, 2),
        healthy_s=None if healthy_s is None else round(healthy_s - t0, 2),
        failure_to_healthy_s=(
            round(healthy_s - first_failure, 2)
            if healthy_s is not None and first_failure is not None
            else None
        ),
        observed_s=round(observed_until - t0, 1),
        failures=[
            f"run {run.invocation[:8]} +{(run.failed_s or t0) - t0:.2f} s: {run.how}"
            + (" (GPU OOM output)" if run.oom else "")
            for run in failed
        ],
    )


# --- the timeline ----------------------------------------------------------------------------


@dataclass
class Timeline:
    """Lines with times relative to `t0`: journal entries and the test's own actions."""

    t0: float
    marks: list[tuple[float, str, str]] = field(default_factory=list)

    def mark(self, text: str, at: float | None = None) -> None:
        """A test action (`at` defaults to now)."""
        self.marks.append((time.time() if at is None else at, "test", text))

    def add_journal(self, entries: Iterable[JournalEntry], unit: str) -> None:
        """PID 1 about `unit`, the notable lines of its output, and everything gpuguard says.

        Of the lines a run repeats (the drain countdown, the other ranks' "unbalanced"), only the
        first of each run is kept.
        """
        seen: set[tuple[object, str]] = set()
        for entry in entries:
            at = _realtime_s(entry)
            text = _text(entry)
            ident = str(entry.get("SYSLOG_IDENTIFIER") or entry.get("_COMM") or "?")
            if _pid1(entry):
                self.marks.append((at, "systemd", text))
            elif str(entry.get("_COMM", "")).startswith("("):
                continue  # systemd's own executor, before exec ("(gpuguard)": sandbox setup)
            elif entry.get("_SYSTEMD_UNIT") == "gpuguard.service" or ident == "gpuguard":
                self.marks.append((at, "gpuguard", _gpuguard_line(text)))
            elif entry.get("_SYSTEMD_UNIT") == unit and _NOTABLE_OUTPUT.search(text):
                repeated = _REPEATED.search(text)
                key = (entry.get("_SYSTEMD_INVOCATION_ID"), repeated.group(0) if repeated else text)
                if repeated is None or key not in seen:
                    seen.add(key)
                    self.marks.append((at, ident, _server_line(text)))

    def add_forged(self, entries: Iterable[JournalEntry]) -> None:
        """Entries an unprivileged user wrote, shown with the fields they claim."""
        for entry in entries:
            claims = " ".join(
                f"{key}={entry[key]}"
                for key in ("UNIT", "N_RESTARTS", "SYSLOG_IDENTIFIER")
                if entry.get(key) is not None
            )
            self.marks.append(
                (_realtime_s(entry), f"uid {entry.get('_UID')}", f"{_text(entry)} [{claims}]")
            )

    def lines(self) -> list[str]:
        """The timeline as text lines, oldest first; a long middle is elided."""
        rendered = [
            f"{at - self.t0:+8.2f} s  {who:<9} {_cut(text)}"
            for at, who, text in sorted(self.marks, key=lambda mark: mark[0])
        ]
        if len(rendered) <= _TIMELINE_HEAD + _TIMELINE_TAIL:
            return rendered
        hidden = len(rendered) - _TIMELINE_HEAD - _TIMELINE_TAIL
        return [
            *rendered[:_TIMELINE_HEAD],
            f"{'':13}… {hidden} more lines (the same cycle) …",
            *rendered[-_TIMELINE_TAIL:],
        ]


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_WIDTH else text[: _MESSAGE_WIDTH - 1] + "…"


def _server_line(text: str) -> str:
    """Drop the server's own timestamp prefix (the timeline has one)."""
    return re.sub(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d( TP\d+)?\] ", r"\1 ", text).strip()


_GPUGUARD_FIELDS = (
    "unit", "reason", "cause", "cause_detail", "action", "action_reason", "result", "problem",
    "signal", "pid", "comm", "outcome", "reaped", "waited_s", "gpus",
)  # fmt: skip


_CONSOLE = re.compile(r"^\S+Z \[(?P<level>\w+)\s*\] (?P<event>.*?)(?=\s+\w+=|\s*$)(?P<rest>.*)$")
_PAIR = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


def _gpuguard_line(text: str) -> str:
    """A gpuguard log line as `event: key=value …`, the interesting keys only.

    The daemon logs JSON lines; `gate`/`reap` log structlog's console form
    (`2026-…Z [info     ] signal   pid=123 signal=SIGTERM …`); anything else is kept as is.
    """
    fields: dict[str, object]
    try:
        event = json.loads(text)
    except ValueError:
        match = _CONSOLE.match(text)
        if match is None:
            return text
        fields = {key: value.strip("'\"") for key, value in _PAIR.findall(match["rest"])}
        fields["event"] = match["event"].strip()
    else:
        if not isinstance(event, dict):
            return text
        fields = event
    parts = [f"{key}={fields[key]}" for key in _GPUGUARD_FIELDS if fields.get(key) is not None]
    return f"{fields.get('event')}: {' '.join(parts)}"


# --- results ---------------------------------------------------------------------------------


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class ScenarioResult:
    """What a scenario measured, as stored in results/<release>-<scenario>.json."""

    scenario: str
    title: str
    release: str
    systemd: int
    gpuguard: str
    window_s: float
    measurement: Measurement
    actions: str
    notes: list[str]
    timeline: list[str]
    healthy_note: str | None = None
    """Shown instead of "never" when no healthy start was expected (the server kept serving)."""
    measured_at: str = field(default_factory=_now_iso)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for json.dump."""
        return asdict(self)


def save(result: ScenarioResult) -> Path:
    """Write the result where `load_results` (and `make demo`) find it."""
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.release}-{result.scenario}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    tmp.replace(path)
    SESSION_RESULTS.append(result.to_json())
    return path


def load_results(scenarios: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Stored results, by scenario letter then release; all when `scenarios` is None."""
    wanted = set(scenarios) if scenarios is not None else None
    found = []
    for path in sorted(results_dir().glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (wanted is None or data.get("scenario") in wanted):
            found.append(data)
    return sorted(found, key=lambda d: (str(d.get("scenario")), str(d.get("release"))))


def _seconds(value: object, missing: str) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else missing


def render_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """The results table: one row per scenario and release."""
    header = (
        "scenario",
        "gpuguard",
        "observed",
        "starts",
        "failed starts",
        "1st failure → healthy",
        "trigger → healthy",
        "what gpuguard did",
    )
    rows = [header]
    for data in results:
        m = data.get("measurement") or {}
        never = f"never ({_seconds(m.get('observed_s'), '?')})"
        failure_to_healthy = _seconds(
            m.get("failure_to_healthy_s"), "—" if not m.get("failed_starts") else never
        )
        rows.append(
            (
                f"({data.get('scenario')}) {data.get('title')} [{data.get('release')}]",
                str(data.get("gpuguard")),
                _seconds(m.get("observed_s"), "?"),
                str(m.get("starts")),
                str(m.get("failed_starts")),
                failure_to_healthy,
                _seconds(m.get("healthy_s"), str(data.get("healthy_note") or never)),
                str(data.get("actions")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * width for width in widths))
    return [line.rstrip() for line in lines]


def render_report(
    results: Sequence[dict[str, Any]], *, timelines: bool = True, notes: Sequence[str] = ()
) -> list[str]:
    """Each scenario's timeline and notes, then the table, then `notes`."""
    lines: list[str] = []
    if timelines:
        for data in results:
            lines.append(
                f"--- ({data.get('scenario')}) {data.get('title')} — {data.get('release')}, "
                f"systemd {data.get('systemd')}, measured {data.get('measured_at')} ---"
            )
            lines.extend(f"    {line}" for line in data.get("timeline") or [])
            lines.extend(f"    note: {note}" for note in data.get("notes") or [])
            lines.append("")
    if results:
        lines.extend(render_table(results))
    lines.extend(notes)
    return lines
