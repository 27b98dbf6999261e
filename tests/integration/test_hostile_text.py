"""`gpuguard status` and `reap` when a GPU holder chose its name and command line to attack them.

Every holder here is a real process holding a fake device file (mode 0666 on real hosts, so
any user can be one); gpuguard reads it through the real /proc.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clirunner import Cli, UnitCgroups
    from fakeholder import HolderSpawner
    from hostile import HostileProcesses

ARG_MAX = 128 * 1024 - 1  # MAX_ARG_STRLEN, less the NUL


def raw_control(text: str) -> list[str]:
    """The characters of ``text`` (newlines aside) that a terminal would act on."""
    return [ch for ch in text if not ch.isprintable() and ch != "\n"]


def test_a_name_cannot_forge_a_status_line(cli: Cli, hostile: HostileProcesses) -> None:
    """A blanked command line shows the name, escaped: no forged "OK: all idle" line."""
    forger = hostile(cli.state, 0, comm="\nOK: all idle", blank_cmdline=True)
    painter = hostile(cli.state, 1, comm="\x1b]0;pwn\x07\x1b[2J", blank_cmdline=True)
    result = cli("status")
    assert result.code in (0, 1), result.err
    assert not [line for line in result.out.splitlines() if line.startswith("OK: all idle")]
    assert raw_control(result.out) == []
    assert f"pid {forger:<7}" in result.out
    assert "[\\nOK: all idle]" in result.out
    assert f"pid {painter:<7}" in result.out
    assert "\\x1b]0;pwn\\x07\\x1b[2J" in result.out
    holders = {h["pid"]: h for h in cli("status", "--json").json()["holders"]}
    assert holders[forger]["comm"] == "\nOK: all idle"  # JSON escapes on its own
    assert holders[forger]["cmdline"] == []


def test_a_cgroup_name_is_escaped_in_the_owner_column(
    cli: Cli, hostile: HostileProcesses, unit_cgroups: UnitCgroups
) -> None:
    """A delegated user names cgroups at will (anything but "/" and newline): shown escaped."""
    pid = hostile(cli.state, 2, comm="job")
    tag = os.getpid()  # the cgroup is this run's alone when several suites run at once
    unit = f"gg-{tag}\x1b]0;pwn\x07\u202eecivres.service"
    unit_cgroups.move(pid, unit)
    result = cli("status")
    assert raw_control(result.out) == []
    line = next(line for line in result.out.splitlines() if f"pid {pid} " in line)
    assert f"gg-{tag}\\x1b]0;pwn\\x07\\u202eecivres.service" in line
    assert cli("status", "--json").json()["holders"][0]["unit"] == unit


def test_hostile_command_lines_cost_their_length_not_more(
    cli: Cli, hostile: HostileProcesses
) -> None:
    """1.75 MiB of worst-case arguments: status answers in seconds, without a traceback.

    `-a=-a=…` once recursed past Python's limit (status exit 1, the gate refused every start)
    and 128 KiB ending in "://" made the URL pattern quadratic (83 s for status).
    """
    # 14 arguments of 128 KiB: with the environment, as much as an 8 MiB stack lets execve take.
    args = ["-a=" * (ARG_MAX // 3), "a" * (ARG_MAX - 3) + "://"] * 7
    pid = hostile(cli.state, 3, args=args)
    started = time.monotonic()
    result = cli("status", timeout=120)
    elapsed = time.monotonic() - started
    assert "Traceback" not in result.err
    assert result.code in (0, 1), result.err
    assert elapsed < 30
    line = next(line for line in result.out.splitlines() if f"pid {pid} " in line)
    assert line.endswith("chars]")  # cut to one line, with the marker


def test_reap_plan_and_still_busy_lines_are_escaped(
    cli: Cli, spawn_holder: HolderSpawner, unit_cgroups: UnitCgroups
) -> None:
    """`reap --dry-run` names a foreign holder in its plan and its "still busy" line, escaped."""
    holder = spawn_holder(cli.state, gpus=(0,), mib=1000, name="\nstill busy: x")
    tag = os.getpid()  # the cgroup is this run's alone when several suites run at once
    unit_cgroups.move(holder.pid, f"gg-{tag}\x1b[31mred.service")
    result = cli("reap", "--dry-run", "--unit", "sglang.service")
    assert result.code == 0, result.err
    assert raw_control(result.out) == []
    lines = result.out.splitlines()
    spare = next(line for line in lines if f"spare pid {holder.pid} " in line)
    assert "'\\nstill busy: x'" in spare
    assert f"belongs to gg-{tag}\\x1b[31mred.service" in spare
    busy = [line for line in lines if line.startswith("still busy:")]
    assert len(busy) == 1
    assert f"PID {holder.pid} (\\nstill busy: x, gg-{tag}\\x1b[31mred.service)" in busy[0]
