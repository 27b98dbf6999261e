"""Is a unit in a restart loop, and do stale GPU holders cause it? (pure: time is passed in).

A small stateful core in the manner of fail2ban's failure counter: ``observe`` records trusted
events (``gpuguard.core.events``), ``diagnose(now, gpu)`` judges them. What is at risk: a
daemon that stops and reaps a healthy server because of old history, a forged message or a miscount.
Hence:

* history is never acted on: events replayed on start are recorded with ``live=False`` and
  ``observe`` then never asks for a judgement;
* a run is an invocation (``INVOCATION_ID``), never a PID and never a count of messages: systemd
  logs several lines per run, and 252 logs extra "Stopped" lines that 257 does not;
* churn comes only from events the parser trusted (PID 1) or, for ``gpu-oom-output``, from the
  unit's own output, which explains a failure PID 1 reported but never makes one;
* duplicates (a journal resume delivers entries again) and out-of-order arrival change nothing.

Rules (``diagnose``), over the events of the last ``window_s`` seconds:

* each run (invocation) ends FAILED (Failed with result, a main process that exited non-zero or
  by an unclean signal, Failed to start, the start limit), OK (Deactivated successfully, or
  started and up without failure for ``stable_s``), is PENDING (starting, or started less than
  ``stable_s`` ago) or UNKNOWN (neither start nor outcome inside the window: ignored);
* the current series is the runs after the newest OK one; a PENDING run inside it is skipped;
* an OK newest run means no loop, whatever came before;
* loop: the newest run failed and the series holds at least ``min_starts`` failed runs; or the
  newest run failed, the series holds at least two failed runs and the newest restart counter
  (``N_RESTARTS``) is at least ``restart_counter_threshold`` (the counter alone is not a rate:
  it only resets on a manual start, so a server that crashes once a week climbs it too);
* a PENDING newest run is not a loop by those counts: the daemon acts between runs, not on a
  server that is still loading and might come up;
* a run ended by a stop job (``JOB_TYPE=stop`` on "Stopping"/"Stopped": an operator's
  ``systemctl stop``, a conflicting unit, gpuguard itself) is STOPPED: someone wanted it down,
  so it ends the series like an OK run and a STOPPED newest run is never a loop, whatever its
  stop looked like (a stop that timed out fails the run too) — the daemon must not start a
  unit an operator just stopped. systemd's own restarts say ``JOB_TYPE=restart``;
* a run that ended cleanly ("Deactivated successfully") within ``stable_s`` of its start and
  that systemd restarted ("Scheduled restart job", ``Restart=always``) counts as failed: only
  the restart counter tells such a loop, and a server that exits 0 at once is not serving;
* immediate loop, whether the newest run failed or is still starting: the newest run found a
  left-over process in its control group while starting and it failed, or the series already
  holds a failure (systemd restarted it); or the first start after a stop timeout failed. A
  left-over at a start with no failure and no scheduled restart (an operator's start after a
  ``KillMode=process`` run) is a finding (``Diagnosis.findings``), not a loop;
* a loop whose newest run hit the start limit ("Start request repeated too quickly") was ended
  by systemd: ``Diagnosis.start_limit_hit``, and the reason says what to do (fix the cause, then
  ``systemctl reset-failed U``);
* cause: ``gpu-needs-reset`` when a GPU of the unit's set needs a reset or reboot (NVML health:
  lost, a pending row remap or page retirement, the driver asks for it) - first, because no kill
  can help then; ``stale-gpu-holders`` when the GPU inventory names stale holders or a failed run
  of the series printed a GPU out-of-memory message; ``not-gpu-related`` when an inventory was
  taken, the GPUs are idle with no stale holder, and two or more failed runs ended the same way
  (unit result, exit code and status); ``unknown`` otherwise.

Time is the journal's monotonic clock of one boot (``UnitEvent.monotonic_s``; the caller's ``now``
is ``time.monotonic()``, the same clock): a wall-clock step moves no event in or out of the
window. Events of another boot replace the timeline (the journal is followed for one boot).
The wall clock appears only in evidence lines, for people.

At most ``_OOM_PER_RUN`` out-of-memory lines are kept per run: the first explains the failure;
200,000 of them would only cost memory and time in every verdict.

After a recovery restarted the unit, call ``reset(now)``: window expiry alone would keep the
handled failures counted for ``window_s`` and make the first failure after the recovery look like
a loop again (see ``Detector.reset``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime, timezone, tzinfo
from typing import TYPE_CHECKING, Final

from gpuguard.core.events import EventKind, UnitEvent
from gpuguard.core.oomdevice import describe_device
from gpuguard.core.values import StrEnum

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """When a unit counts as restart-looping."""

    min_starts: int = 3
    """Consecutive failed runs inside the window that make a loop."""
    window_s: float = 600.0
    """How far back events count, in seconds."""
    restart_counter_threshold: int = 5
    """systemd's N_RESTARTS at or above which repeated failures are a loop."""
    stable_s: float = 300.0
    """How long a run must stay up without failing to count as a successful start (longer than a
    model load, so a server still loading is not mistaken for a healthy one)."""

    def __post_init__(self) -> None:
        """Refuse settings under which every or no unit would loop."""
        if self.min_starts < 1:
            raise ValueError(f"min_starts must be at least 1, not {self.min_starts}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, not {self.window_s}")
        if self.restart_counter_threshold < 1:
            raise ValueError(
                f"restart_counter_threshold must be at least 1, not "
                f"{self.restart_counter_threshold}"
            )
        if not self.stable_s >= 0:
            raise ValueError(f"stable_s must not be negative, not {self.stable_s}")


class Cause(StrEnum):
    """Why a unit's runs fail, as far as the evidence goes."""

    GPU_NEEDS_RESET = "gpu-needs-reset"
    """A GPU of the unit's set needs a reset or reboot: no kill or restart can free it."""
    STALE_GPU_HOLDERS = "stale-gpu-holders"
    """Processes from earlier runs hold the GPUs, or the server said GPU memory was taken."""
    NOT_GPU_RELATED = "not-gpu-related"
    """Every failure looks the same and the GPUs are idle: a config or code problem."""
    UNKNOWN = "unknown"
    """Not enough evidence either way."""


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    """What an inventory of the unit's GPUs showed when judging; the detector never looks itself.

    ``stale_holders``: one phrase per holder attributed to an earlier invocation (or left over
    outside it), e.g. "PID 123 (sglang::scheduler_TP0) from an earlier invocation holds GPU 0,
    20480 MiB". ``gpus_busy``: some GPU of the unit's set is not idle (any holder, stale or not,
    or memory still in use without a process: a driver still tearing down). ``needs_reset``: one
    phrase per GPU of the set that needs a reset, e.g. "GPU 1: a memory row remap is pending".
    """

    stale_holders: tuple[str, ...] = ()
    gpus_busy: bool = False
    needs_reset: tuple[str, ...] = ()
    cuda_devices: tuple[str, ...] | None = None
    """What each CUDA device the unit sees is (oomdevice.device_phrases): device k is entry k;
    None when the numbering cannot be told, with the reason in ``cuda_note``."""
    cuda_note: str | None = None


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The verdict on one unit at one moment, with the lines that explain it."""

    unit: str
    looping: bool
    reason: str
    """One line: why looping, or why not."""
    starts_in_window: int
    """Runs that started inside the window (distinct invocations)."""
    n_restarts: int | None
    """systemd's restart counter at the newest restart inside the window, if any."""
    failures_in_window: int
    """Runs that failed inside the window (distinct invocations)."""
    evidence: tuple[str, ...]
    """One line per notable event, oldest first: time, run, what happened."""
    cause: Cause
    cause_detail: str
    first_failure_s: float | None
    """When the current series of failures began (since the last good run)."""
    immediate: bool
    """A sign that the next start will fail too (left-over process at start, stop timeout
    followed by a failed start): act without waiting for more failures."""
    good_start_s: float | None = None
    """When the newest run of the window that stayed up (or ended cleanly) started: a fault
    before it did not keep the unit down (xidfaults)."""
    oom_device: int | None = None
    """The CUDA device the newest out-of-memory line of the current failures names, as the
    server numbers its GPUs (foreign text: only ever mapped onto the unit's own GPUs)."""
    start_limit_hit: bool = False
    """The newest run hit systemd's start limit: systemd ended the loop and will not start the
    unit again until ``systemctl reset-failed``."""
    findings: tuple[str, ...] = ()
    """What is worth saying that is no loop: a left-over process found at a start that neither
    failed nor was a restart."""


class _Outcome(StrEnum):
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
_IGNORED_FOR_VERDICT: Final = frozenset({EventKind.STOPPING, EventKind.STOPPED})
# A main process killed by one of these ended cleanly for systemd (SuccessExitStatus= implied).
_CLEAN_SIGNALS: Final = frozenset({"TERM", "INT", "HUP", "PIPE"})
_ENDS_SERIES: Final = frozenset({_Outcome.OK, _Outcome.STOPPED})
_OOM_PER_RUN: Final = 3
_EVIDENCE_LINES: Final = 20
_SHOWN_HOLDERS: Final = 3
_SHORT_ID: Final = 8
# The restart counter alone is not a rate (it only resets on a manual start): it makes a loop
# only when failures also repeat inside the window.
_COUNTER_MIN_FAILURES: Final = 2
# One failure says nothing about the next: "not GPU related" needs the same failure repeated.
_PATTERN_MIN_FAILURES: Final = 2


@dataclass(slots=True)
class _Run:
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
            self.started_s = _earliest(self.started_s, event.monotonic_s)
        elif kind is EventKind.DEACTIVATED:
            self.deactivated_s = _earliest(self.deactivated_s, event.monotonic_s)
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
                self.start_limit_s = _earliest(self.start_limit_s, event.monotonic_s)
                self._fail(event.monotonic_s)
            case EventKind.MAIN_EXITED:
                self.exit = self.exit or event
                if not _clean_exit(event):
                    self._fail(event.monotonic_s)
            case EventKind.STOPPING | EventKind.STOPPED if event.job_type == "stop":
                self.stop_requested_s = _earliest(self.stop_requested_s, event.monotonic_s)
            case EventKind.RESTART_SCHEDULED:
                self.restart_s = _earliest(self.restart_s, event.monotonic_s)
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
        self.failure_s = _earliest(self.failure_s, at_s)

    def outcome(self, now: float, stable_s: float) -> _Outcome:
        """STOPPED, FAILED, OK, PENDING or UNKNOWN at ``now``."""
        if self.stop_requested_s is not None:
            # A clean end is OK whoever asked; one that failed (a stop that timed out) was
            # still wanted: STOPPED, never a failure of the series.
            clean = self.failure_s is None and self.deactivated_s is not None
            return _Outcome.OK if clean else _Outcome.STOPPED
        if self.failure_s is not None:
            return _Outcome.FAILED
        if self.deactivated_s is not None:
            return _Outcome.OK
        if self.started_s is not None:
            return _Outcome.OK if now - self.started_s >= stable_s else _Outcome.PENDING
        return _Outcome.PENDING if self.start_marker or self.oom else _Outcome.UNKNOWN

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
                text += f" (status {self.exit.exit_status})"
            elif self.exit.signal is not None:
                text += f" ({self.exit.exit_code} by SIG{self.exit.signal})"
            else:
                text += f" ({self.exit.exit_code}, signal {self.exit.exit_status})"
        return text


@dataclass(frozen=True, slots=True)
class _View:
    """The window at one moment, as the rules see it (internal)."""

    now: float
    events: tuple[UnitEvent, ...]
    runs: tuple[tuple[_Run, _Outcome], ...]
    """Every run of the window with its outcome, oldest first."""
    known: tuple[tuple[_Run, _Outcome], ...]
    """The runs whose start or outcome the window shows."""
    episode: tuple[tuple[_Run, _Outcome], ...]
    """The known runs after the newest OK or STOPPED one: the current series."""
    n_restarts: int | None

    @property
    def newest(self) -> tuple[_Run, _Outcome] | None:
        return self.known[-1] if self.known else None

    @property
    def failed(self) -> tuple[_Run, ...]:
        """The failed runs of the current series."""
        return tuple(run for run, outcome in self.episode if outcome is _Outcome.FAILED)

    @property
    def streak(self) -> int:
        """Failed runs in a row back from the newest; a starting run between them is skipped."""
        return len(self.failed)


@dataclass(frozen=True, slots=True)
class _Verdict:
    looping: bool
    immediate: bool
    reason: str


def _looping(reason: str, *, immediate: bool = False) -> _Verdict:
    return _Verdict(looping=True, immediate=immediate, reason=reason)


def _not_looping(reason: str) -> _Verdict:
    return _Verdict(looping=False, immediate=False, reason=reason)


class Detector:
    """Restart-loop detection for one unit: ``observe`` events, ``diagnose`` at a given time.

    Events of other units, duplicates (same cursor), events older than the window before the
    newest one seen, events up to the last ``reset`` and out-of-memory lines past
    ``_OOM_PER_RUN`` of a run are ignored. Events are kept in monotonic order whatever order
    they arrive in; nothing reads a clock.
    """

    def __init__(
        self, unit: str, settings: LoopSettings | None = None, *, tz: tzinfo = timezone.utc
    ) -> None:
        """Watch ``unit``; evidence lines show times in ``tz`` (UTC unless the caller says)."""
        self.unit: Final = unit
        self.settings: Final = settings or LoopSettings()
        self._tz = tz
        self._events: list[UnitEvent] = []
        self._cursors: set[str] = set()
        self._newest_s: float | None = None
        self._floor_s: float | None = None
        self._boot: str | None = None
        self._oom_kept: dict[str | None, int] = {}
        # Wall minus monotonic at the newest event with a wall stamp: evidence times for people.
        self._wall_offset_s: float | None = None

    @property
    def events(self) -> tuple[UnitEvent, ...]:
        """The events kept, oldest first."""
        return tuple(self._events)

    def observe(self, event: UnitEvent, *, live: bool) -> bool:
        """Record ``event``; True when it is new, live and could change the verdict.

        ``live=False`` is for history replayed when the daemon starts: it is recorded so that a
        later live event is judged with its context, but it never asks for a judgement itself.
        """
        if event.unit != self.unit or event.cursor in self._cursors:
            return False
        if event.boot_id != self._boot:
            # Monotonic stamps of two boots cannot be compared: the newer boot's timeline wins
            # (the follower reads one boot, so this happens once, at the first event).
            self._drop(len(self._events))
            self._boot, self._newest_s, self._floor_s = event.boot_id, None, None
        if self._floor_s is not None and event.monotonic_s <= self._floor_s:
            return False
        horizon = self.settings.window_s
        if self._newest_s is not None and event.monotonic_s < self._newest_s - horizon:
            return False
        if event.kind is EventKind.GPU_OOM_OUTPUT:
            if self._oom_kept.get(event.invocation_id, 0) >= _OOM_PER_RUN:
                return False
            self._oom_kept[event.invocation_id] = self._oom_kept.get(event.invocation_id, 0) + 1
        bisect.insort_right(self._events, event, key=_position)
        self._cursors.add(event.cursor)
        if self._newest_s is None or event.monotonic_s > self._newest_s:
            self._newest_s = event.monotonic_s
            if event.realtime_s is not None:
                self._wall_offset_s = event.realtime_s - event.monotonic_s
            self._forget_before(self._newest_s - horizon)
        return live and asks_for_judgement(event.kind)

    def reset(self, now: float) -> None:
        """Forget everything up to ``now``: call it once a recovery has restarted the unit.

        Window expiry alone is not enough: the failures that led to the recovery would stay
        counted for ``window_s``, so the first failure after it would look like the same loop
        and trigger a second recovery at once. Entries up to ``now`` that arrive later (a
        journal resume) are ignored too.
        """
        self._floor_s = now if self._floor_s is None else max(self._floor_s, now)
        self._drop(sum(1 for event in self._events if event.monotonic_s <= now))

    def diagnose(self, now: float, gpu: GpuEvidence | None) -> Diagnosis:
        """The verdict at ``now`` from the events in the window and, if given, a GPU inventory."""
        view = self._view(now)
        verdict = self._verdict(view)
        cause, cause_detail = _cause(view.failed, gpu)
        failures = [run.failure_s for run in view.failed if run.failure_s is not None]
        good = [
            run.started_s
            for run, out in view.known
            if out is _Outcome.OK and run.started_s is not None
        ]
        return Diagnosis(
            unit=self.unit,
            looping=verdict.looping,
            reason=verdict.reason,
            starts_in_window=sum(1 for run, _ in view.runs if run.start_marker),
            n_restarts=view.n_restarts,
            failures_in_window=sum(1 for _, out in view.runs if out is _Outcome.FAILED),
            evidence=self._evidence(view),
            cause=cause,
            cause_detail=cause_detail,
            first_failure_s=min(failures, default=None),
            immediate=verdict.immediate,
            good_start_s=max(good, default=None),
            oom_device=next((run.oom[0].device for run in reversed(view.failed) if run.oom), None),
            start_limit_hit=verdict.looping and _newest_hit_start_limit(view),
            findings=() if verdict.looping else _left_over_findings(view),
        )

    def _view(self, now: float) -> _View:
        since = now - self.settings.window_s
        events = tuple(event for event in self._events if event.monotonic_s >= since)
        grouped = _runs(events)
        for run in grouped:
            run.settle(self.settings.stable_s)
        runs = tuple((run, run.outcome(now, self.settings.stable_s)) for run in grouped)
        known = tuple(pair for pair in runs if pair[1] is not _Outcome.UNKNOWN)
        good = [index for index, (_, out) in enumerate(known) if out in _ENDS_SERIES]
        episode = known[good[-1] + 1 :] if good else known
        restarts = [e.n_restarts for e in events if e.kind is EventKind.RESTART_SCHEDULED]
        return _View(now, events, runs, known, episode, restarts[-1] if restarts else None)

    def _verdict(self, view: _View) -> _Verdict:
        """Looping or not, immediate or not, and why."""
        newest = view.newest
        if newest is None:
            window = _secs(self.settings.window_s)
            return _not_looping(f"no start or failure of {self.unit} in the last {window}")
        run, outcome = newest
        if outcome in _ENDS_SERIES:
            return self._settled(view, run, outcome)
        rules = (self._streak_rule, self._counter_rule, self._left_over_rule, self._timeout_rule)
        held = [v for v in (rule(view, run, outcome) for rule in rules) if v is not None]
        if held:
            # The first rule that holds gives the reason; any immediate sign makes it immediate.
            immediate = any(verdict.immediate for verdict in held)
            reason = held[0].reason
            if run.start_limit_s is not None:
                reason += (
                    f"; systemd's start limit ended the loop at {self._clock(run.start_limit_s)} "
                    f"(start request repeated too quickly): it will not start {self.unit} again "
                    f"until, once the cause is fixed, `systemctl reset-failed {self.unit}`"
                )
            return _looping(reason, immediate=immediate)
        if outcome is _Outcome.PENDING:
            return _not_looping(f"run {_abbrev(run)} is starting")
        streak = view.streak
        return _not_looping(
            f"{streak} failed run{'' if streak == 1 else 's'} in a row within "
            f"{_secs(self.settings.window_s)}; a loop takes {self.settings.min_starts}",
        )

    def _settled(self, view: _View, run: _Run, outcome: _Outcome) -> _Verdict:
        """Why a newest run that ended OK or was stopped on request is no loop."""
        if outcome is _Outcome.STOPPED:
            return _not_looping(
                f"run {_abbrev(run)} was stopped by a stop job at "
                f"{self._clock(run.stop_requested_s or view.now)} (an operator, a conflicting "
                "unit or gpuguard): a stopped unit stays stopped"
            )
        if run.deactivated_s is not None:
            return _not_looping(f"the last run {_abbrev(run)} ended cleanly")
        up_s = _secs(view.now - (run.started_s or view.now))
        return _not_looping(f"run {_abbrev(run)} is up for {up_s} without failing")

    def _streak_rule(self, view: _View, run: _Run, outcome: _Outcome) -> _Verdict | None:
        """The newest run failed, and so did the ``min_starts`` runs before it (itself included)."""
        if outcome is not _Outcome.FAILED or view.streak < self.settings.min_starts:
            return None
        return _looping(
            f"{view.streak} failed runs in a row within {_secs(self.settings.window_s)}, "
            f"the last at {self._clock(run.failure_s or view.now)}",
        )

    def _counter_rule(self, view: _View, _run: _Run, outcome: _Outcome) -> _Verdict | None:
        """The newest run failed, systemd's restart counter is high, and failures repeat."""
        threshold = self.settings.restart_counter_threshold
        if (
            outcome is not _Outcome.FAILED
            or view.n_restarts is None
            or view.n_restarts < threshold
            or view.streak < _COUNTER_MIN_FAILURES
        ):
            return None
        return _looping(
            f"systemd's restart counter is at {view.n_restarts} (threshold {threshold}) and "
            f"{view.streak} runs failed within {_secs(self.settings.window_s)}",
        )

    @staticmethod
    def _left_over_rule(view: _View, run: _Run, outcome: _Outcome) -> _Verdict | None:
        """The newest run found an earlier run's processes in its cgroup, and failed or restarted.

        Alone (no failure, no scheduled restart), a left-over at start is a finding.
        """
        if not run.left_over:
            return None
        if outcome is not _Outcome.FAILED and not view.failed:
            return None
        first = run.left_over[0]
        return _looping(
            f"run {_abbrev(run)} started with left-over process {first.pid} ({first.comm}) "
            f"of an earlier run in its control group",
            immediate=True,
        )

    def _timeout_rule(self, view: _View, _run: _Run, _outcome: _Outcome) -> _Verdict | None:
        """A stop timed out and the next start failed: what survived the stop is in the way."""
        current = {run.invocation_id for run, _ in view.episode}
        for event in view.events:
            if event.kind is not EventKind.STOP_TIMED_OUT:
                continue
            later = [
                (run, outcome)
                for run, outcome in view.known
                if run.first_s > event.monotonic_s and run.invocation_id != event.invocation_id
            ]
            if not later:
                continue
            run, outcome = later[0]
            if outcome is _Outcome.FAILED and run.invocation_id in current:
                return _looping(
                    f"a stop timed out at {self._clock(event.monotonic_s)} and the next "
                    f"start, run {_abbrev(run)}, failed",
                    immediate=True,
                )
        return None

    def _evidence(self, view: _View) -> tuple[str, ...]:
        """The notable events of the window as lines, oldest first, the newest few kept."""
        lines = [line for run, outcome in view.runs for line in _run_lines(run, outcome)]
        lines.extend(_event_lines(view.events))
        lines.sort()
        return tuple(f"{self._clock(at_s)} {text}" for at_s, text in lines[-_EVIDENCE_LINES:])

    def _clock(self, at_s: float) -> str:
        """A monotonic time as the wall clock showed it near the newest event ("?" if unknown)."""
        if self._wall_offset_s is None:
            return "?"
        try:
            return datetime.fromtimestamp(at_s + self._wall_offset_s, self._tz).strftime("%H:%M:%S")
        except (ValueError, OverflowError, OSError):
            return "?"

    def _forget_before(self, since: float) -> None:
        """Forget the events older than ``since``."""
        self._drop(bisect.bisect_left(self._events, (since, ""), key=_position))

    def _drop(self, count: int) -> None:
        """Forget the ``count`` oldest events."""
        for event in self._events[:count]:
            self._cursors.discard(event.cursor)
            if event.kind is EventKind.GPU_OOM_OUTPUT:
                left = self._oom_kept.get(event.invocation_id, 1) - 1
                if left > 0:
                    self._oom_kept[event.invocation_id] = left
                else:
                    self._oom_kept.pop(event.invocation_id, None)
        del self._events[:count]


def asks_for_judgement(kind: EventKind) -> bool:
    """Whether a live event of this kind makes the daemon judge (``explain`` replays the same)."""
    return kind not in _IGNORED_FOR_VERDICT


def _runs(events: Iterable[UnitEvent]) -> list[_Run]:
    """Events grouped into runs by invocation, oldest run first.

    An event without an invocation ID (PID 1 always sets one; tolerated all the same) joins the
    run in progress at its time, or is dropped when there is none.
    """
    by_id: dict[str, _Run] = {}
    orphans: list[UnitEvent] = []
    for event in events:
        if event.invocation_id is None:
            orphans.append(event)
            continue
        run = by_id.get(event.invocation_id)
        if run is None:
            run = by_id[event.invocation_id] = _Run(event.invocation_id, event.monotonic_s)
        run.add(event)
    runs = sorted(by_id.values(), key=lambda run: (run.first_s, run.invocation_id))
    for event in orphans:
        owners = [run for run in runs if run.first_s <= event.monotonic_s]
        if owners:
            owners[-1].add(event)
    return runs


def _newest_hit_start_limit(view: _View) -> bool:
    newest = view.newest
    return newest is not None and newest[0].start_limit_s is not None


def _left_over_findings(view: _View) -> tuple[str, ...]:
    """The newest run's left-over processes at start, when they made no loop."""
    newest = view.newest
    if newest is None:
        return ()
    run = newest[0]
    seen = dict.fromkeys((event.pid, event.comm) for event in run.left_over)
    return tuple(
        f"run {_abbrev(run)} found left-over process {pid} ({comm}) of an earlier run in its "
        "control group at start, with no failure and no scheduled restart: a finding, not a "
        "loop (KillMode=process or none leaves processes behind)"
        for pid, comm in seen
    )


def _run_lines(run: _Run, outcome: _Outcome) -> list[tuple[float, str]]:
    """Evidence lines about one run: left-over processes, GPU OOM output, how it ended."""
    short = _abbrev(run)
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
        lines.append((run.oom[0].monotonic_s, f"run {short} printed: {_cut(run.oom[0].message)}"))
    if run.start_limit_s is not None:
        lines.append((run.start_limit_s, f"run {short}: start limit hit, no more restarts"))
    if run.stop_requested_s is not None:
        lines.append((run.stop_requested_s, f"run {short} stopped by a stop job"))
    if outcome in {_Outcome.FAILED, _Outcome.STOPPED} and run.failure_s is not None:
        lines.append((run.failure_s, f"run {short} failed: {run.describe_failure()}"))
    elif outcome is _Outcome.OK and run.deactivated_s is not None:
        lines.append((run.deactivated_s, f"run {short} ended cleanly"))
    elif outcome is _Outcome.OK and run.started_s is not None:
        lines.append((run.started_s, f"run {short} started and stayed up"))
    return lines


def _event_lines(events: Iterable[UnitEvent]) -> list[tuple[float, str]]:
    """Evidence lines about the stop path and the newest restart counter."""
    lines: list[tuple[float, str]] = []
    restart: UnitEvent | None = None
    for event in events:
        short = _abbrev(event.invocation_id)
        if event.kind is EventKind.STOP_TIMED_OUT:
            state = "final-sigterm" if event.final else "stop-sigterm"
            lines.append((event.monotonic_s, f"run {short}: {state} timed out, SIGKILL sent"))
        elif event.kind is EventKind.SURVIVED_SIGKILL:
            which = "final SIGKILL" if event.final else "SIGKILL"
            lines.append((event.monotonic_s, f"run {short}: processes survived {which}"))
        elif event.kind is EventKind.RESTART_SCHEDULED:
            restart = event
    if restart is not None:
        lines.append((restart.monotonic_s, f"restart scheduled, counter at {restart.n_restarts}"))
    return lines


def _cause(failed: Sequence[_Run], gpu: GpuEvidence | None) -> tuple[Cause, str]:
    """The cause and one line on it, from the current series of failures and the inventory."""
    if gpu is not None and gpu.needs_reset:
        return Cause.GPU_NEEDS_RESET, "; ".join(gpu.needs_reset)
    gpu_cause = _gpu_cause(failed, gpu)
    if gpu_cause is not None:
        return gpu_cause
    doubt = _doubt(failed, gpu)
    if doubt is not None:
        return Cause.UNKNOWN, doubt
    return Cause.NOT_GPU_RELATED, (
        f"every failed run ended the same way, {failed[-1].describe_failure()}, with the "
        f"GPUs idle and no GPU out-of-memory output"
    )


def _doubt(failed: Sequence[_Run], gpu: GpuEvidence | None) -> str | None:
    """Why the failures cannot be called "not GPU related", or None when they can."""
    if not failed:
        return "no failed run to explain"
    if gpu is None:
        return "no GPU inventory to rule out stale holders"
    if gpu.gpus_busy:
        return "the GPUs are busy, but no holder is from an earlier run"
    if len(failed) < _PATTERN_MIN_FAILURES:
        return f"one failure, {failed[0].describe_failure()}, is not a pattern yet"
    if len({run.way() for run in failed}) > 1:
        ways = ", ".join(sorted({run.describe_failure() for run in failed}))
        return f"the failed runs ended in different ways: {ways}"
    return None


def _gpu_cause(failed: Sequence[_Run], gpu: GpuEvidence | None) -> tuple[Cause, str] | None:
    """Stale holders named by the inventory, else GPU OOM output of a failed run, else None."""
    if gpu is not None and gpu.stale_holders:
        shown = "; ".join(gpu.stale_holders[:_SHOWN_HOLDERS])
        more = len(gpu.stale_holders) - _SHOWN_HOLDERS
        return Cause.STALE_GPU_HOLDERS, shown + (f"; and {more} more" if more > 0 else "")
    oom_runs = [run for run in failed if run.oom]
    if not oom_runs:
        return None
    run = oom_runs[-1]
    detail = f"run {_abbrev(run)} printed: {_cut(run.oom[0].message)}"
    device = run.oom[0].device
    if device is not None and gpu is None:
        detail += f" (CUDA device {device} as the server numbers its GPUs)"
    elif device is not None and gpu is not None:
        detail += f"; {describe_device(device, gpu.cuda_devices, gpu.cuda_note)}"
    if gpu is not None:
        detail += " (no stale holder found now)"
    return Cause.STALE_GPU_HOLDERS, detail


def _clean_exit(event: UnitEvent) -> bool:
    """Whether systemd counts a main-process exit as success (status 0, or TERM/INT/HUP/PIPE)."""
    if event.exit_code == "exited":
        return event.exit_status == 0
    if event.exit_code == "killed":
        return event.signal in _CLEAN_SIGNALS
    return event.exit_code is None


def _earliest(current: float | None, candidate: float) -> float:
    return candidate if current is None else min(current, candidate)


def _position(event: UnitEvent) -> tuple[float, str]:
    """Journal order: by time, then by cursor so ties sort the same whatever the arrival."""
    return (event.monotonic_s, event.cursor)


def _abbrev(run: _Run | str | None) -> str:
    """A run's invocation ID cut to 8 characters for people, like a short git hash."""
    invocation_id = run.invocation_id if isinstance(run, _Run) else run
    if invocation_id is None:
        return "?"
    if len(invocation_id) <= _SHORT_ID:
        return invocation_id
    return invocation_id[:_SHORT_ID] + "…"


def _cut(message: str, limit: int = 160) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"


def _secs(seconds: float) -> str:
    """A duration for people: "600 s"."""
    return f"{seconds:.0f} s"
