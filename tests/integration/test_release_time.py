"""The kill-to-release time, measured by the daemon's metrics exporter on real processes.

A real holder process (tests/fakenvml/gpu_hold.py) keeps fake GPU memory that the fake NVML
releases ``release_delay_ms`` after the holder is gone, like a driver tearing a context down.
The exporter, the real reaper and the real NVML adapter run in a subprocess (the fake library
is never loaded into pytest): it reaps the holder and reads the GPUs until the release shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from clirunner import unit_name
from fakestate import update_gpu

if TYPE_CHECKING:
    from clirunner import Cli
    from fakeholder import HolderSpawner

MEASURE = """
import json, sys, time
from pathlib import Path
from gpuguard.adapters import inventory, metricsio, reaper, systemd
from gpuguard.config import load_settings
from gpuguard.core import metrics
from gpuguard.core.tally import Tally
from gpuguard.core.values import ReapTarget

class Log:
    def __init__(self): self.lines = []
    def info(self, event, **kw): self.lines.append({"event": event, **kw})
    warning = info

settings = load_settings(Path(sys.argv[1]))
log = Log()
exporter = metricsio.Exporter(
    settings, gather=lambda: inventory.gather(settings), show_unit=systemd.show_unit,
    ping=lambda: None, log=log,
)
pid = int(sys.argv[2])
(holder,) = [h for h in exporter.gather().holders if h.pid == pid]
reap = exporter.reaped(lambda _unit, targets: reaper.reap(targets, grace_s=5.0, logger=log))
target = ReapTarget(holder.identity, holder.ppid, "holder", sys.argv[4] or None, sys.argv[5])
(result,) = reap(sys.argv[3], [target])
deadline = time.monotonic() + 20
while not exporter.tally.releases.series and time.monotonic() < deadline:
    time.sleep(0.05)
    exporter.gather()
tally = Tally.from_json(exporter.tally.to_json())
print(json.dumps({
    "outcome": result.outcome.value,
    "signals": list(result.signals),
    "releases": tally.releases.to_json(),
    "logged": [line for line in log.lines if line["event"] == "GPU memory released"],
    "exposition": metrics.exposition(metrics._counter_families(tally, [])).decode(),
}))
"""


def test_the_seconds_from_the_last_signal_to_the_drivers_release_are_measured(
    cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """A GPU that frees a killed holder's memory 1.5 s after its death is measured at >= 1.5 s.

    The daemon's exporter counts it, logs it and appends it to the release log.
    """
    unit = unit_name()
    cli.configure(f'[units."{unit}"]\n')
    update_gpu(cli.state, 0, release_delay_ms=1500)
    holder = spawn_holder(cli.state, gpus=(0,), mib=2000, name="sglang::scheduler")
    found = _measure(cli, holder.pid, unit, unit, "test")
    assert found["outcome"] == "exited"
    assert found["signals"] == ["SIGTERM"]
    [[gpu, uuid, model, driver, counts, total]] = found["releases"]
    assert gpu == "0"
    assert uuid.startswith("GPU-")
    assert model == "NVIDIA H200"
    assert driver != "unknown"
    assert sum(counts) == 1
    assert 1.5 <= total < 10.0, total
    [logged] = found["logged"]
    assert logged["seconds"] == round(total, 3)
    assert logged["unit"] == unit
    # The release log has it too (status and explain read it there), for the unit the
    # reaped holder's cgroup named.
    [record] = json.loads((cli.config.parent / "run" / "releases.json").read_text())
    assert (record["by"], record["unit"], record["gpu"]) == ("daemon", unit, 0)
    assert record["seconds"] == round(total, 3)
    assert (
        f'gpuguard_holder_release_seconds_count{{UUID="{uuid}",driver="{driver}",gpu="0",'
        f'modelName="NVIDIA H200"}} 1.0'
    ) in found["exposition"]


def test_a_release_is_the_unit_the_daemon_reaped_for_whatever_the_cgroup_says(
    cli: Cli, spawn_holder: HolderSpawner
) -> None:
    """A worker's release is the unit the daemon reaped it for, whatever its cgroup's name says.

    An escaped worker whose user named its cgroup after another watched unit: the unit was read
    from the policy's reason text before, where both names stood, and the release had none.
    """
    unit, other = unit_name(), unit_name()
    cli.configure(f'[units."{unit}"]\n[units."{other}"]\n')
    holder = spawn_holder(cli.state, gpus=(0,), mib=2000, name="sglang::scheduler")
    crafted = f"/user.slice/user-1000.slice/user@1000.service/app.slice/ {other} .scope"
    reason = f"left over from an earlier run of {unit} (cgroup {crafted})"
    found = _measure(cli, holder.pid, unit, "", reason)
    assert found["outcome"] == "exited"
    [logged] = found["logged"]
    assert logged["unit"] == unit
    [record] = json.loads((cli.config.parent / "run" / "releases.json").read_text())
    assert record["unit"] == unit


def _measure(cli: Cli, pid: int, unit: str, cgroup_unit: str, reason: str) -> dict[str, Any]:
    """Run MEASURE: reap ``pid`` for ``unit`` (its target's cgroup unit and reason as given)."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(cli.config), str(pid), unit, cgroup_unit, reason],
        env=cli.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found
