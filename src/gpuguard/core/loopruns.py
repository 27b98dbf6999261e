"""A unit's runs as the restart-loop detector sees them (pure: time is passed in).

The detector's window of events grouped by invocation (``runs_of``): each ``Run`` folds in its
events (started, failed, ended cleanly, stopped by a stop job, restarted by systemd, left-over
processes and GPU out-of-memory lines at its start) and says its ``Outcome`` at a moment;
``View`` is the window as the detector's rules read it, with the current series of failures.
This module owns what a run is and how it is told in evidence lines; the rules that make a loop
are the detector's (core/detector.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from gpuguard.core.events import EventKind, UnitEvent
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from collections.abc import Iterable


class Outcome(StrEnum):
    """How a run ended, as far as the window shows."""

    FAILED = "failed"
    OK = "ok"
    STOPPED = "stopped"
    """Ended by a stop job someone asked for: not a failure to count, and never restarted."""
    PENDING = "pending"
    UNKNOWN = "unknown"


_START_KINDS: Final = frozenset(
    {EventKind.STARTING, EventKind.STARTED, EventKind.LEFT_OVER_PROCESS}
)
# A main process killed by one of these ended cleanly for systemd (SuccessExitStatus= implied).
_CLEAN_SIGNALS: Final = frozenset({"TERM", "INT", "HUP", "PIPE"})
ENDS_SERIES: Final = frozenset({Outcome.OK, Outcome.STOPPED})
_SHORT_ID: Final = 8


@dataclass(slots=True)
class Run:
    """What the window shows of one invocation (internal, built afresh by each diagnose)."""

    invocation_id: str
    first_s: float
    started_s: float | None = None
    start_marker: bool = False
    failure_s: float | None = None
    result: str | None = None
    job_result: str | None = None
    exit: UnitEvent | None = None
    deactivated_s: float | None = None
    start_limit_s: float | None = None
    stop_requested_s: float | None = None
    restart_s: float | None = None
    """When systemd scheduled a restart after this run ("Scheduled restart job")."""
    clean_restart: bool = False
    """It ended cleanly within stable_s of its start and systemd restarted it: counted failed."""
    left_over: list[UnitEvent] = field(default_factory=list)
    oom: list[UnitEvent] = field(default_factory=list)

    def add(self, event: UnitEvent) -> None:
        """Fold one event of this run in."""
        self.first_s = min(self.first_s, event.monotonic_s)
        kind = event.kind
        if kind in _START_KINDS:
            self.start_marker = True
        if kind is EventKind.STARTED:
            self.started_s = earliest(self.started_s, event.monotonic_s)
        elif kind is EventKind.DEACTIVATED:
            self.deactivated_s = earliest(self.deactivated_s, event.monotonic_s)
        elif kind is EventKind.LEFT_OVER_PROCESS:
            self.left_over.append(event)
        elif kind is EventKind.GPU_OOM_OUTPUT:
            self.oom.append(event)
        else:
            self._add_ending(event)

    def _add_ending(self, event: UnitEvent) -> None:
        """Fold in an event that may say the run failed."""
        match event.kind:
            case EventKind.FAILED:
                self.result = self.result or event.result
                self._fail(event.monotonic_s)
            case EventKind.START_FAILED:
                self.job_result = self.job_result or event.result
                self._fail(event.monotonic_s)
            case EventKind.START_LIMIT_HIT:
                self.start_limit_s = earliest(self.start_limit_s, event.monotonic_s)
                self._fail(event.monotonic_s)
            case EventKind.MAIN_EXITED:
                self.exit = self.exit or event
                if not clean_exit(event):
                    self._fail(event.monotonic_s)
            case EventKind.STOPPING | EventKind.STOPPED if event.job_type == "stop":
                self.stop_requested_s = earliest(self.stop_requested_s, event.monotonic_s)
            case EventKind.RESTART_SCHEDULED:
                self.restart_s = earliest(self.restart_s, event.monotonic_s)
            case _:
                pass

    def settle(self, stable_s: float) -> None:
        """Count a clean end that systemd restarted within ``stable_s`` of the start as failed."""
        if (
            self.failure_s is None
            and self.stop_requested_s is None
            and self.restart_s is not None
            and self.deactivated_s is not None
            and self.started_s is not None
            and self.deactivated_s - self.started_s < stable_s
        ):
            self.clean_restart = True
            self.failure_s = self.restart_s

    def _fail(self, at_s: float) -> None:
        self.failure_s = earliest(self.failure_s, at_s)

    def outcome(self, now: float, stable_s: float) -> Outcome:
        """STOPPED, FAILED, OK, PENDING or UNKNOWN at ``now``."""
        if self.stop_requested_s is not None:
            # A clean end is OK whoever asked; one that failed (a stop that timed out) was
            # still wanted: STOPPED, never a failure of the series.
            clean = self.failure_s is None and self.deactivated_s is not None
            return Outcome.OK if clean else Outcome.STOPPED
        if self.failure_s is not None:
            return Outcome.FAILED
        if self.deactivated_s is not None:
            return Outcome.OK
        if self.started_s is not None:
            return Outcome.OK if now - self.started_s >= stable_s else Outcome.PENDING
        return Outcome.PENDING if self.start_marker or self.oom else Outcome.UNKNOWN

    def way(self) -> tuple[str | None, str | None, int | None]:
        """How the run failed, comparable between runs: result, exit code, exit status.

        The start job's result counts only when systemd gave no unit result: the last run
        before the start limit also gets "Failed to start", the others do not.
        """
        result = self.result or (f"start job {self.job_result}" if self.job_result else None)
        if self.clean_restart:
            result = "clean exit, restarted"
        if self.exit is None:
            return (result, None, None)
        return (result, self.exit.exit_code, self.exit.exit_status)

    def describe_failure(self) -> str:
        """The failure in a few words: "exit-code (status 1)", "signal (killed by SIGSEGV)"."""
        if self.clean_restart:
            return "exited cleanly and systemd restarted it"
        if self.result is None and self.job_result is not None:
            text = f"start job {self.job_result}"
        else:
            text = self.result or "failed"
        if self.exit is not None and self.exit.exit_code is not None:
            if self.exit.exit_code == "exited":
                text += f" (status {_or_unknown(self.exit.exit_status)})"
            elif self.exit.signal is not None:
                text += f" ({self.exit.exit_code} by SIG{self.exit.signal})"
            else:
                text += f" ({self.exit.exit_code}, signal {_or_unknown(self.exit.exit_status)})"
        return text


@dataclass(frozen=True, slots=True)
class View:
    """The window at one moment, as the rules see it (internal)."""

    now: float
    events: tuple[UnitEvent, ...]
    runs: tuple[tuple[Run, Outcome], ...]
    """Every run of the window with its outcome, oldest first."""
    known: tuple[tuple[Run, Outcome], ...]
    """The runs whose start or outcome the window shows."""
    episode: tuple[tuple[Run, Outcome], ...]
    """The known runs after the newest OK or STOPPED one: the current series."""
    n_restarts: int | None
    restart_counters: tuple[int, ...] = ()
    """systemd's restart counter at each scheduled restart of the window, oldest first."""

    @property
    def climb(self) -> int:
        """Automatic restarts within the window since the counter last reset, by the counter.

        The counter counts each restart systemd scheduled (``N_RESTARTS``); it goes back to 0
        only when someone starts the unit by hand, so the values after the last drop count
        restarts even where the window lost some of their lines: 7 then 10 is 4 restarts.
        """
        counters = self.restart_counters
        if not counters:
            return 0
        first = len(counters) - 1
        while first > 0 and counters[first - 1] < counters[first]:
            first -= 1
        return counters[-1] - counters[first] + 1

    @property
    def newest(self) -> tuple[Run, Outcome] | None:
        """The newest run whose start or outcome the window shows, with that outcome."""
        return self.known[-1] if self.known else None

    @property
    def failed(self) -> tuple[Run, ...]:
        """The failed runs of the current series."""
        return tuple(run for run, outcome in self.episode if outcome is Outcome.FAILED)

    @property
    def streak(self) -> int:
        """Failed runs in a row back from the newest; a starting run between them is skipped."""
        return len(self.failed)


def runs_of(events: Iterable[UnitEvent]) -> list[Run]:
    """Events grouped into runs by invocation, oldest run first.

    An event without an invocation ID (systemd before 232 set none; a public excerpt shows none)
    joins the run in progress at its time; a start ("Starting", or "Started" after no "Starting"
    of its own) opens a new run, as does any event with no run before it: systemd logs a run's
    lines in order, from "Starting" to "Stopped", and the next run's start after them.
    """
    by_id: dict[str, Run] = {}
    orphans: list[UnitEvent] = []
    for event in events:
        if event.invocation_id is None:
            orphans.append(event)
            continue
        run = by_id.get(event.invocation_id)
        if run is None:
            run = by_id[event.invocation_id] = Run(event.invocation_id, event.monotonic_s)
        run.add(event)
    runs = sorted(by_id.values(), key=lambda run: (run.first_s, run.invocation_id))
    unnamed: list[Run] = []
    for event in orphans:
        owners = [run for run in (*runs, *unnamed) if run.first_s <= event.monotonic_s]
        owner = max(owners, key=lambda run: run.first_s) if owners else None
        if owner is None or _opens_run(event, owner):
            owner = Run(f"{UNNAMED}{len(unnamed) + 1}", event.monotonic_s)
            unnamed.append(owner)
        owner.add(event)
    return sorted((*runs, *unnamed), key=lambda run: (run.first_s, run.invocation_id))


UNNAMED: Final = "unnamed-"
"""The name of a run whose entries carry no INVOCATION_ID: ``unnamed-1``, ``unnamed-2``, …"""


def _opens_run(event: UnitEvent, current: Run) -> bool:
    """Whether an event without an invocation ID starts a new run after ``current``."""
    if event.kind is EventKind.STARTING:
        return True
    if event.kind is EventKind.STARTED:
        starting_only = current.start_marker and current.started_s is None
        return not (starting_only and current.failure_s is None)
    return False


def run_lines(run: Run, outcome: Outcome) -> list[tuple[float, str]]:
    """Evidence lines about one run: left-over processes, GPU OOM output, how it ended."""
    short = abbrev(run)
    lines: list[tuple[float, str]] = []
    seen: set[tuple[int | None, str | None]] = set()
    for event in run.left_over:  # logged before ExecStartPre= and again before ExecStart=
        if (event.pid, event.comm) not in seen:
            seen.add((event.pid, event.comm))
            lines.append(
                (
                    event.monotonic_s,
                    f"run {short} found left-over process {event.pid} ({event.comm}) at start",
                )
            )
    if run.oom:
        lines.append((run.oom[0].monotonic_s, f"run {short} printed: {cut(run.oom[0].message)}"))
    if run.start_limit_s is not None:
        lines.append((run.start_limit_s, f"run {short}: start limit hit, no more restarts"))
    if run.stop_requested_s is not None:
        lines.append((run.stop_requested_s, f"run {short} stopped by a stop job"))
    if outcome in {Outcome.FAILED, Outcome.STOPPED} and run.failure_s is not None:
        lines.append((run.failure_s, f"run {short} failed: {run.describe_failure()}"))
    elif outcome is Outcome.OK and run.deactivated_s is not None:
        lines.append((run.deactivated_s, f"run {short} ended cleanly"))
    elif outcome is Outcome.OK and run.started_s is not None:
        lines.append((run.started_s, f"run {short} started and stayed up"))
    return lines


def event_lines(events: Iterable[UnitEvent]) -> list[tuple[float, str]]:
    """Evidence lines about the stop path and the newest restart counter."""
    lines: list[tuple[float, str]] = []
    restart: UnitEvent | None = None
    for event in events:
        short = abbrev(event.invocation_id)
        if event.kind is EventKind.STOP_TIMED_OUT:
            state = "final-sigterm" if event.final else "stop-sigterm"
            lines.append((event.monotonic_s, f"run {short}: {state} timed out, SIGKILL sent"))
        elif event.kind is EventKind.SURVIVED_SIGKILL:
            which = "final SIGKILL" if event.final else "SIGKILL"
            lines.append((event.monotonic_s, f"run {short}: processes survived {which}"))
        elif event.kind is EventKind.RESTART_SCHEDULED:
            restart = event
    if restart is not None:
        counter = _or_unknown(restart.n_restarts)
        lines.append((restart.monotonic_s, f"restart scheduled, counter at {counter}"))
    return lines


def _or_unknown(value: int | None) -> str:
    """A number systemd may have left out (EXIT_STATUS=, N_RESTARTS=), for people: never None."""
    return "unknown" if value is None else str(value)


def clean_exit(event: UnitEvent) -> bool:
    """Whether systemd counts a main-process exit as success (status 0, or TERM/INT/HUP/PIPE)."""
    if event.exit_code == "exited":
        return event.exit_status == 0
    if event.exit_code == "killed":
        return event.signal in _CLEAN_SIGNALS
    return event.exit_code is None


def earliest(current: float | None, candidate: float) -> float:
    """The earlier of a moment kept (None: none yet) and a new one."""
    return candidate if current is None else min(current, candidate)


def abbrev(run: Run | str | None) -> str:
    """A run's invocation ID cut to 8 characters for people, like a short git hash."""
    invocation_id = run.invocation_id if isinstance(run, Run) else run
    if invocation_id is None:
        return "?"
    if len(invocation_id) <= _SHORT_ID or invocation_id.startswith(UNNAMED):
        return invocation_id
    return invocation_id[:_SHORT_ID] + "…"


def cut(message: str, limit: int = 160) -> str:
    """A foreign line shortened for an evidence line, with an ellipsis where it was cut."""
    return message if len(message) <= limit else message[: limit - 1] + "…"
