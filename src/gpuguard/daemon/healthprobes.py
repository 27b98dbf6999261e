"""The daemon's health checks: probe each unit whose run is up, when due, and count the answers.

``HealthProbing`` asks ``Ports.probe_health`` (adapters/healthprobe.py) for each unit with a
``health_url`` whose run core.liveness calls up, every ``health_every_s``; core.healthcheck counts
the answers, and ``health_failures`` failures in a row make the run's engine dead, said and acted
on (``on_engine_dead``) like a fatal line (loop.py). A probe is bounded by ``health_timeout_s``
(at most 5 s, a third of gpuguard.service's 15 s ping interval) and runs in the loop itself, with
no helper thread: idle cost is wake-ups. Before each further probe of one turn the loop pings
systemd's watchdog, so several units that each hang to their timeout cannot add up to a silent
gap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuguard.daemon.watches import DaemonState

if TYPE_CHECKING:
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
                wait = watch.health.due_in(watch.liveness.up_run, now)
                due.extend([] if wait is None else [wait])
        return due

    def _probe_health(self) -> list[Watch]:
        """Probe each unit whose probe is due; the units whose check just made their engine dead."""
        probe = self._ports.probe_health
        died: list[Watch] = []
        if probe is None:
            return died
        asked = 0
        for watch in self._watches.values():
            unit = self._settings.units[watch.name]
            check, target = watch.health, unit.health
            run = watch.liveness.up_run
            if check is None or target is None or run is None:
                continue
            wait = check.due_in(run, self._ports.monotonic())
            if wait is None or wait > _EARLY_S:
                continue
            if asked and self._ports.watchdog_interval_s is not None:
                self._ports.notifier.watchdog()  # the probe before may have taken its timeout
            asked += 1
            result = probe(target, unit.health_timeout_s)
            now = self._ports.monotonic()
            if not result.counts and check.blocked != result.detail:
                self._ports.log.warning(
                    "health check cannot run", unit=watch.name, reason=result.detail
                )
            death = check.answered(
                run, result, now=now, wall=self._ports.wall(), up_run=watch.liveness.up_run
            )
            if death is not None and watch.liveness.health_failed(death):
                died.append(watch)
        return died
