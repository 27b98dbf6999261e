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
* loop by systemd's counter alone (``_climb_rule``, ``_far_counter_rule``): the counter climbed by
  ``min_starts`` within the window (each automatic restart follows a run that ended: systemd
  counted the streak), or it is ``_FAR_FACTOR`` times ``restart_counter_threshold`` or more (it
  resets only on a manual start); for a failed newest run, or a starting one when the window
  shows no failed run at all (``_counted_now``); a newest run that hit the start limit is a loop
  too (only repeated starts reach it);
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
  holds a failure (systemd restarted it) and, while that restart is still starting, a GPU
  inventory (when given) shows a stale holder or a left-over PID holding a GPU of the unit's
  set; or the first start after a stop timeout failed. A left-over at a start with no failure
  and no scheduled restart (an operator's start after a ``KillMode=process`` run), or one that
  holds none of the unit's GPUs at a restart still starting (one crash, one restart, and a
  crashed vLLM's ``resource_tracker`` left in the cgroup), is a finding
  (``Diagnosis.findings``), not a loop;
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
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from functools import partial
from typing import Final

from gpuguard.core.events import EventKind, UnitEvent
from gpuguard.core.loopcause import Cause, GpuEvidence, judge_cause
from gpuguard.core.loopruns import (
    ENDS_SERIES,
    Outcome,
    Run,
    View,
    abbrev,
    event_lines,
    run_lines,
    runs_of,
)

__all__ = [
    "Cause",
    "Detector",
    "Diagnosis",
    "GpuEvidence",
    "LoopSettings",
    "asks_for_judgement",
]


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
    before it did not keep the unit down (xid.faults)."""
    oom_device: int | None = None
    """The CUDA device the newest out-of-memory line of the current failures names, as the
    server numbers its GPUs (foreign text: only ever mapped onto the unit's own GPUs)."""
    start_limit_hit: bool = False
    """The newest run hit systemd's start limit: systemd ended the loop and will not start the
    unit again until ``systemctl reset-failed``."""
    findings: tuple[str, ...] = ()
    """What is worth saying that is no loop: a left-over process found at a start that neither
    failed nor was a restart."""


_IGNORED_FOR_VERDICT: Final = frozenset({EventKind.STOPPING, EventKind.STOPPED})
_OOM_PER_RUN: Final = 3
_EVIDENCE_LINES: Final = 20
# The restart counter alone is not a rate (it only resets on a manual start): it makes a loop
# only when failures also repeat inside the window.
_COUNTER_MIN_FAILURES: Final = 2
# A counter this many times the threshold is a loop without failures in view (_far_counter_rule).
_FAR_FACTOR: Final = 100


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
        verdict = self._verdict(view, gpu)
        cause, cause_detail = judge_cause(view.failed, gpu)
        failures = [run.failure_s for run in view.failed if run.failure_s is not None]
        good = [
            run.started_s
            for run, out in view.known
            if out is Outcome.OK and run.started_s is not None
        ]
        return Diagnosis(
            unit=self.unit,
            looping=verdict.looping,
            reason=verdict.reason,
            starts_in_window=sum(1 for run, _ in view.runs if run.start_marker),
            n_restarts=view.n_restarts,
            failures_in_window=sum(1 for _, out in view.runs if out is Outcome.FAILED),
            evidence=self._evidence(view),
            cause=cause,
            cause_detail=cause_detail,
            first_failure_s=min(failures, default=None),
            immediate=verdict.immediate,
            good_start_s=max(good, default=None),
            oom_device=next((run.oom[0].device for run in reversed(view.failed) if run.oom), None),
            start_limit_hit=verdict.looping and _newest_hit_start_limit(view),
            findings=() if verdict.looping else _left_over_findings(view, gpu),
        )

    def _view(self, now: float) -> View:
        since = now - self.settings.window_s
        events = tuple(event for event in self._events if event.monotonic_s >= since)
        grouped = runs_of(events)
        for run in grouped:
            run.settle(self.settings.stable_s)
        runs = tuple((run, run.outcome(now, self.settings.stable_s)) for run in grouped)
        known = tuple(pair for pair in runs if pair[1] is not Outcome.UNKNOWN)
        good = [index for index, (_, out) in enumerate(known) if out in ENDS_SERIES]
        episode = known[good[-1] + 1 :] if good else known
        restarts = [e.n_restarts for e in events if e.kind is EventKind.RESTART_SCHEDULED]
        counters = tuple(n for n in restarts if n is not None)
        return View(now, events, runs, known, episode, restarts[-1] if restarts else None, counters)

    def _verdict(self, view: View, gpu: GpuEvidence | None) -> _Verdict:
        """Looping or not, immediate or not, and why."""
        newest = view.newest
        if newest is None:
            window = _secs(self.settings.window_s)
            return _not_looping(f"no start or failure of {self.unit} in the last {window}")
        run, outcome = newest
        if outcome in ENDS_SERIES:
            return self._settled(view, run, outcome)
        rules = (
            self._streak_rule,
            self._counter_rule,
            self._climb_rule,
            self._far_counter_rule,
            partial(_left_over_rule, gpu=gpu),
            self._timeout_rule,
            self._start_limit_rule,
        )
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
        if outcome is Outcome.PENDING and run.started_s is not None:
            # systemd says Started (for Type=simple, the fork): not "starting", not yet "up".
            return _not_looping(
                f"run {abbrev(run)} started at {self._clock(run.started_s)} and has not failed "
                f"(up {_secs(self.settings.stable_s)} counts as healthy)"
            )
        if outcome is Outcome.PENDING:
            return _not_looping(f"run {abbrev(run)} is starting")
        streak = view.streak
        return _not_looping(
            f"{streak} failed run{'' if streak == 1 else 's'} in a row within "
            f"{_secs(self.settings.window_s)}; a loop takes {self.settings.min_starts}",
        )

    def _settled(self, view: View, run: Run, outcome: Outcome) -> _Verdict:
        """Why a newest run that ended OK or was stopped on request is no loop."""
        if outcome is Outcome.STOPPED:
            return _not_looping(
                f"run {abbrev(run)} was stopped by a stop job at "
                f"{self._clock(run.stop_requested_s or view.now)} (an operator, a conflicting "
                "unit or gpuguard): a stopped unit stays stopped"
            )
        if run.deactivated_s is not None:
            return _not_looping(f"the last run {abbrev(run)} ended cleanly")
        up_s = _secs(view.now - (run.started_s or view.now))
        return _not_looping(f"run {abbrev(run)} is up for {up_s} without failing")

    def _streak_rule(self, view: View, run: Run, outcome: Outcome) -> _Verdict | None:
        """The newest run failed, and so did the ``min_starts`` runs before it (itself included)."""
        if outcome is not Outcome.FAILED or view.streak < self.settings.min_starts:
            return None
        return _looping(
            f"{view.streak} failed runs in a row within {_secs(self.settings.window_s)}, "
            f"the last at {self._clock(run.failure_s or view.now)}",
        )

    def _counter_rule(self, view: View, _run: Run, outcome: Outcome) -> _Verdict | None:
        """The newest run failed, systemd's restart counter is high, and failures repeat."""
        threshold = self.settings.restart_counter_threshold
        if (
            outcome is not Outcome.FAILED
            or view.n_restarts is None
            or view.n_restarts < threshold
            or view.streak < _COUNTER_MIN_FAILURES
        ):
            return None
        return _looping(
            f"systemd's restart counter is at {view.n_restarts} (threshold {threshold}) and "
            f"{view.streak} runs failed within {_secs(self.settings.window_s)}",
        )

    def _climb_rule(self, view: View, _run: Run, outcome: Outcome) -> _Verdict | None:
        """Whether systemd restarted the unit ``min_starts`` times in the window, by its counter.

        Each automatic restart follows a run that ended (failed, or exited under
        ``Restart=always``): systemd's own count is the streak, even where the window shows no
        failure line (an excerpt, a journal that lost lines). When (``_counted_now``).
        """
        if not _counted_now(view, outcome):
            return None
        climbed = view.climb
        if climbed < self.settings.min_starts:
            return None
        counters = view.restart_counters
        return _looping(
            f"systemd restarted {self.unit} {climbed} times within "
            f"{_secs(self.settings.window_s)} (restart counter up to {counters[-1]}): each "
            "automatic restart follows a run that ended",
        )

    def _far_counter_rule(self, view: View, _run: Run, outcome: Outcome) -> _Verdict | None:
        """Whether systemd's restart counter is far past the threshold, whatever the window shows.

        The counter resets only when someone starts the unit by hand; ``_FAR_FACTOR`` times the
        threshold (500 by default) automatic restarts without that are a loop at any rate. When
        (``_counted_now``).
        """
        far = self.settings.restart_counter_threshold * _FAR_FACTOR
        if not _counted_now(view, outcome):
            return None
        if view.n_restarts is None or view.n_restarts < far:
            return None
        return _looping(
            f"systemd's restart counter is at {view.n_restarts}, at least {far} ({_FAR_FACTOR} "
            "times the threshold): it resets only when the unit is started by hand, so that "
            "many automatic restarts are a loop even with no failure in view",
        )

    @staticmethod
    def _start_limit_rule(_view: View, run: Run, outcome: Outcome) -> _Verdict | None:
        """The newest run hit systemd's start limit: only repeated starts reach it."""
        if outcome is not Outcome.FAILED or run.start_limit_s is None:
            return None
        return _looping(
            f"run {abbrev(run)} hit systemd's start limit: systemd refuses a start only after "
            "StartLimitBurst= starts within StartLimitIntervalSec=, so the starts were looping",
        )

    def _timeout_rule(self, view: View, _run: Run, _outcome: Outcome) -> _Verdict | None:
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
            if outcome is Outcome.FAILED and run.invocation_id in current:
                return _looping(
                    f"a stop timed out at {self._clock(event.monotonic_s)} and the next "
                    f"start, run {abbrev(run)}, failed",
                    immediate=True,
                )
        return None

    def _evidence(self, view: View) -> tuple[str, ...]:
        """The notable events of the window as lines, oldest first, the newest few kept."""
        lines = [line for run, outcome in view.runs for line in run_lines(run, outcome)]
        lines.extend(event_lines(view.events))
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


def _counted_now(view: View, outcome: Outcome) -> bool:
    """Whether systemd's counter may make a loop of the newest run now.

    A failed newest run, always; a starting one only when the window shows no failed run at
    all: with failures in view the daemon waits for the run to end, as for every other rule (a
    server still loading may come up), but with none it would never see one end.
    """
    if outcome is Outcome.FAILED:
        return True
    return outcome is Outcome.PENDING and not any(o is Outcome.FAILED for _, o in view.runs)


def _newest_hit_start_limit(view: View) -> bool:
    newest = view.newest
    return newest is not None and newest[0].start_limit_s is not None


def _left_over_rule(
    view: View, run: Run, outcome: Outcome, gpu: GpuEvidence | None
) -> _Verdict | None:
    """The newest run found an earlier run's processes in its cgroup, and failed or restarted.

    Alone (no failure, no scheduled restart), a left-over at start is a finding. A restart
    still starting after a failure is a loop only while a left-over may hold the unit's GPUs:
    with no inventory yet (the daemon then looks), or when the inventory shows a stale holder
    or a left-over PID among the holders of the unit's GPUs (``_holds_gpu``). A left-over that
    holds nothing (multiprocessing's ``resource_tracker`` of a crashed vLLM) is a finding.
    """
    if not run.left_over:
        return None
    if outcome is not Outcome.FAILED and not view.failed:
        return None
    if outcome is not Outcome.FAILED and gpu is not None and not _holds_gpu(run, gpu):
        return None
    first = run.left_over[0]
    return _looping(
        f"run {abbrev(run)} started with left-over process {first.pid} ({first.comm}) "
        f"of an earlier run in its control group",
        immediate=True,
    )


def _holds_gpu(run: Run, gpu: GpuEvidence) -> bool:
    """Whether the inventory shows a stale holder, or a left-over of ``run`` holding a GPU."""
    return bool(gpu.stale_holders) or any(
        event.pid in gpu.holder_pids for event in run.left_over if event.pid is not None
    )


def _left_over_findings(view: View, gpu: GpuEvidence | None) -> tuple[str, ...]:
    """The newest run's left-over processes at start, when they made no loop."""
    newest = view.newest
    if newest is None:
        return ()
    run = newest[0]
    seen = dict.fromkeys((event.pid, event.comm) for event in run.left_over)
    if view.failed and gpu is not None:
        why = (
            "after a failure, holding none of the unit's GPUs: a finding, not a loop (a "
            "crashed server's helper that holds nothing, such as multiprocessing's "
            "resource_tracker)"
        )
    else:
        why = (
            "with no failure and no scheduled restart: a finding, not a loop (KillMode=process "
            "or none leaves processes behind)"
        )
    return tuple(
        f"run {abbrev(run)} found left-over process {pid} ({comm}) of an earlier run in its "
        f"control group at start, {why}"
        for pid, comm in seen
    )


def _position(event: UnitEvent) -> tuple[float, str]:
    """Journal order: by time, then by cursor so ties sort the same whatever the arrival."""
    return (event.monotonic_s, event.cursor)


def _secs(seconds: float) -> str:
    """A duration for people: "600 s"."""
    return f"{seconds:.0f} s"
