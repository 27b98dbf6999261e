"""Is a watched unit's engine alive, dead while its unit lives, or stuck starting (pure).

systemd sees a unit's main process, not its engine: vLLM's API server keeps running after its
EngineCore died, SGLang's HTTP server outlives its scheduler, and a server that exits with status
0 after its engine died leaves ``Restart=on-failure`` nothing to do. ``Liveness`` follows one
unit's runs from systemd's trusted events and from the lines its own output printed
(``core.enginelines``), and says per unit, at a given monotonic time: up, starting (in which
phase, for how long, against the phases of earlier starts), stuck in a phase past the budget
those starts taught, or engine dead since T (cause); the unit's health check (core.healthcheck)
can also make a run that is up dead, and, for as long as no line or exit said so, alive again
at its first healthy answer. What is at risk: calling a healthy run dead. So a line counts only
for the run that printed it (journald's ``_SYSTEMD_INVOCATION_ID``), and never when its
trusted ``_PID`` is a process of an earlier run: journald stamps a line with the unit's
*current* invocation whoever in its cgroup wrote it, so a left-over of a crashed run (vLLM's
orphaned EngineCore, whose worker was reaped) writes its death lines under the next run's ID.
A writer (``_PID`` with ``_STREAM_ID``: before systemd 256 a stdout line's ``_PID`` is the
process that opened the stream, the earlier run's main process, dead or not, and its stream ID
tells it from a reuse of its PID) is an earlier run's once it wrote a line stamped with another
run; a PID is once systemd named it left over at a start ("Found left-over process N"). A line
with no ``_PID`` counts as before. Never once a stop job for that run began (servers print
death-like lines while shutting down), and a run's end (systemd now sees it) ends its
dead-engine verdict. A budget is learned, never
guessed: with fewer than ``MIN_STARTS`` starts that came up, a slow start is only "starting".

Time is the journal's per-boot monotonic clock, passed in; the wall clock only labels times.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone, tzinfo
from typing import TYPE_CHECKING, Any, Final

from gpuguard.core.enginelines import BY_KEY, PHASE_ORDER, PHASE_WORDS, Phase
from gpuguard.core.events import EventKind
from gpuguard.core.livenessview import DeadEngine, LivenessView, State
from gpuguard.core.startbudgets import (
    STARTS_KEPT,
    PhaseTimes,
    StartRecord,
    parse_starts,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gpuguard.core.events import UnitEvent
    from gpuguard.core.healthcheck import HealthBack, HealthDeath

ENGINE_DEAD_GRACE_S: Final = 10.0
"""A fatal line makes a dead engine once its run still lives this long after it: a server whose
engine dies (at start, typically) usually exits on its own within seconds, and systemd and the
restart-loop detector handle that run. A clean exit nobody asked for is dead at once."""
_ENDS: Final = frozenset(
    {
        EventKind.FAILED,
        EventKind.RESTART_SCHEDULED,
        EventKind.STOPPED,
        EventKind.START_FAILED,
    }
)
"""PID 1's words for "this run is over" (a main-process exit and "Deactivated successfully" are
judged apart: a clean end nobody asked for is a death)."""
_OUTPUT: Final = frozenset({EventKind.ENGINE_FATAL, EventKind.START_PHASE})
_INVOCATION_ID: Final = re.compile(r"[0-9A-Za-z_-]{1,64}")
"""A saved invocation ID, only ever compared with systemd's (32 hex digits, sd-id128)."""
_ENDED_KEPT: Final = 16
"""Ended runs remembered, so that their late lines never open a run again."""
_PAST_BUDGET_S: Final = 0.01
"""A phase is stuck once *past* its budget: the wake comes just after it."""
_SENDERS_KEPT: Final = 256
"""The writers of lines remembered, with the run each wrote for first (the newest kept)."""


@dataclass
class _Run:
    """The run being watched (mutable, private)."""

    invocation_id: str
    started_s: float | None
    phase: Phase = Phase.STARTING
    phase_since_s: float | None = None
    phases: dict[Phase, float] = field(default_factory=dict)
    ready: bool = False
    ready_s: float | None = None
    """Seconds from systemd's start to the ready line (None when the start was not seen)."""
    stop_asked: bool = False
    stuck_counted: bool = False


class Liveness:
    """One watched unit's runs, as far as liveness goes; feed it every event of the unit."""

    def __init__(
        self,
        unit: str,
        server: str,
        *,
        clean_exit_is_death: bool = True,
        tz: tzinfo = timezone.utc,
    ) -> None:
        """Watch ``unit``, which runs ``server`` ("sglang" or "vllm": its phase lines count)."""
        self.unit = unit
        self._server = server
        self._clean_exit = clean_exit_is_death
        self._tz = tz
        self._run: _Run | None = None
        self._dead: DeadEngine | None = None
        """The current run's dead engine, or a fatal line still within its grace."""
        self._confirmed = False
        self._dead_live = False
        self._starts: deque[StartRecord] = deque(maxlen=STARTS_KEPT)
        self._deaths = 0
        self._stuck = 0
        self._learned = 0
        self._ended_runs: deque[str] = deque(maxlen=_ENDED_KEPT)
        self._saved_ready: str | None = None
        """The run an earlier daemon process saw ready (its saved state), for ``resume``."""
        self._senders: dict[tuple[str | None, int, str | None], str] = {}
        """Each line's writer (its boot, ``_PID``, ``_STREAM_ID``) and the run it first wrote
        for, oldest first, at most ``_SENDERS_KEPT``."""
        self._left_over: dict[tuple[str | None, int], None] = {}
        """The PIDs (with their boot) systemd named left over at a start, at most
        ``_SENDERS_KEPT``."""

    @property
    def learned(self) -> int:
        """Starts recorded so far (a change means there is something new to save)."""
        return self._learned

    @property
    def up_run(self) -> str | None:
        """The run that is up (past its ready line) and not dead."""
        run = self._run
        if run is None or not run.ready or self._dead is not None:
            return None
        return run.invocation_id

    @property
    def ready_run(self) -> str | None:
        """The current run once its ready line was seen (saved: a restarted daemon resumes it)."""
        run = self._run
        return run.invocation_id if run is not None and run.ready else None

    def resume(self, invocation_id: str) -> bool:
        """The run systemd runs active now: up again if an earlier daemon saw it ready.

        After a restart of the daemon the journal is read from its saved cursor, past the run's
        ready line; the invocation ID names one run only, so the saved one is still that run.
        """
        if self._run is not None or invocation_id != self._saved_ready:
            return False
        self._run = _Run(invocation_id, None, Phase.READY, ready=True)
        return True

    @property
    def probed_run(self) -> str | None:
        """The run a health check asks: the one up, or one only that check called dead.

        A run dead by its health check alone is still probed, so that a healthy answer can end
        a verdict of three slow probes; a fatal line or an exit 0 is never undone.
        """
        run, dead = self._run, self._dead
        if run is None or not run.ready:
            return None
        if dead is not None and not dead.by_health:
            return None
        return run.invocation_id

    def health_failed(self, death: HealthDeath) -> bool:
        """The run's health check failed often enough: its engine is dead; True when news.

        Only for the run that is up now (``up_run``): a probe of an ended run says nothing. No
        grace, unlike a fatal line: the failures in a row already took that long.
        """
        if death.invocation_id != self.up_run:
            return False
        self._dead = DeadEngine(
            death.invocation_id,
            death.since_s,
            death.since_wall_s,
            death.cause,
            death.cause,
            by_health=True,
            by_silence=death.silent,
        )
        self._confirmed, self._dead_live = True, True
        self._deaths += 1
        return True

    def health_back(self, back: HealthBack) -> bool:
        """The run the health check made dead answered healthy: up again; True when news.

        Only a verdict of the check itself ends so; the deaths counted stay counted.
        """
        dead = self._dead
        if dead is None or not dead.by_health or dead.invocation_id != back.invocation_id:
            return False
        self._dead, self._confirmed = None, False
        return True

    @property
    def dead(self) -> DeadEngine | None:
        """The current run's dead engine, once it is dead (past the grace of a fatal line)."""
        return self._dead if self._confirmed else None

    @property
    def wake_at(self) -> float | None:
        """When the daemon must look again though nothing new was logged; None: no such moment.

        A fatal line's grace ends (``tick`` is due then), or the start's phase runs past its
        learned budget: a hang prints nothing, so without this the stuck start is seen only at
        the loop's next wake for something else (the watchdog's ping, the snapshot's refresh).
        """
        due = [at for at in (self._grace_end(), self._budget_end()) if at is not None]
        return min(due) if due else None

    def _grace_end(self) -> float | None:
        if self._dead is None or self._confirmed:
            return None
        return self._dead.since_s + ENGINE_DEAD_GRACE_S

    def _budget_end(self) -> float | None:
        """Just past the current phase's budget, until a view has called the start stuck."""
        run = self._run
        if run is None or run.ready or run.stuck_counted or run.phase_since_s is None:
            return None
        if self._dead is not None:  # its view is the dead engine's, never stuck
            return None
        times = self.phase_times(run.phase)
        budget = times.budget_s if times else None
        return None if budget is None else run.phase_since_s + budget + _PAST_BUDGET_S

    def tick(self, now: float) -> bool:
        """Confirm a fatal line whose run outlived its grace; True when that makes news.

        News is a line that came live: a death found in replayed history is shown, never news.
        """
        due = self._grace_end()
        if due is None or now < due:
            return False
        self._confirmed = True
        if self._dead_live:
            self._deaths += 1
        return self._dead_live

    def observe(self, event: UnitEvent, *, live: bool) -> bool:
        """Fold one event in; True when a *live* clean exit just made the engine dead.

        A fatal line becomes a dead engine later, in ``tick``, if its run outlives the grace.
        History (``live=False``) rebuilds the same state but never reports a new death: the
        daemon acts only on news, as it does for restart loops.
        """
        invocation = event.invocation_id
        if (
            event.unit != self.unit
            or invocation is None
            or self._earlier_runs(event, invocation)  # a left-over's, under this run's stamp
        ):
            return False
        run = self._run
        dead = self._dead
        restarting = event.kind is EventKind.RESTART_SCHEDULED
        if restarting and dead is not None and dead.invocation_id == invocation:
            self._ended()  # systemd restarts it: the new run is judged afresh
            return False
        if event.kind in {EventKind.STARTING, EventKind.STARTED}:
            self._started(run, event, invocation)
            return False
        if event.kind in _OUTPUT and (run is None or run.invocation_id != invocation):
            if invocation in self._ended_runs:
                return False  # an ended run's line says nothing about the current one
            # A run not seen starting: history began mid-run, or its lines came before PID 1's
            # "Starting" (the output and PID 1's messages are two journalctl streams).
            run = self._new_run(invocation, None)
        if run is None or run.invocation_id != invocation:
            return False
        return self._on_run_event(run, event, live=live)

    def _earlier_runs(self, event: UnitEvent, invocation: str) -> bool:
        """Whether ``event`` is about an earlier run's processes (see the module's doc).

        systemd naming a left-over (remembered), or a line whose writer is a process of another
        run.
        """
        if event.kind is EventKind.LEFT_OVER_PROCESS and event.pid is not None:
            _keep(self._left_over, (event.boot_id, event.pid), None)
            return True
        pid = event.sender_pid
        if event.kind not in _OUTPUT or pid is None:
            return False
        if (event.boot_id, pid) in self._left_over:
            return True
        writer = (event.boot_id, pid, event.sender_stream)  # PIDs repeat from boot to boot
        owner = self._senders.get(writer)
        if owner is None:
            _keep(self._senders, writer, invocation)
            return False
        return owner != invocation

    def _started(self, run: _Run | None, event: UnitEvent, invocation: str) -> None:
        if run is None or run.invocation_id != invocation:
            self._new_run(invocation, event.monotonic_s)
        elif run.started_s is None:  # its lines came first: the start is known now
            run.started_s = event.monotonic_s
            if run.phase_since_s is None:
                run.phase_since_s = event.monotonic_s

    def _new_run(self, invocation: str, started_s: float | None) -> _Run:
        """A new run replaces the current one (which is over, whatever it said)."""
        if self._run is not None:
            self._ended_runs.append(self._run.invocation_id)
        self._dead, self._confirmed = None, False
        self._run = _Run(invocation, started_s, phase_since_s=started_s)
        return self._run

    def _on_run_event(self, run: _Run, event: UnitEvent, *, live: bool) -> bool:
        kind = event.kind
        if kind is EventKind.STOPPING:
            run.stop_asked = True  # a stop or restart job: what follows was asked for
        elif kind is EventKind.ENGINE_FATAL:
            return self._fatal(run, event, live=live)
        elif kind is EventKind.START_PHASE:
            self._phase(run, event)
        elif kind is EventKind.MAIN_EXITED:
            if event.exit_code == "exited" and event.exit_status == 0:
                return self._clean_end(run, event, live=live)
            self._ended()
        elif kind is EventKind.DEACTIVATED:
            return self._clean_end(run, event, live=live)
        elif kind in _ENDS:
            self._ended()
        return False

    def _fatal(self, run: _Run, event: UnitEvent, *, live: bool) -> bool:
        line = BY_KEY.get(event.line or "")
        dead = self._dead
        if dead is not None and dead.by_health and not run.stop_asked:
            # Dead already by the check; now the line says why, and no healthy answer undoes it.
            cause = line.cause if line else "the server's fatal line"
            self._dead = replace(
                dead, cause=f"{dead.cause}; then {cause}", line=event.message, by_health=False
            )
            return False
        if run.stop_asked or dead is not None:
            return False
        self._dead = DeadEngine(
            run.invocation_id,
            event.monotonic_s,
            event.realtime_s,
            line.cause if line else "the server's fatal line",
            event.message,
        )
        self._confirmed, self._dead_live = False, live
        return False  # dead once the run outlives the grace (tick)

    def _phase(self, run: _Run, event: UnitEvent) -> None:
        line = BY_KEY.get(event.line or "")
        if line is None or line.phase is None or line.server != self._server:
            return
        if run.ready or PHASE_ORDER.index(line.phase) <= PHASE_ORDER.index(run.phase):
            return  # every rank prints it; only progress counts
        if run.phase_since_s is not None:
            run.phases[run.phase] = event.monotonic_s - run.phase_since_s
        run.phase, run.phase_since_s = line.phase, event.monotonic_s
        run.ready = line.phase is Phase.READY
        if run.ready and run.started_s is not None:
            run.ready_s = event.monotonic_s - run.started_s
            if all(s.invocation_id != run.invocation_id for s in self._starts):
                phases = tuple((p, run.phases[p]) for p in PHASE_ORDER if p in run.phases)
                self._starts.append(StartRecord(run.invocation_id, run.ready_s, phases))
                self._learned += 1

    def _clean_end(self, run: _Run, event: UnitEvent, *, live: bool) -> bool:
        """The main process exited 0: dead engine unless a stop job asked for it."""
        if run.stop_asked or not self._clean_exit:
            self._ended()
            return False
        before = self._dead
        news = before is None or not self._confirmed
        cause = "main process exited with status 0, no stop job asked for it"
        if before is not None:
            cause = f"{before.cause}; then the {cause}"
        self._dead = DeadEngine(
            run.invocation_id,
            before.since_s if before else event.monotonic_s,
            before.since_wall_s if before else event.realtime_s,
            cause,
            before.line if before else event.message,
            unit_inactive=True,
        )
        self._confirmed = True
        self._ended_runs.append(run.invocation_id)
        self._run = None
        if live and news:
            self._deaths += 1
        return live and news

    def _ended(self) -> None:
        """The run is over and systemd knows it: its verdict ends with it."""
        if self._run is not None:
            self._ended_runs.append(self._run.invocation_id)
        self._run = None
        self._dead, self._confirmed = None, False

    def view(self, now: float) -> LivenessView:
        """The unit's liveness at monotonic ``now``."""
        found = self._view(now)
        return replace(found, deaths=self._deaths, stuck_starts=self._stuck)

    def _view(self, now: float) -> LivenessView:
        last = self._starts[-1] if self._starts else None
        dead = self._dead
        if dead is not None and (self._confirmed or now >= dead.since_s + ENGINE_DEAD_GRACE_S):
            unit = (
                "unit inactive: it exited cleanly and nobody asked it to stop"
                if dead.unit_inactive
                else "unit still active"
            )
            return LivenessView(
                State.ENGINE_DEAD,
                f"engine dead since {self._clock(dead.since_wall_s)} ({dead.cause}); {unit}",
                "critical",
                dead.invocation_id,
                dead,
                last_start=last,
            )
        run = self._run
        if run is None:
            summary = "no run seen in the journal's recent history"
            return LivenessView(State.UNKNOWN, summary, None, last_start=last)
        if run.ready:
            took = "" if run.ready_s is None else f" {_duration(run.ready_s)} after its start"
            return LivenessView(
                State.UP,
                f"up (ready{took})",
                None,
                run.invocation_id,
                phase=Phase.READY,
                last_start=last,
            )
        return self._starting(run, now, last)

    def _starting(self, run: _Run, now: float, last: StartRecord | None) -> LivenessView:
        if run.phase is Phase.STARTING and not self._starts:
            # No phase line yet and no start ever seen to come up: a server that prints none
            # of the table's lines would otherwise read as "loading" for as long as it runs.
            summary = "running; readiness unknown (no phase line seen yet)"
            return LivenessView(State.UNKNOWN, summary, None, run.invocation_id, last_start=last)
        if run.phase_since_s is None:  # a run known only from its lines: its start is unknown
            summary = f"starting: {PHASE_WORDS[run.phase]} (since before the daemon looked)"
            return LivenessView(
                State.STARTING, summary, None, run.invocation_id, phase=run.phase, last_start=last
            )
        elapsed = max(0.0, now - run.phase_since_s)
        times = self.phase_times(run.phase)
        budget = times.budget_s if times else None
        words = PHASE_WORDS[run.phase]
        usual = (
            f" (usual {_duration(times.usual_s)}, longest {_duration(times.longest_s)})"
            if times
            else " (no earlier start to compare with)"
        )
        stuck = budget is not None and elapsed > budget
        if stuck and not run.stuck_counted:
            run.stuck_counted = True
            self._stuck += 1
        if stuck and budget is not None:
            return LivenessView(
                State.STUCK,
                f"stuck in phase {words} for {_duration(elapsed)}, past its budget of "
                f"{_duration(budget)}{usual}; no phase progress",
                "warning",
                run.invocation_id,
                phase=run.phase,
                phase_for_s=elapsed,
                budget_s=budget,
                last_start=last,
            )
        return LivenessView(
            State.STARTING,
            f"loading: {words} for {_duration(elapsed)}{usual}",
            None,
            run.invocation_id,
            phase=run.phase,
            phase_for_s=elapsed,
            budget_s=budget,
            last_start=last,
        )

    def phase_times(self, phase: Phase) -> PhaseTimes | None:
        """The remembered starts' times in ``phase``; None when none went through it."""
        seen = [seconds for start in self._starts for p, seconds in start.phases if p is phase]
        if not seen:
            return None
        return PhaseTimes(statistics.median(seen), max(seen), len(seen))

    def _clock(self, wall_s: float | None) -> str:
        if wall_s is None:
            return "?"
        try:
            return datetime.fromtimestamp(wall_s, self._tz).strftime("%H:%M:%S")
        except (ValueError, OverflowError, OSError):
            return "?"

    # -- what survives a restart of the daemon --------------------------------------------------

    def export(self) -> dict[str, Any]:
        """The remembered starts and the run seen ready, for the unit's saved state."""
        return {
            "starts": [start.to_json() for start in self._starts],
            "ready_invocation_id": self.ready_run or self._saved_ready,
        }

    def restore(self, saved: Mapping[str, Any]) -> list[str]:
        """Take back what ``export`` saved; each malformed part is left out and named."""
        kept, problems = parse_starts(saved)
        self._starts.extend(kept)
        ready = saved.get("ready_invocation_id")
        if isinstance(ready, str) and _INVOCATION_ID.fullmatch(ready):
            self._saved_ready = ready
        elif ready is not None:
            problems.append("liveness ready_invocation_id is not an invocation ID")
        return problems


def _duration(seconds: float) -> str:
    """A duration for people: "42 s", "4 min 10 s", "1 h 5 min"."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def _keep(kept: dict[Any, Any], key: object, value: object) -> None:
    """Add ``key`` unless known, forgetting the oldest past ``_SENDERS_KEPT``."""
    kept.setdefault(key, value)
    while len(kept) > _SENDERS_KEPT:
        del kept[next(iter(kept))]
