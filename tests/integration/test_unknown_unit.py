"""A unit neither configured, gated nor known to systemd: reap, gate and doctor refuse (a typo).

systemctl and journalctl are the test doubles (clirunner.FakeSystemd): ``show`` answers
``LoadState=not-found`` for the typo as systemd does, ``list-units`` names the real unit. The
holders are real processes on the fake NVML.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fakeholder import process_gone

if TYPE_CHECKING:
    from pathlib import Path

    from clirunner import Cli, FakeSystemd
    from fakeholder import HolderSpawner

TYPO = "sglangg.service"  # a name a unit could have: only systemd can say there is none
MISTYPED = "sglang.servce"  # no unit type: no unit can have it, whatever systemd knows
REAL = "sglang.service"


def _configure(cli: Cli) -> None:
    """The real unit on GPU 0 only: a typo would get the defaults, every GPU."""
    cli.configure(f'[units."{REAL}"]\ngpus = [0]\n')


def test_a_typo_reaps_nothing_and_says_did_you_mean(
    cli: Cli, fake_systemd: FakeSystemd, spawn_holder: HolderSpawner, tmp_path: Path
) -> None:
    """`reap --unit sglang.servce --scope patterns` planned to kill a job on GPU 1 on main."""
    _configure(cli)
    fake_systemd(TYPO, load_state="not-found", known=(REAL, "cron.service"))
    job = spawn_holder(cli.state, gpus=(1,), mib=2048, name="python3 -m sglang.launch_server")
    absent = str(tmp_path / "absent.sock")  # root, no server: in this process
    for command in (
        ["reap", "--unit", TYPO, "--scope", "patterns", "--yes", "--socket", absent],
        ["gate", "--unit", TYPO, "--scope", "patterns", "--timeout", "1", "--socket", absent],
        ["doctor", "--unit", TYPO],
    ):
        done = cli(*command)
        assert done.code == 64, done
        name = command[0]
        why = "not in the configuration, no gate drop-in, and systemd has no such unit"
        assert done.err.splitlines()[-3:] == [
            f"gpuguard {name}: unknown unit {TYPO!r}: {why} (LoadState=not-found)",
            f"  did you mean {REAL}?",
            f"  --force {name}s it anyway (with the defaults: every GPU)",
        ], done.err
        assert not process_gone(job.pid)


def test_force_goes_ahead_and_a_configured_unit_needs_no_systemd(
    cli: Cli, fake_systemd: FakeSystemd, tmp_path: Path
) -> None:
    """--force plans for the typo anyway; a configured unit is never refused as unknown."""
    _configure(cli)
    absent = str(tmp_path / "absent.sock")
    fake_systemd(TYPO, load_state="not-found")
    forced = cli("reap", "--unit", TYPO, "--dry-run", "--force", "--socket", absent)
    assert forced.code == 0, forced.err
    assert "unknown unit" not in forced.err
    fake_systemd(REAL, load_state="not-found")  # configured before it was installed
    configured = cli("reap", "--unit", REAL, "--dry-run", "--socket", absent)
    assert configured.code == 0, configured.err
    assert "unknown unit" not in configured.err


def test_root_forces_a_reap_in_its_own_process(
    cli: Cli, fake_systemd: FakeSystemd, tmp_path: Path
) -> None:
    """The gate server takes no --force: root's forced reap runs here, even with a socket there."""
    import socket  # noqa: PLC0415 - only this test needs a socket

    _configure(cli)
    fake_systemd(TYPO, load_state="not-found")
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # a socket nobody answers: asking it would refuse
    done = cli("reap", "--unit", TYPO, "--yes", "--force", "--socket", str(path))
    assert done.code == 0, done.err
    assert "cannot reach the gate server" not in done.err


def test_a_name_no_unit_can_have_is_refused_without_asking_systemd(
    cli: Cli, spawn_holder: HolderSpawner, tmp_path: Path
) -> None:
    """`.servce` is no unit type: reap, gate, doctor exit 64, no systemd asked (main planned)."""
    _configure(cli)  # the tests' systemctl: no bus, as where PID 1 is not systemd
    job = spawn_holder(cli.state, gpus=(1,), mib=2048, name="python3 -m sglang.launch_server")
    absent = str(tmp_path / "absent.sock")
    commands = [
        ["reap", "--unit", MISTYPED, "--scope", "patterns", "--dry-run", "--socket", absent],
        ["doctor", "--unit", MISTYPED],
    ]
    if os.geteuid() == 0:  # a user's reap --yes and gate go to the gate server, which checks too
        commands += [
            ["reap", "--unit", MISTYPED, "--scope", "patterns", "--yes", "--socket", absent],
            ["gate", "--unit", MISTYPED, "--timeout", "1", "--socket", absent],
        ]
    for command in commands:
        done = cli(*command)
        assert done.code == 64, done
        why = ".servce is no unit type (a service's name ends in .service)"
        assert done.err.splitlines()[-3:] == [
            f"gpuguard {command[0]}: unknown unit {MISTYPED!r}: {why}",
            f"  did you mean {REAL}?",
            f"  --force {command[0]}s it anyway (with the defaults: every GPU)",
        ], done.err
        assert not process_gone(job.pid)
