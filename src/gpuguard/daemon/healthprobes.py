"""The daemon's health checks: probe each unit whose run is up, when due, and count the answers.

``HealthProbing`` asks ``Ports.probe_health`` (adapters/healthprobe.py) for each unit with a
``health_url`` whose run core.liveness lets it probe, every ``health_every_s``; core.healthcheck
counts the answers, and ``health_failures`` failures in a row make the run's engine dead, said
and acted on (``on_engine_dead``) like a fatal line (loop.py), but only once systemd, asked then,
still runs that very run as active: a server that stops answering because an operator stops or
restarts it is no dead engine, even before the journal told the daemon of the stop. A run the
check alone made dead is still probed, and its first healthy answer ends the verdict.

A probe is bounded by ``health_timeout_s`` (at most 5 s) and runs in the loop itself, with no
helper thread: idle cost is wake-ups. The probes of one loop turn share one budget, the longest
``health_timeout_s`` of the units: once they took that long, the units still due wait for the
next turn (the loop goes round at once), the one due the longest first. So N units that each
hang to their timeout cost the loop one timeout per turn, never N; the journal, the watchdog's
ping and the other chores come in between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.core.healthcheck import HealthBack
from gpuguard.daemon.watches import DaemonState

if TYPE_CHECKING:
    from gpuguard.core.healthcheck import HealthCheck, HealthDeath
    from gpuguard.daemon.watches import Watch


_EARLY_S = 0.05
"""A wake this close to a probe's time does it: a select() that returns a hair early must not
cost a second wake."""


class HealthProbing(DaemonState):
    """Health checks of the watched units (``loop.Daemon`` calls ``_probe_health``)."""

    def _health_due(self, now: float) -> list[float]:
        """Seconds until each unit's next probe: the loop's wait ends for the soonest."""
        due = []
        for watch in self._watches.values():
            if watch.health is not None:
                wait = watch.health.due_in(watch.liveness.probed_run, now)
                due.extend([] if wait is None else [wait])
        return due

    def _probe_health(self) -> list[Watch]:
        """Probe the due units within one turn's budget; those whose check made them dead."""
        probe = self._ports.probe_health
        died: list[Watch] = []
        if probe is None:
            return died
        began = self._ports.monotonic()
        due = self._due_probes(began)
        budget = max((self._settings.units[w.name].health_timeout_s for w in due), default=0.0)
        for asked, watch in enumerate(due):
            if asked and self._ports.monotonic() - began >= budget:
                break  # the rest are due still: the next turn asks them first
            if asked and self._ports.watchdog_interval_s is not None:
                self._ports.notifier.watchdog()  # the probe before may have taken its timeout
            if self._probe_one(watch):
                died.append(watch)
        return died

    def _due_probes(self, now: float) -> list[Watch]:
        """The units whose probe is due now, the one due the longest first."""
        due = []
        for watch in self._watches.values():
            check = watch.health
            if check is None or self._settings.units[watch.name].health is None:
                continue
            wait = check.due_in(watch.liveness.probed_run, now)
            if wait is not None and wait <= _EARLY_S:
                due.append(watch)
        return sorted(due, key=lambda w: w.health.next_s if w.health else 0.0)

    def _probe_one(self, watch: Watch) -> bool:
        """Probe one unit and count its answer; True when that made its engine dead."""
        check, target = watch.health, self._settings.units[watch.name].health
        run = watch.liveness.probed_run
        if check is None or target is None or run is None or self._ports.probe_health is None:
            return False
        result = self._ports.probe_health(target, self._settings.units[watch.name].health_timeout_s)
        if not result.counts and check.blocked != result.detail:
            self._ports.log.warning(
                "health check cannot run", unit=watch.name, reason=result.detail
            )
        verdict = check.answered(
            run,
            result,
            now=self._ports.monotonic(),
            wall=self._ports.wall(),
            probed_run=watch.liveness.probed_run,
            dead=watch.liveness.dead is not None,
        )
        if isinstance(verdict, HealthBack):
            if watch.liveness.health_back(verdict):
                self._ports.log.info(
                    "engine answers again", unit=watch.name, invocation_id=run, detail=result.detail
                )
            return False
        return verdict is not None and self._counted(watch, check, verdict)

    def _counted(self, watch: Watch, check: HealthCheck, death: HealthDeath) -> bool:
        """Whether the check's death counts: systemd still runs the probed run, active.

        Asked once, at the failure that makes the death: a stop or restart job whose lines the
        daemon has not read yet also makes the server fail its check, and is no dead engine.
        """
        state = self._show_unit(watch.name)
        self._note_state(watch, state)
        if state.active_state == "active" and state.invocation_id == death.invocation_id:
            return watch.liveness.health_failed(death)
        check.dropped()
        self._ports.log.debug(
            "health check failures not counted",
            unit=watch.name,
            invocation_id=death.invocation_id,
            active_state=state.active_state,
            systemd_invocation_id=state.invocation_id,
        )
        return False
