"""The gate drop-in's ExecStopPost= reap ends within the unit's TimeoutStopSec= (stopbudget.py).

systemd kills an ExecStopPost= command still running past the unit's stop timeout, and the stop
then fails with result 'timeout'; the reap the drop-in asks for (--grace 5 --timeout 20) used to
take 5 s of SIGTERM grace alone, all of the incident's TimeoutStopSec=5s.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from typing import TYPE_CHECKING

from clirunner import unit_name
from fakeholder import process_gone
from fakestate import allocated_mib

from gpuguard.core.stopbudget import MARGIN_S

if TYPE_CHECKING:
    from clirunner import Cli, FakeSystemd, UnitCgroups
    from fakeholder import HolderSpawner

DROP_IN_REAP = ("--yes", "--grace", "5", "--timeout", "20")  # adapters/dropin.py's ExecStopPost=
_FITTED = re.compile(
    r"note: the unit's ExecStopPost= within TimeoutStopSec=5s: (?P<grace>[0-9.]+) s SIGTERM "
    r"grace, (?P<kill>[0-9.]+) s after SIGKILL, no wait for the memory \(the next start's gate "
    r"waits for it\)"
)


def _stop_post_reap(cli: Cli, cgroups: UnitCgroups, unit: str) -> tuple[str, float]:
    """Run the drop-in's reap as systemd runs ExecStopPost=: in the unit's cgroup; its output."""
    procs = cgroups.ensure(unit) / "cgroup.procs"
    command = shlex.join(cli.command("reap", "--unit", unit, *DROP_IN_REAP))
    started = time.monotonic()
    done = subprocess.run(
        ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {command}"],
        capture_output=True,
        text=True,
        env=cli.env,
        timeout=120,
        check=False,
    )
    return done.stdout + done.stderr, time.monotonic() - started


def test_the_stop_reap_fits_a_five_second_stop_timeout(
    cli: Cli, spawn_holder: HolderSpawner, fake_systemd: FakeSystemd, unit_cgroups: UnitCgroups
) -> None:
    """TimeoutStopSec=5s: a holder deaf to SIGTERM is killed and the reap ends within the 5 s."""
    unit = unit_name()
    fake_systemd(
        unit,
        state="deactivating",
        sub_state="stop-post",
        control_group=f"/system.slice/{unit}",
        control=True,
        timeout_stop="5s",
    )
    holder = spawn_holder(cli.state, gpus=(0,), mib=2000, ignore_sigterm=True, name="sglang::tp0")
    unit_cgroups.move(holder.pid, unit)

    out, took = _stop_post_reap(cli, unit_cgroups, unit)

    assert process_gone(holder.pid), out
    assert allocated_mib(cli.state, 0) == 0
    said = _FITTED.search(out)
    assert said is not None, out
    grace, kill_wait = float(said["grace"]), float(said["kill"])
    assert 0 < grace < 5
    assert 0 < kill_wait < 5
    assert grace + kill_wait <= 5.0 - MARGIN_S + 0.1  # what the inventory left of it, rounded
    assert took < 5.0, out


def test_an_operators_reap_keeps_the_grace_it_asked_for(
    cli: Cli, spawn_holder: HolderSpawner, fake_systemd: FakeSystemd, unit_cgroups: UnitCgroups
) -> None:
    """The same reap outside the unit's stop (an operator's): its 5 s grace, no note."""
    unit = unit_name()
    fake_systemd(unit, state="inactive", sub_state="dead", timeout_stop="5s")
    holder = spawn_holder(cli.state, gpus=(0,), mib=2000, ignore_sigterm=True, name="sglang::tp0")
    unit_cgroups.move(holder.pid, unit)
    command = cli.command("reap", "--unit", unit, *DROP_IN_REAP)
    started = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, env=cli.env, timeout=120, check=False
    )
    took = time.monotonic() - started
    assert process_gone(holder.pid), done.stdout + done.stderr
    assert "ExecStopPost=" not in done.stdout
    assert took >= 5.0  # SIGKILL only after the whole grace asked for
