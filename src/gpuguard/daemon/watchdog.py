"""Feeding systemd's watchdog through long steps: the daemon's one helper thread.

The loop pings WATCHDOG=1 itself between steps; a step that waits on its own deadline (an NVML
snapshot, the reaper's grace, a systemctl call, a container engine's stop) runs wrapped by
``WatchdogFeeder.fed``, which pings from a helper thread for no longer than that deadline plus a
slack. This module owns those slacks and that thread: a step that hangs for good still starves
the watchdog, and systemd restarts the daemon.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpuguard.daemon.ports import Ports

# Beyond a long step's own deadline (NVML's timeout, the reaper's grace, systemctl's 10 s): the
# /proc walk, the reaper's SIGKILL wait, a busy host. Past it the watchdog goes hungry.
_STEP_SLACK_S = 30.0
# Beyond the grace, a container stopper's step: the engine's inspect answers (engineapi: 10 s
# each) and its own SIGKILL and wait after the grace (engineapi: 30 s).
CONTAINER_SLACK_S = 60.0

_T = TypeVar("_T")
_P = ParamSpec("_P")


class WatchdogFeeder:
    """Wraps the daemon's long steps so that systemd's watchdog stays fed while they wait."""

    def __init__(self, ports: Ports) -> None:
        """Ping through ``ports.notifier`` every half ``ports.watchdog_interval_s`` (None: not)."""
        self._ports = ports

    def fed(self, deadline_s: float, step: Callable[_P, _T]) -> Callable[_P, _T]:
        """``step`` run while a helper thread feeds the watchdog, for its deadline plus slack.

        A step that waits on its own deadline (an NVML snapshot, the reaper's grace, systemctl)
        can outlast WatchdogSec although nothing is wrong; the helper pings meanwhile. It stops
        at ``deadline_s + _STEP_SLACK_S`` whatever happens, so a step that hangs for good still
        starves the watchdog and systemd restarts the daemon.
        """
        interval = self._ports.watchdog_interval_s
        if interval is None:
            return step
        notifier, clock = self._ports.notifier, self._ports.monotonic

        def fed(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            # Starting a step is progress: a run of short steps (each under half an interval,
            # so the helper never pings) must not add up to a silent gap.
            notifier.watchdog()
            done = threading.Event()
            until = clock() + deadline_s + _STEP_SLACK_S

            def feed() -> None:
                # Every half interval: the main loop's last ping may be almost an interval old.
                while not done.wait(interval / 2) and clock() < until:
                    notifier.watchdog()

            feeder = threading.Thread(target=feed, name="watchdog-feeder", daemon=True)
            feeder.start()
            try:
                return step(*args, **kwargs)
            finally:
                done.set()
                feeder.join()

        return fed

    def sleep(self, seconds: float) -> None:
        """Sleep inside a recovery while still proving to systemd's watchdog that we live."""
        if self._ports.watchdog_interval_s is not None:
            self._ports.notifier.watchdog()
        self._ports.sleep(seconds)
