"""``gpuguard status``: gather the inventory, the units and the daemon; judge; print."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import (
    breakerfile,
    daemonsnapshot,
    doctorio,
    inventory,
    procfs,
    releaselog,
    state,
    terminal,
    watched,
)
from gpuguard.commands.output import Said
from gpuguard.core.prevented import prevented
from gpuguard.core.releaselog import summarize
from gpuguard.core.since import within
from gpuguard.core.status import document
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import StatusContext, UnitView
from gpuguard.core.status.text import render_text

if TYPE_CHECKING:
    from gpuguard.config import Settings
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.since import Since
    from gpuguard.core.snapshot import DaemonView
    from gpuguard.core.status.report import StatusReport
    from gpuguard.core.unitcontainers import ContainerVerdict


@dataclass(frozen=True, slots=True)
class StatusAnswer:
    """The status report, printed as text or JSON; its level is the exit status."""

    report: StatusReport

    @property
    def exit_status(self) -> int:
        """The monitoring-plugin convention: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN."""
        return int(self.report.level)

    @property
    def notices(self) -> tuple[str, ...]:
        """Nothing for standard error: the report says it all."""
        return ()

    def to_text(self) -> str:
        """The one screen ``gpuguard status`` prints."""
        return render_text(self.report)

    def to_json(self) -> dict[str, Any]:
        """``status --json`` (docs/status.md)."""
        return document.to_json(self.report)


def run(
    settings: Settings,
    *,
    watch: float | None = None,
    since: Since | None = None,
    no_config_file: bool = False,
) -> StatusAnswer | Said:
    """The status report, judged now (the monitoring-plugin convention for its level).

    With ``watch`` (seconds), redraw it in place on the terminal until stopped; exit 0 then,
    with nothing more to print. ``since``: the start of the history shown (``--since``); None:
    all that is kept. ``no_config_file``: the settings are the defaults, no file was read.
    """
    if watch is not None:
        return Said(
            terminal.run(
                lambda: render_text(_report(settings, since, no_config_file)), watch, sys.stdout
            )
        )
    return StatusAnswer(_report(settings, since, no_config_file))


def _recoveries(daemon: DaemonView, unit: str) -> tuple[dict[str, Any], ...]:
    """The daemon's recoveries of ``unit`` its snapshot keeps (the newest 10)."""
    seen = daemon.snapshot.units.get(unit) if daemon.snapshot else None
    return tuple(seen.recoveries) if seen else ()


def _report(settings: Settings, since: Since | None, no_config_file: bool = False) -> StatusReport:
    """Gather the inventory, the units and the daemon, and judge them."""
    now = datetime.now(timezone.utc)
    start = None if since is None else since.start(now)
    found = inventory.gather(settings)
    units = []
    live: dict[str, bool] = {}
    looks = watched.look(settings, found)
    logged = releaselog.read(settings.runtime_dir)
    daemon = daemonsnapshot.daemon_view(settings.runtime_dir)
    for seen in looks:
        name, unit_state, gpu_set = seen.unit.name, seen.facts.state, seen.gpu_set
        live[name] = unit_state.error is not None or unit_state.running
        units.append(
            UnitView(
                name=name,
                state=unit_state.in_words(),
                not_found=unit_state.not_found,
                gpu_set=gpu_set.describe() + (f"; {gpu_set.note}" if gpu_set.note else ""),
                gate_decisions=tuple(
                    [
                        decision
                        for decision in state.gate_decisions(settings.runtime_dir, name)
                        if within(start, decision.get("time"))
                    ][-3:]
                ),
                releases=summarize(logged, gpu_set.indices),
                prevented=prevented(
                    [
                        decision
                        for decision in state.gate_decisions(settings.runtime_dir, name)
                        if within(start, decision.get("time"))
                    ],
                    [
                        record
                        for record in _recoveries(daemon, name)
                        if within(start, record.get("finished_at"))
                    ],
                    doctorio.learned_starts(settings.state_dir, name).ready_s,
                ),
            )
        )
    return assess(
        found,
        StatusContext(
            watched_units={name: unit.patterns for name, unit in settings.units.items()},
            protected_names=settings.protected_processes,
            idle_threshold_bytes=settings.idle_threshold_mib * 1024 * 1024,
            as_root=os.geteuid() == 0,
            units=tuple(units),
            boot_time=procfs.boot_time(),
            clock_ticks=procfs.clock_ticks_per_second(),
            daemon=daemon,
            since=start,
            unit_containers=_unit_containers(settings, found, live),
            watched=tuple(seen.unit for seen in looks),
            no_config_file=no_config_file,
            breaker=breakerfile.load(settings.runtime_dir, releaselog.boot_id()),
            breaker_limits=settings.daemon.breaker_limits(),
        ),
        now,
    )


@dataclass(frozen=True, slots=True)
class Metrics:
    """``status --prometheus``: the daemon's metrics in Prometheus' text format; exit 0."""

    text: str

    @property
    def exit_status(self) -> int:
        """Always 0: the metrics carry the levels."""
        return 0

    @property
    def notices(self) -> tuple[str, ...]:
        """Nothing for standard error."""
        return ()

    def to_text(self) -> str:
        """The exposition, as a scrape would get it."""
        return self.text

    def to_json(self) -> None:
        """None: the text format is the answer, also under --json."""
        return


def _unit_containers(
    settings: Settings, found: Inventory, live: dict[str, bool]
) -> dict[str, tuple[str, ContainerVerdict]]:
    """The GPU-holding containers the engine confirms are a watched unit's (the gate's judge).

    The engine's adapter is loaded only when some holder is in a container at all.
    """
    if not any(holder.attribution.container for holder in found.holders):
        return {}
    from gpuguard.adapters import containerstop  # noqa: PLC0415

    configured = {name: unit.container for name, unit in settings.units.items()}
    return containerstop.owners(found, configured, live.__getitem__)


def prometheus(settings: Settings) -> Metrics:
    """`status --prometheus`: the daemon's metrics drawn now, for a one-off scrape."""
    from gpuguard.adapters import daemonsnapshot, inventory, metricsio, systemd  # noqa: PLC0415

    view = daemonsnapshot.daemon_view(settings.runtime_dir)
    return Metrics(
        metricsio.scrape(
            settings,
            inventory.gather(settings),
            systemd.show_unit,
            view.snapshot,
            daemon_running=view.state == "running",
        ).decode()
    )
