"""How often an idle daemon wakes: its periodic chores ride on its watchdog's wakes."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from daemontwins import GpuHost, Recorder, ReplayFollower, UnitTwin

from gpuguard.adapters import systemd
from gpuguard.config import Settings
from gpuguard.core.ledger import SeenProcess
from gpuguard.core.liverun import Walked
from gpuguard.daemon.ledgerkeeper import LedgerPorts
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
from gpuguard.daemonsettings import DaemonSettings
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from gpuguard.core.unitstate import UnitState
    from gpuguard.core.values import ProcessIdentity

UNIT = "sglang.service"
RUNNING = "e" * 32
PING_S = 15.0
"""Half of gpuguard.service's WatchdogSec=30."""
IDLE_S = 600.0


class Idle:
    """A daemon over the twins with a clock that moves only when it sleeps."""

    def __init__(self, tmp_path: Path, *, watchdog_s: float | None) -> None:
        """Watch one running unit, ledger on (every 30 s), until IDLE_S have passed."""
        self.now = 1000.0
        self.wakes: list[float] = []
        self.reads: list[float] = []
        self.writes: list[float] = []
        self.log = Recorder()
        settings = Settings(
            units={UNIT: UnitSettings()},
            runtime_dir=tmp_path / "run",
            state_dir=tmp_path / "lib",
            daemon=DaemonSettings(ledger_every_s=30.0),
        )
        twin = UnitTwin(invocation=RUNNING, active="active")

        def show(name: str) -> UnitState:
            return replace(
                twin.show(name), sub_state="running", control_group=f"/system.slice/{name}"
            )

        def read(_group: str | None, _recorded: Mapping[ProcessIdentity, str]) -> Any:
            self.reads.append(self.now)
            seen = SeenProcess(4242, 1, (0, 0, 0, 0), "python3", f"/system.slice/{UNIT}")
            return (Walked(seen, RUNNING),)

        def write(_document: dict[str, Any]) -> None:
            self.writes.append(self.now)

        host = GpuHost()
        ports = Ports(
            gather=GpuHost().gather,
            show_unit=show,
            control=twin.control,
            reap=lambda _unit, targets: host.reap(targets),
            notifier=self.log,
            log=self.log,
            wall=lambda: 1_700_000_000.0 + self.now,
            monotonic=self._monotonic,
            sleep=self._sleep,
            write_snapshot=write,
            load_unit_state=lambda _unit: None,
            save_unit_state=lambda _unit, _document: None,
            untouchable=frozenset(),
            provenance=systemd.provenance,
            boot_id="b" * 32,
            watchdog_interval_s=watchdog_s,
            ledger=LedgerPorts(
                run_processes=read, alive=lambda _i: True, save=lambda led: led, every_s=30.0
            ),
        )
        self.daemon = Daemon(settings, ReplayFollower([]), ports)
        self.began = self.now

    def _monotonic(self) -> float:
        """Each look at the clock takes a millisecond: the loop's own work moves time too."""
        self.now += 0.001
        return self.now

    def _sleep(self, seconds: float) -> None:
        self.now += seconds
        self.wakes.append(self.now)
        if self.now - self.began >= IDLE_S:
            self.daemon.request_stop()

    def settled(self, times: list[float]) -> list[float]:
        """The moments after the first two minutes, as seconds since the start."""
        return [t - self.began for t in times if t - self.began >= 120.0]

    def running_writes(self) -> list[float]:
        """The snapshot writes of the running daemon (not the last one, at its stop)."""
        return self.settled(self.writes[:-1])


def apart(times: list[float], seconds: float) -> bool:
    """Whether consecutive ``times`` are ``seconds`` apart, give or take the loop's own work."""
    return all(abs(b - a - seconds) < 0.5 for a, b in itertools.pairwise(times))


def test_an_idle_daemon_wakes_only_for_its_watchdog_once_its_chores_settle(
    tmp_path: Path,
) -> None:
    """Ledger records and snapshot refreshes move onto the 15 s pings: 4 wakes a minute."""
    idle = Idle(tmp_path, watchdog_s=PING_S)

    assert idle.daemon.run() == 0

    wakes = idle.settled(idle.wakes)
    assert wakes, "the loop never slept"
    assert all(min(t % PING_S, PING_S - t % PING_S) < 0.5 for t in wakes), wakes
    assert len(wakes) <= (IDLE_S - 120.0) / PING_S + 1
    reads = idle.settled(idle.reads)
    assert apart(reads, 30.0), reads
    writes = idle.running_writes()
    assert apart(writes, 60.0), writes
    pings = [n for n in idle.log.notes if n == "WATCHDOG"]
    assert len(pings) >= IDLE_S / PING_S


def test_without_a_watchdog_chores_keep_their_own_times(tmp_path: Path) -> None:
    """No WatchdogSec: nothing to ride on, so each chore wakes the loop when it is due."""
    idle = Idle(tmp_path, watchdog_s=None)

    assert idle.daemon.run() == 0

    reads = idle.settled(idle.reads)
    assert apart(reads, 30.0), reads
    writes = idle.running_writes()
    assert apart(writes, 60.0), writes
