"""Metrics out of the process (adapter): node_exporter's textfile, an HTTP listener, one scrape.

The daemon's ``Exporter`` sits on its ports: it sees every inventory and reap the daemon makes
and every snapshot it writes, counts what happened (``tally.Tally``), and draws the metrics
each time the snapshot is written - after every change and otherwise every 60 s. The textfile is
written with ``files.write_shared_file``, not ``prometheus_client.write_to_textfile``: that opens
a predictable temporary name (``PATH.PID.TID``) with ``open(..., "wb")``, following a symlink
the directory's owner (the prometheus user on Debian) may plant there, as root.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import breakerfile, files, metricshttp, releaselog, state, watched
from gpuguard.core import metrics, tally
from gpuguard.core.prevented import load_cost_s
from gpuguard.core.release import ReleaseWatch
from gpuguard.core.snapshot import Snapshot, Unreadable, from_json
from gpuguard.core.startbudgets import parse_starts
from gpuguard.core.values import MIB
from gpuguard.daemonsettings import DEFAULT_TEXTFILE, listen_address

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from gpuguard.config import Settings
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.leftovers import WatchedUnit
    from gpuguard.core.logger import Logger
    from gpuguard.core.release import Release
    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ReapResult, ReapTarget

INVENTORY_EVERY_S = 300.0
"""Without events the daemon takes no inventory; the metrics take one when theirs is older.

One inventory (NVML's worker, the /proc walk) and a `systemctl show` per unit cost about
60 ms of CPU on a small host: every 5 minutes that is ~0.7 s an hour, inside the idle budget
(< 1 s/hour, bench/daemon_idle.py); every minute it would be 3-4 s."""


def watched_units(
    settings: Settings, inventory: Inventory, show_unit: Callable[[str], UnitState]
) -> tuple[WatchedUnit, ...]:
    """Each watched unit as status judges it (adapters/watched.py), for this inventory."""
    return tuple(look.unit for look in watched.look(settings, inventory, show_unit))


def _live(units: Sequence[WatchedUnit]) -> dict[str, str | None]:
    """Each unit systemd answered for, with the invocation running now (None: not running)."""
    return {u.name: u.live_invocation for u in units if u.provenance.problem is None}


def gate_histories(settings: Settings) -> dict[str, list[dict[str, Any]]]:
    """Each watched unit's recorded gate decisions (root's files in runtime_dir), oldest first."""
    return {unit: state.gate_decisions(settings.runtime_dir, unit) for unit in settings.units}


def _last_refused(histories: dict[str, list[dict[str, Any]]]) -> dict[str, bool]:
    return {
        unit: bool(entries) and entries[-1].get("result") == "refused"
        for unit, entries in histories.items()
    }


class Exporter:
    """The daemon's metrics: counters, the newest inventory, the textfile and the listener."""

    def __init__(  # noqa: PLR0913 - the ports it wraps, passed once
        self,
        settings: Settings,
        *,
        gather: Callable[[], Inventory],
        show_unit: Callable[[str], UnitState],
        ping: Callable[[], None],
        log: Logger,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Nothing is read or written until the daemon gathers or publishes."""
        self._settings = settings
        self._gather = gather
        self._show_unit = show_unit
        self._ping = ping
        self._log = log
        self._monotonic = monotonic
        self._wall = wall
        self.tally = tally.Tally()
        self.latest = metrics.Latest()
        self._releases: dict[str, ReleaseWatch] = {}
        """Per watched unit reaped for, its GPUs followed until they let go."""
        self._inventory: Inventory | None = None
        self._inventory_at = float("-inf")
        self._watched: tuple[WatchedUnit, ...] = ()
        self._live_for = float("-inf")
        """The inventory time ``_live`` was asked after: asked again only for a newer one."""
        self._write_failed: str | None = None
        self._rendered = metrics.Rendered()
        for unit, entries in gate_histories(settings).items():
            self.tally.baseline(f"gate/{unit}", entries)
        logged = releaselog.read(settings.runtime_dir)
        self.tally.baseline_logged(logged)

    def loaded(
        self, load: Callable[[str], dict[str, Any] | None]
    ) -> Callable[[str], dict[str, Any] | None]:
        """The daemon's load of a unit's saved state: its recoveries are the baseline."""

        def baseline(unit: str) -> dict[str, Any] | None:
            saved = load(unit)
            records = saved.get("recoveries") if saved else None
            self.tally.baseline(f"recoveries/{unit}", records if isinstance(records, list) else [])
            return saved

        return baseline

    def gather(self) -> Inventory:
        """The daemon's gather, remembered (its NVML health counted, the GPUs it shows released).

        A release is timed when NVML answered the GPU's process list (ReleaseWatch.observe).
        """
        begun = self._monotonic()
        inventory = self._gather()
        self._inventory, self._inventory_at = inventory, self._monotonic()
        self.tally.count_nvml(inventory.nvml.health)
        for unit, watch in self._releases.items():
            found = watch.observe(inventory.nvml, begun)
            for release in found:
                self.tally.releases.add(release)
                self._log.info(
                    "GPU memory released",
                    unit=unit,
                    gpu=release.gpu,
                    uuid=release.uuid,
                    seconds=round(release.seconds, 3),
                )
            self._log_releases(unit, [(release, begun) for release in found])
        return inventory

    def _log_releases(self, unit: str, found: list[tuple[Release, float]]) -> None:
        """Append the daemon's releases to the release log (status and explain read it there)."""
        try:
            releaselog.record(
                self._settings.runtime_dir, releaselog.logged(found, by="daemon", unit=unit)
            )
        except OSError as err:
            self._log.warning("cannot record release times", error=str(err))

    def reaped(
        self, reap: Callable[[str, Sequence[ReapTarget]], tuple[ReapResult, ...]]
    ) -> Callable[[str, Sequence[ReapTarget]], tuple[ReapResult, ...]]:
        """The daemon's reap, with each process's outcome counted and its GPUs' release timed.

        The release is the unit's the daemon reaped for, as it says (never read from the
        targets' text, which holds names the unit's user chose).
        """

        def counted(unit: str, targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
            results = reap(unit, targets)
            for result in results:
                self.tally.count_reaped("daemon", result.outcome.value)
            # The reap was planned on the newest inventory: the GPUs it listed the holders on.
            watch = self._releases.setdefault(unit, ReleaseWatch())
            watch.reaped(results, self._inventory.nvml if self._inventory else None)
            return results

        return counted

    def publish(self, document: Mapping[str, Any]) -> dict[str, Any]:
        """Draw the metrics for this snapshot, write and serve them; the counters for the snapshot.

        Called where the daemon writes its snapshot document, from its main loop: a stale
        inventory is renewed here (after a watchdog ping, as the daemon's own long steps do).
        The document is read as status reads it (core.snapshot): one the parser refuses is a
        bug, said in the log and drawn as no snapshot.
        """
        settings = self._settings
        found = from_json(document)
        if isinstance(found, Unreadable):
            self._log.warning("snapshot not drawn into the metrics", problem=found.reason)
        snapshot = found if isinstance(found, Snapshot) else None
        seen_units = snapshot.units if snapshot else {}
        for unit in settings.units:
            seen = seen_units.get(unit)
            self.tally.count_recoveries(
                unit, seen.recoveries if seen else (), shortest_start(settings, unit)
            )
        histories = gate_histories(settings)
        for unit, entries in histories.items():
            self.tally.count_gate(unit, entries, shortest_start(settings, unit))
        logged = releaselog.read(settings.runtime_dir)
        self.tally.count_logged(logged)
        running = snapshot is not None and snapshot.running
        if running and self._monotonic() - self._inventory_at >= INVENTORY_EVERY_S:
            self._ping()
            self.gather()
        if running and self._inventory is not None and self._live_for < self._inventory_at:
            # After the inventory, never before: a run that started in between must not make
            # its own processes look stale.
            self._ping()  # systemctl has 10 s per unit
            self._watched = watched_units(settings, self._inventory, self._show_unit)
            self._live_for = self._inventory_at
        units = self._watched if running else ()
        observed = metrics.Observed(
            inventory=self._inventory,
            inventory_age_s=None
            if self._inventory is None
            else self._monotonic() - self._inventory_at,
            watched_units=list(settings.units),
            live_invocations=_live(units),
            protected_names=settings.protected_processes,
            idle_threshold_bytes=settings.idle_threshold_mib * MIB,
            snapshot=snapshot,
            daemon_running=running,
            gate_refused=_last_refused(histories),
            breaker=breakerfile.load(settings.runtime_dir, releaselog.boot_id()),
            breaker_limits=settings.daemon.breaker_limits(),
            now_monotonic=time.monotonic(),
            tally=self.tally,
            now_wall=self._wall(),
            watched=units,
            releases=logged,
        )
        drawn = metrics.families(observed)
        self.latest.publish(drawn)
        self._write(self._rendered.exposition(drawn))
        return self.tally.to_json()

    def _write(self, data: bytes) -> None:
        """Write the textfile; say once when that fails, and once when it works again."""
        path = self._settings.metrics.textfile
        if not path:
            return
        try:
            write_textfile(Path(path), data)
        except OSError as err:
            # The same failure again is not news (its message names a random temporary file).
            kind = f"{type(err).__name__} {err.errno} {getattr(err, 'reason', '')}"
            if self._write_failed != kind and _no_node_exporter(path, err):
                self._log.info("no node_exporter textfile directory: no metrics file", path=path)
            elif self._write_failed != kind:
                self._log.warning("cannot write the metrics textfile", path=path, error=str(err))
            self._write_failed = kind
            return
        if self._write_failed is not None:
            self._log.info("metrics textfile written again", path=path)
        self._write_failed = None


def _no_node_exporter(path: str, err: OSError) -> bool:
    """Whether the default textfile's directory is missing: a host without node_exporter.

    Not a fault to warn about at every start (the metrics are still served by ``status
    --prometheus`` and a configured listener); a path the operator chose is.
    """
    return (
        path == DEFAULT_TEXTFILE
        and isinstance(err, FileNotFoundError)
        and not Path(path).parent.is_dir()
    )


def write_textfile(path: Path, data: bytes) -> None:
    """Replace the textfile atomically (node_exporter never reads half of it), mode 0644."""
    files.write_shared_file(path, data, mode=0o644)


def serve(
    listen: str,
    latest: metrics.Latest,
    limits: metricshttp.Limits = metricshttp.Limits(),  # noqa: B008 - an immutable NamedTuple
) -> None:
    """Serve ``latest`` over HTTP on ``listen`` ("IP:PORT") from one daemon thread.

    metricshttp's bounded listener: one thread whatever connects, at most 16 connections, 5 s
    each. Raises OSError when the address cannot be bound (in use, no network in the sandbox).
    """
    from prometheus_client import generate_latest  # noqa: PLC0415 - only when configured

    host, port = listen_address(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    registry = metrics.registry_of(latest)
    metricshttp.Listener(sock, lambda: bytes(generate_latest(registry)), limits).start()


def scrape(
    settings: Settings,
    inventory: Inventory,
    show_unit: Callable[[str], UnitState],
    snapshot: Snapshot | None,
    *,
    daemon_running: bool,
) -> bytes:
    """One set of metrics drawn now (``status --prometheus``), with the daemon's counters."""
    histories = gate_histories(settings)
    units = watched_units(settings, inventory, show_unit)
    observed = metrics.Observed(
        inventory=inventory,
        inventory_age_s=0.0,
        watched_units=list(settings.units),
        live_invocations=_live(units),
        watched=units,
        protected_names=settings.protected_processes,
        idle_threshold_bytes=settings.idle_threshold_mib * MIB,
        snapshot=snapshot,
        daemon_running=daemon_running,
        gate_refused=_last_refused(histories),
        breaker=breakerfile.load(settings.runtime_dir, releaselog.boot_id()),
        breaker_limits=settings.daemon.breaker_limits(),
        now_monotonic=time.monotonic(),
        tally=tally.Tally.from_json(snapshot.metrics if snapshot else None),
        now_wall=time.time(),
        releases=releaselog.read(settings.runtime_dir),
    )
    return metrics.exposition(metrics.families(observed))


def shortest_start(settings: Settings, unit: str) -> float | None:
    """The unit's shortest learned start (its saved state): what one prevented start costs."""
    saved = state.read_json(state.unit_state_path(settings.state_dir, unit))
    liveness = saved.get("liveness") if isinstance(saved, dict) else None
    if not isinstance(liveness, dict):
        return None
    starts, _problems = parse_starts(liveness)
    return load_cost_s([start.ready_s for start in starts])
