"""``gpuguard run``: wire the real adapters into the daemon and run it until SIGTERM.

Imported only when ``run`` is the command, so it imports what the daemon needs at the top.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import (
    breakerfile,
    containerstop,
    daemonsnapshot,
    healthprobe,
    inventory,
    journal,
    ledgerstore,
    logs,
    metricsio,
    notify,
    procfs,
    reaper,
    runtree,
    state,
    systemd,
    unitenv,
)
from gpuguard.core import enginelines, events
from gpuguard.core.exits import EX_CANTCREAT
from gpuguard.core.gate.refusal import last_refusal
from gpuguard.core.xid import events as xidevents
from gpuguard.core.xid import hung
from gpuguard.daemon import loop as daemon
from gpuguard.daemon.ledgerkeeper import LedgerPorts
from gpuguard.daemon.ports import Ports

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from gpuguard.config import Settings
    from gpuguard.core.breaker import BreakerState
    from gpuguard.core.ledger import Ledger
    from gpuguard.core.liverun import Walk
    from gpuguard.core.logger import Logger
    from gpuguard.core.values import ProcessIdentity


def run(settings: Settings) -> int:
    """Wire the real adapters into the daemon and run it until SIGTERM."""
    logs.configure_logging(json=True, stream=sys.stdout)
    log = logs.get_logger().bind(command="run")
    unwritable = _unwritable(settings)
    if unwritable is not None:  # it would run on, saying "Permission denied" in its log only
        sys.stderr.write(unwritable)
        return EX_CANTCREAT

    def write_snapshot(document: dict[str, Any]) -> None:
        try:
            state.write_json(daemonsnapshot.snapshot_path(settings.runtime_dir), document)
        except OSError as err:
            log.warning("cannot write the status snapshot", error=str(err))

    def save_unit_state(unit: str, document: dict[str, Any]) -> None:
        try:
            state.write_json(
                state.unit_state_path(settings.state_dir, unit), document, durable=True
            )
        except OSError as err:
            log.warning("cannot save unit state", unit=unit, error=str(err))

    def load_unit_state(unit: str) -> dict[str, Any] | None:
        saved = state.read_json(state.unit_state_path(settings.state_dir, unit))
        return saved if isinstance(saved, dict) else None

    this_boot = boot_id()
    # A signal writes a byte here, so SIGTERM ends the loop's long idle wait at once.
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    follower = journal.JournalFollower(
        list(settings.units),
        settings.state_dir / "journal-cursor.json",
        output_patterns=(
            *(events.GPU_OOM_PATTERNS if settings.daemon.watch_output else ()),
            *(enginelines.ENGINE_PATTERNS if settings.daemon.watch_engine_lines else ()),
        ),
        kernel_patterns=(
            re.escape(xidevents.MARKER),
            *(re.escape(marker) for marker in hung.MARKERS),
        ),
        replay_s=settings.daemon.loop_window_s,
        fields=events.FIELDS_READ,
    )
    notifier = notify.Notifier()
    exporter = metricsio.Exporter(
        settings,
        gather=lambda: inventory.gather(settings),
        show_unit=systemd.show_unit,
        ping=notifier.watchdog,
        log=log,
    )
    if settings.metrics.listen:
        try:  # the watchdog matters more than its metrics: it runs without the listener
            metricsio.serve(settings.metrics.listen, exporter.latest)
        except OSError as err:
            log.warning("cannot serve metrics", listen=settings.metrics.listen, error=str(err))
    ports = Ports(
        gather=exporter.gather,
        show_unit=systemd.show_unit,
        control=systemd.control,
        reap=exporter.reaped(
            lambda _unit, targets: reaper.reap(targets, grace_s=settings.reap_grace_s, logger=log)
        ),
        notifier=notifier,
        log=log,
        wall=time.time,
        monotonic=time.monotonic,
        sleep=time.sleep,
        write_snapshot=lambda document: write_snapshot(
            document | {"metrics": exporter.publish(document)}
        ),
        load_unit_state=exporter.loaded(load_unit_state),
        save_unit_state=save_unit_state,
        untouchable=procfs.lineage(os.getpid()),
        provenance=systemd.provenance,
        boot_id=this_boot,
        identity=procfs.read_identity(os.getpid()),
        watchdog_interval_s=notify.watchdog_interval_s(),
        wakeup_fd=wake_read,
        gate_environment=lambda unit: unitenv.recorded(settings.runtime_dir, unit),
        gate_refusal=lambda unit: last_refusal(state.gate_decisions(settings.runtime_dir, unit)),
        containers=lambda request: containerstop.for_unit(
            request,
            settings.units[request.unit].container,
            grace_s=settings.reap_grace_s,
            dry_run=settings.daemon.dry_run,
            logger=lambda: log,
        ),
        ledger=ledger_ports(settings, log),
        load_breaker=lambda: breakerfile.load(settings.runtime_dir, this_boot),
        save_breaker=breaker_saver(settings, log),
        load_ledger=lambda: load_ledger(settings, log),
        probe_health=healthprobe.probe,
    )
    watchdog = daemon.Daemon(settings, follower, ports)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: watchdog.request_stop())
    signal.set_wakeup_fd(wake_write)
    return watchdog.run()


def ledger_ports(settings: Settings, log: Logger) -> LedgerPorts:
    """The provenance ledger's real reads (runtree) and its file (ledgerstore)."""

    def save(ledger: Ledger) -> Ledger | None:
        try:
            return ledgerstore.save_merged(settings.runtime_dir, ledger)
        except OSError as err:
            log.warning("cannot write the provenance ledger", error=str(err))
            return None

    def run_processes(group: str | None, recorded: Mapping[ProcessIdentity, str]) -> Walk:
        walked = runtree.run_processes(group, recorded)
        if walked.cut is not None:
            log.warning(
                "provenance ledger's walk cut short: what it did not read is no evidence",
                control_group=group,
                cut=walked.cut,
            )
        return walked

    return LedgerPorts(
        run_processes=run_processes,
        alive=runtree.alive,
        save=save,
        every_s=settings.daemon.ledger_every_s,
        last_pid=runtree.last_pid,
    )


def load_ledger(settings: Settings, log: Logger) -> Ledger:
    """The ledger an earlier daemon of this boot left; what was malformed in it is logged."""
    ledger, problems = ledgerstore.load(settings.runtime_dir)
    for problem in problems:
        log.warning("provenance ledger ignored in part", problem=problem)
    return ledger


def _unwritable(settings: Settings) -> str | None:
    """Why the daemon cannot keep its state (one line for stderr), or None when it can."""
    for directory in (settings.runtime_dir, settings.state_dir):
        try:
            state.check_writable(directory)
        except OSError as err:
            return (
                f"gpuguard run: cannot write {directory} ({err.strerror or err}): the daemon "
                "runs as root (gpuguard.service); to try it as a user, give it a runtime_dir "
                "and state_dir it can write (--config FILE)\n"
            )
    return None


def breaker_saver(settings: Settings, log: Logger) -> Callable[[BreakerState], None]:
    """Write the breaker's file; a failure is logged (the daemon goes on with what it keeps)."""

    def save(breaker: BreakerState) -> None:
        try:
            breakerfile.save(settings.runtime_dir, breaker)
        except OSError as err:
            log.warning("cannot write the breaker's state", error=str(err))

    return save


def boot_id() -> str | None:
    """The current boot's ID: the daemon compares monotonic times only within one boot."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return text.replace("-", "") or None
