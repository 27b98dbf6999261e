"""The host-wide breaker with three looping units: real stale workers, the fake NVML, real reaps.

Each unit loops (systemd 252's recorded loop) while a worker of its earlier run, in its cgroup,
holds its own GPU. The daemon is the real one (loop, judging, recover steps, reaper, the
breaker's file in runtime_dir); systemctl is the UnitTwin, one per unit.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import pytest
from daemontwins import Recorder, ReplayFollower, UnitTwin, loop_entries
from fakeholder import process_gone
from fakestate import fake_library, update_gpu

from gpuguard.adapters import breakerfile, inventory, reaper, releaselog, systemd
from gpuguard.commands import breaker as breaker_command
from gpuguard.config import Settings
from gpuguard.core.breaker import BreakerState
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
from gpuguard.daemonsettings import DaemonSettings
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from clirunner import UnitCgroups
    from fakeholder import Holder, HolderSpawner

    from gpuguard.core.values import ReapResult, ReapTarget

BOOT = releaselog.boot_id() or "c" * 32
"""This boot's ID, as `gpuguard breaker` reads it too."""


@pytest.fixture
def in_process_nvml(fake_nvml_dir: Path, fake_state: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake NVML's state for this process's NVML workers."""
    del fake_nvml_dir
    monkeypatch.setenv("FAKENVML_STATE", str(fake_state))
    return fake_state


def unit_entries(unit: str, k: int) -> list[dict[str, object]]:
    """The recorded loop, renamed to ``unit``, its runs and cursors made the k-th unit's own."""
    entries = []
    for recorded in loop_entries(unit):
        entry = dict(recorded)
        for key in ("INVOCATION_ID", "_SYSTEMD_INVOCATION_ID"):
            if isinstance(entry.get(key), str):
                entry[key] = f"{k}{str(entry[key])[1:]}"
        entry["__CURSOR"] = f"{entry.get('__CURSOR')};unit={k}"
        entries.append(entry)
    return entries


def stale_worker(
    spawn_holder: HolderSpawner,
    state: Path,
    cgroups: UnitCgroups,
    unit: str,
    gpu: int,
    monkeypatch: pytest.MonkeyPatch,
) -> Holder:
    """A worker of an earlier run of ``unit``, in its cgroup, holding GPU ``gpu``."""
    monkeypatch.setenv("INVOCATION_ID", f"{gpu}" + "0" * 31)
    worker = spawn_holder(state, gpus=(gpu,), mib=30000, name="vllm::worker", ignore_sigterm=True)
    monkeypatch.delenv("INVOCATION_ID")
    cgroups.move(worker.pid, unit)
    return worker


def daemon_for(
    tmp_path: Path, state: Path, units: dict[str, int], entries: list[dict[str, object]]
) -> tuple[Daemon, dict[str, UnitTwin], Recorder]:
    """A daemon over ``units`` (unit → its GPU) that stops itself after a few idle turns."""
    settings = Settings(
        units={unit: UnitSettings(gpus=(gpu,)) for unit, gpu in units.items()},
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        device_glob=f"{state}/dev/nvidia*",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        reap_grace_s=1.0,
        gate_timeout_s=20.0,
        daemon=DaemonSettings(breaker_max_recoveries=2, breaker_window_s=1800.0),
    )
    newest = max(int(str(e["__REALTIME_TIMESTAMP"])) for e in entries) / 1e6
    shift = max(int(str(e["__MONOTONIC_TIMESTAMP"])) for e in entries) / 1e6 + 1 - time.monotonic()
    twins = {
        unit: UnitTwin(
            invocation=str([e for e in entries if e["UNIT"] == unit][-1]["INVOCATION_ID"])
        )
        for unit in units
    }
    recorder = Recorder()
    turns = [0]
    holder: list[Daemon] = []

    def sleep(seconds: float) -> None:
        del seconds
        turns[0] += 1
        if turns[0] > 3:
            holder[0].request_stop()

    def reap(_unit: str, targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        return reaper.reap(targets, grace_s=settings.reap_grace_s, logger=recorder)

    saved: dict[str, dict[str, Any]] = {}
    ports = Ports(
        gather=lambda: inventory.gather(settings),
        show_unit=lambda unit: twins[unit].show(unit),
        control=lambda verb, unit: twins[unit].control(verb, unit),
        reap=reap,
        notifier=recorder,
        log=recorder,
        wall=lambda: newest + 1.0,
        monotonic=lambda: time.monotonic() + shift,
        sleep=sleep,
        write_snapshot=lambda _document: None,
        load_unit_state=saved.get,
        save_unit_state=saved.__setitem__,
        untouchable=frozenset({os.getpid()}),
        provenance=systemd.provenance,
        boot_id=BOOT,
        load_breaker=lambda: breakerfile.load(settings.runtime_dir, BOOT),
        save_breaker=lambda found: breakerfile.save(settings.runtime_dir, found),
    )
    holder.append(Daemon(settings, ReplayFollower(entries), ports))
    return holder[0], twins, recorder


def recovered(twin: UnitTwin, unit: str) -> bool:
    """Whether the daemon stopped and started ``unit`` again."""
    return twin.calls == [f"stop {unit}", f"reset-failed {unit}", f"start {unit}"]


def test_three_looping_units_open_the_breaker_which_survives_a_restart_until_closed(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Limit 2: two recovered, the third only reported, also after a restart; closed, recovered."""
    tag = uuid.uuid4().hex[:6]
    units = {f"llm{k}-{tag}.service": k for k in range(3)}
    for gpu in range(3):
        update_gpu(in_process_nvml, gpu, release_delay_ms=200)
    workers = {
        unit: stale_worker(spawn_holder, in_process_nvml, unit_cgroups, unit, gpu, monkeypatch)
        for unit, gpu in units.items()
    }
    entries = sorted(
        (e for k, unit in enumerate(units) for e in unit_entries(unit, k)),
        key=lambda e: int(str(e["__MONOTONIC_TIMESTAMP"])),
    )

    daemon, twins, log = daemon_for(tmp_path, in_process_nvml, units, entries)
    assert daemon.run() == 0

    done = [unit for unit in units if recovered(twins[unit], unit)]
    (left,) = [unit for unit in units if unit not in done]
    assert len(done) == 2
    assert twins[left].calls == []
    assert all(process_gone(workers[unit].pid) for unit in done)
    assert not process_gone(workers[left].pid)
    [(level, opened)] = [(lv, f) for lv, event, f in log.lines if event == "breaker open"]
    assert level == "critical"
    assert opened["unit"] == left
    found = breakerfile.load(tmp_path / "run", BOOT)
    assert found is not None
    assert found.is_open
    assert found.opened_after == 2
    reported = [f for _, event, f in log.lines if event == "restart loop" and f["unit"] == left]
    assert reported[-1]["action"] == "report"
    assert "breaker open since" in str(reported[-1]["action_reason"])
    assert "after 2 recoveries" in str(reported[-1]["action_reason"])

    # A restarted daemon, same boot: the breaker is still open, the loop only reported.
    only_left = {left: units[left]}
    again = [e for e in entries if e["UNIT"] == left]
    daemon, twins, log = daemon_for(tmp_path, in_process_nvml, only_left, again)
    assert daemon.run() == 0
    assert twins[left].calls == []
    assert not process_gone(workers[left].pid)

    # A person closes it (root); the next daemon recovers the third unit.
    settings = Settings(runtime_dir=tmp_path / "run", state_dir=tmp_path / "lib")
    said = breaker_command.run(settings, close_it=True)
    assert said.exit_status == 0, said.notices
    assert "it was breaker open since" in said.lines[0]
    daemon, twins, log = daemon_for(tmp_path, in_process_nvml, only_left, again)
    assert daemon.run() == 0
    assert recovered(twins[left], left)
    assert process_gone(workers[left].pid)


def test_an_open_breaker_leaves_a_crashed_runs_survivors_reported_not_reaped(
    tmp_path: Path,
    in_process_nvml: Path,
    spawn_holder: HolderSpawner,
    unit_cgroups: UnitCgroups,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep is a recovery too: with the breaker open its survivors are only reported."""
    unit = f"llm-{uuid.uuid4().hex[:6]}.service"
    entries = unit_entries(unit, 0)
    crashed = str(entries[0]["INVOCATION_ID"])
    run = [e for e in entries if e["INVOCATION_ID"] == crashed]
    monkeypatch.setenv("INVOCATION_ID", crashed)
    worker = spawn_holder(in_process_nvml, gpus=(0,), mib=30000, name="vllm::worker")
    monkeypatch.delenv("INVOCATION_ID")
    unit_cgroups.move(worker.pid, unit)
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    opened = BreakerState(BOOT, open_since=at, opened_after=2, refused=1)
    breakerfile.save(tmp_path / "run", opened)

    daemon, twins, log = daemon_for(tmp_path, in_process_nvml, {unit: 0}, run)
    assert daemon.run() == 0

    assert not process_gone(worker.pid)
    assert twins[unit].calls == []
    [(level, said)] = [(lv, f) for lv, event, f in log.lines if event == "survivors only reported"]
    assert level == "error"
    assert "breaker open since" in str(said["reason"])
    assert not [f for _, event, f in log.lines if event == "signal"]
    found = breakerfile.load(tmp_path / "run", BOOT)
    assert found is not None
    assert found.refused == 2
