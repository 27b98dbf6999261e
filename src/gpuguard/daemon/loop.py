"""The watchdog daemon (`gpuguard run`): journal → events → detector → recovery.

One thread, one loop: wait on journalctl's pipes with a short timeout, feed systemd's messages
to each unit's detector, judge only after a *live* event (history replayed at start rebuilds
the window but is never acted on), and recover a loop with a GPU cause the way the gate would:
stop the unit, reap its stale holders, wait until its GPUs are idle, reset-failed, start.
Every adapter is passed in (``Ports``), so tests drive the same loop with real processes and
the fake NVML, or with in-memory twins. This module owns the loop itself (the wait, the records
fed to each unit's detector, verdicts refreshed as time passes, a dead engine's grace); its
parts are the daemon's state (watches.py), judging and recovery (judging.py), the sweep of an
ended run's survivors (sweeps.py), the units' health probes (healthprobes.py), the snapshot and
STATUS= (publishing.py), the watchdog's feeding through long steps (watchdog.py) and the ports
(ports.py).

Time is ``Ports.monotonic`` (the journal's per-boot monotonic clock) for every decision: the
detector's window, the recovery backoff, refreshes. The wall clock only stamps records for
people. The operator's intent wins: a run ended by a stop job is no loop (the detector), a unit
that is inactive is never started, and an interrupted recovery is resumed only in the same
boot, soon after it began, with the unit as the recovery left it, and never under ``dry_run``.
Long steps (an NVML snapshot, the reaper's grace, a systemctl call) keep the watchdog fed from a
helper thread, for no longer than the step's own deadline allows.
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import replace
from typing import TYPE_CHECKING

from gpuguard.adapters.journal import KERNEL
from gpuguard.core.enginelines import is_ready_line
from gpuguard.core.events import EventKind, parse_entry
from gpuguard.core.liveness import ENGINE_DEAD_GRACE_S
from gpuguard.core.livenessview import State, acted_on, left_alone
from gpuguard.core.recovery import Action, RecoveryDecision
from gpuguard.core.xid.catalogue import lookup
from gpuguard.core.xid.events import MalformedXid, parse_kernel_entry
from gpuguard.core.xid.hung import parse_hung_entry
from gpuguard.daemon.healthprobes import HealthProbing
from gpuguard.daemon.judging import Judging
from gpuguard.daemon.publishing import SNAPSHOT_EVERY_S
from gpuguard.daemon.sweeps import Sweeping
from gpuguard.daemon.watches import CHORE_EARLY_S

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.adapters.journal import JournalRecord
    from gpuguard.core.events import UnitEvent
    from gpuguard.core.runend import RunEnd
    from gpuguard.core.unitstate import UnitState
    from gpuguard.daemon.watches import Watch

# The longest the loop sleeps with nothing due: idle cost is wake-ups, so wake only for work.
MAX_SLEEP_S = 60.0


class Daemon(Judging, Sweeping, HealthProbing):
    """The daemon's state and loop; ``run()`` returns the exit status."""

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Start up, then loop until asked to stop; 0 on a clean shutdown.

        Whatever ends the loop (an exception included), journalctl goes with it.
        """
        try:
            return self._run()
        finally:
            self._follower.close()

    def _run(self) -> int:
        ports = self._ports
        for watch in self._watches.values():
            self._restore(watch)
        inventory = self._gather()
        for watch in self._watches.values():
            state = self._show_unit(watch.name)
            self._note_state(watch, state)
            self._ledger_up(watch.name, state)
            self._resume_up(watch, state)
        self._follower.start()
        ports.log.info(
            "started",
            units=list(self._watches),
            dry_run=self._settings.daemon.dry_run,
            nvml=inventory.nvml.health.value,
            gpus=len(inventory.gpus),
        )
        for watch in self._watches.values():
            if watch.in_progress is not None:
                self._resume_recovery(watch)
        ports.notifier.ready(self._status_line())
        self._ready = True
        next_ping = ports.monotonic()
        while not self._stop:
            self._wait(next_ping)
            self._handle(self._follower.read_available())
            for problem in self._follower.take_problems():
                ports.log.warning("journal line skipped", reason=problem)
            self._retry_waiting()
            for watch in self._probe_health():
                self._said_dead(watch)
                # No grace: the failures in a row took their time (acted on in _refresh).
                watch.dead_due = ports.monotonic()
            self._refresh()
            self._keeper.tick(ports.monotonic(), early_s=CHORE_EARLY_S)
            now = ports.monotonic()
            if ports.watchdog_interval_s is not None and now >= next_ping:
                ports.notifier.watchdog()  # only from here: a stuck loop stops the pings
                # On a fixed schedule (the chores that wait for these wakes stay on them), unless
                # a long step made the loop miss one.
                next_ping += ports.watchdog_interval_s
                next_ping = next_ping if next_ping > now else now + ports.watchdog_interval_s
            self._publish()
        ports.notifier.stopping("stopping")
        self._follower.close()
        self._publish(running=False)
        ports.notifier.close()
        ports.log.info("stopped")
        return 0

    def _wait(self, next_ping: float) -> None:
        """Sleep until journal data, a signal, or the next thing that is due - not longer.

        Idle cost is wake-ups: the loop wakes for the next watchdog ping, a journalctl restart,
        the end of a recovery backoff or a grace, never on a fixed tick. Periodic chores (the
        snapshot's refresh, a verdict's refresh, a settled run's ledger record) may wait for the
        next watchdog ping, up to one ping interval or their own period, and a wake up to
        ``CHORE_EARLY_S`` before one does it: with WatchdogSec=30 an idle daemon wakes every
        15 s, and its chores settle onto those wakes after their first round.
        """
        ports = self._ports
        now = ports.monotonic()
        slack = ports.watchdog_interval_s or 0.0
        chores = [
            (self._published_at + SNAPSHOT_EVERY_S - now, SNAPSHOT_EVERY_S),
            *(
                (watch.refresh_at - now, self._refresh_every_s)
                for watch in self._watches.values()
                if watch.diagnosis is not None
            ),
        ]
        due = [MAX_SLEEP_S, *(wait + min(slack, period) for wait, period in chores)]
        if ports.watchdog_interval_s is not None:
            due.append(next_ping - now)
        keeper = self._keeper.due_in(now, slack_s=slack)
        due.extend(w for w in (self._follower.wake_in(), keeper) if w is not None)
        due.extend(
            watch.decision.not_before_s - now
            for watch in self._watches.values()
            if watch.decision is not None
            and watch.decision.action is Action.WAIT
            and watch.decision.not_before_s is not None
        )
        due.extend(w.dead_due - now for w in self._watches.values() if w.dead_due is not None)
        due.extend(
            wake - now for w in self._watches.values() if (wake := w.liveness.wake_at) is not None
        )
        due.extend(self._health_due(now))
        timeout = max(0.0, min(due))
        fds = self._follower.fds()
        if ports.wakeup_fd is not None:
            fds = [*fds, ports.wakeup_fd]
        if not fds:
            ports.sleep(timeout)
            return
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        if ports.wakeup_fd is not None and ports.wakeup_fd in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(ports.wakeup_fd, 4096)  # drain: the signal's handler already ran

    def _handle(self, records: Sequence[JournalRecord]) -> None:
        """Feed records to the detectors; sweep runs a live event ended; judge touched units."""
        touched: set[str] = set()
        ended: list[tuple[Watch, RunEnd]] = []
        live: list[tuple[Watch, UnitEvent]] = []
        for record in records:
            if record.stream == KERNEL:
                self._kernel(record)
                continue
            for watch in self._watches.values():
                event = parse_entry(record.entry, watch.name)
                if event is None:
                    continue
                end = watch.ends.observe(event)  # history too: a replayed end is not swept again
                watch.read_through_s = max(watch.read_through_s or 0.0, event.monotonic_s)
                watch.up.observe(event)
                if self._observe(watch, event, live=record.live):
                    touched.add(watch.name)
                if record.live:
                    self._ledger_event(watch, event, end)
                    live.append((watch, event))
                    ended.extend([(watch, end)] if end is not None else [])
        if records:
            self._follower.commit(*records)
        # Survivors first: a loop judged after the sweep no longer counts what it reaped.
        self._sweep_all(ended)
        for watch, event in live:  # after the sweeps: the next start may be in the same burst
            self._note_next_start(watch, event)
        for name in touched:
            self._judge(self._watches[name])
        self._dead_engines()

    def _ledger_event(self, watch: Watch, event: UnitEvent, end: RunEnd | None) -> None:
        """Record a run as it comes up, when ready, when its stop is announced, and as it ends.

        Ready: its server printed its ready line. Then every engine process exists and its
        server still lives: a vLLM whose API server crashes before the next timed record
        leaves an EngineCore reparented away from it, which only a record made while it lived
        ties to the run (core.liverun).
        """
        now = self._ports.monotonic()
        if event.kind in {EventKind.STARTING, EventKind.STARTED}:
            self._ledger_up(watch.name, self._show_unit(watch.name))
        elif event.kind is EventKind.STOPPING or self._ready_line(watch.name, event):
            self._keeper.record(watch.name, now)
        if end is not None:
            self._keeper.run_over(watch.name, end.invocation_id, now)

    def _ready_line(self, unit: str, event: UnitEvent) -> bool:
        """Whether ``event`` is the ready line of the server ``unit`` runs (core.enginelines)."""
        return event.kind is EventKind.START_PHASE and is_ready_line(
            event.line, self._settings.units[unit].server
        )

    def _ledger_up(self, unit: str, state: UnitState) -> None:
        """Start recording the unit's live run (nothing when it is not running)."""
        if self._ports.ledger is None or not state.running or state.invocation_id is None:
            return
        self._keeper.run_up(unit, state.invocation_id, state.control_group, self._ports.monotonic())

    def _kernel(self, record: JournalRecord) -> None:
        """Keep a kernel Xid or hung-GPU line for status (history too); log news."""
        hung = parse_hung_entry(record.entry)
        if hung is not None:
            self._hangs.append(hung)
            if record.live:
                self._ports.log.warning(
                    "kernel says a GPU hangs", said=hung.said, gpu=hung.gpu, line=hung.text
                )
            return
        parsed = parse_kernel_entry(record.entry)
        if isinstance(parsed, MalformedXid):
            self._xids_malformed += 1
            self._ports.log.warning("kernel xid line not understood", reason=parsed.reason)
        elif parsed is not None:
            self._xids.append(parsed)
            self._faults.add(parsed)
            if record.live:
                info = lookup(parsed.code)
                self._ports.log.warning(
                    "kernel xid",
                    code=parsed.code,
                    xid_class=info.xid_class.value,
                    pci_bus_id=parsed.pci_bus_id,
                    pid=parsed.pid,
                    name=parsed.name,
                    detail=parsed.detail,
                )

    def _refresh(self) -> None:
        """Let verdicts age without new events: a run that stayed up for stable_s is healthy.

        Only the cheap, event-only verdict: acting needs a live event (or a backoff's end),
        so history replayed at start is still never acted on.
        """
        now = self._ports.monotonic()
        self._dead_engines()
        for watch in self._watches.values():
            if watch.diagnosis is None or now + CHORE_EARLY_S < watch.refresh_at:
                continue
            watch.refresh_at = now + self._refresh_every_s
            quick = watch.detector.diagnose(now, None)
            watch.up.stayed_up(quick.good_start_s)
            if not quick.looping:
                watch.planner.healthy(now)
                self._say(watch, quick, None)

    def _retry_waiting(self) -> None:
        """A unit whose recovery waited out its backoff is judged again (no new event needed)."""
        now = self._ports.monotonic()
        for watch in self._watches.values():
            decision = watch.decision
            waiting = decision is not None and decision.action is Action.WAIT
            if waiting and decision is not None and now >= (decision.not_before_s or 0.0):
                self._judge(watch)

    # -- a dead engine (core.liveness; docs/liveness.md) ---------------------------------------

    def _observe(self, watch: Watch, event: UnitEvent, *, live: bool) -> bool:
        """Feed the unit's liveness, then its detector; whether the detector wants a judgement."""
        self._observe_liveness(watch, event, live=live)
        return event.kind not in _LIVENESS_ONLY and watch.detector.observe(event, live=live)

    def _observe_liveness(self, watch: Watch, event: UnitEvent, *, live: bool) -> None:
        """An engine seen dying live is said at once, and acted on after its grace."""
        liveness = watch.liveness
        learned, ready = liveness.learned, liveness.ready_run
        died = liveness.observe(event, live=live)
        if live and (liveness.learned != learned or liveness.ready_run not in {None, ready}):
            # A start came up: its phases teach the next start's budget, and a restarted
            # daemon takes the run as up (core.liveness resume).
            self._save(watch)
        if died:
            self._said_dead(watch)

    def _resume_up(self, watch: Watch, state: UnitState) -> None:
        """At start: the run systemd runs active is up if this daemon saw it ready before."""
        running = state.invocation_id if state.active_state == "active" else None
        if running is not None and watch.liveness.resume(running):
            self._ports.log.info("run up since before", unit=watch.name, invocation_id=running)

    def _said_dead(self, watch: Watch) -> None:
        """Say once that a unit's engine died; its action is due after the grace."""
        dead = watch.liveness.dead
        if dead is None:
            return
        self._ports.log.error(
            "engine dead",
            unit=watch.name,
            invocation_id=dead.invocation_id,
            cause=dead.cause,
            line=dead.line,
            action=self._settings.units[watch.name].on_engine_dead,
        )
        # After an exit 0, systemd's own restart (Restart=always) may still come: wait as long
        # as for a fatal line (whose grace is over by now).
        watch.dead_due = dead.since_s + ENGINE_DEAD_GRACE_S

    def _dead_engines(self) -> None:
        """Recover each unit whose engine is still dead after its grace, if it opted in.

        Also says once per run that a start is stuck in a phase, and recovers it if opted in.
        """
        now = self._ports.monotonic()
        for watch in self._watches.values():
            unit = self._settings.units[watch.name]
            if watch.liveness.tick(now):
                self._said_dead(watch)
            view = watch.liveness.view(now)
            if view.state is State.STUCK and watch.stuck_said != view.invocation_id:
                watch.stuck_said = view.invocation_id
                action = unit.on_start_stuck
                self._ports.log.warning(
                    "start stuck", unit=watch.name, summary=view.summary, action=action
                )
                watch.dead_due = now if action == "recover" else watch.dead_due
            if watch.dead_due is None or now < watch.dead_due:
                continue
            watch.dead_due = None
            view = watch.liveness.view(now)
            if not acted_on(
                view, on_engine_dead=unit.on_engine_dead, on_start_stuck=unit.on_start_stuck
            ):
                continue
            state = self._show_unit(watch.name)
            self._note_state(watch, state)
            decision = watch.planner.decide_engine_dead(view.summary, now)
            why = left_alone(view, watch.name, state, silence_recovered=watch.silence_recovered)
            if why is not None:
                decision = RecoveryDecision(Action.REPORT, why)
            if decision.action is Action.RECOVER:
                decision = self._within_breaker(watch.name, decision)
            self._ports.log.warning(
                "engine dead: decision" if view.dead else "start stuck: decision",
                unit=watch.name,
                action=decision.action.value,
                reason=decision.reason,
            )
            watch.decision = decision
            if decision.action is Action.WAIT and decision.not_before_s is not None:
                watch.dead_due = decision.not_before_s
            elif decision.action is Action.RECOVER:
                watch.silence_recovered = view.dead is not None and view.dead.by_silence
                quick = watch.detector.diagnose(now, None)
                line = view.dead.line if view.dead else view.summary
                cause = replace(quick, reason=view.summary, evidence=(line,))
                self._recover(watch, cause, self._gather(), state)
                self._save(watch)


_LIVENESS_ONLY = frozenset({EventKind.ENGINE_FATAL, EventKind.START_PHASE})
"""Output events only core.liveness reads (the detector keeps its window for restarts)."""
