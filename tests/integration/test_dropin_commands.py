"""A unit systemd does not know, and the gate drop-in commands: what gpuguard says and refuses.

systemd cannot run here outside a container, so ``systemctl`` is a small shell script bound over
the real one in a private mount namespace (the only stand-in; gpuguard never looks at PATH): it
answers ``show`` the way systemd 252 answers for a unit it has no file for
(``LoadState=not-found``, ``ActiveState=inactive``, exit 0) and records ``daemon-reload``.
Everything else is the real CLI in a subprocess, writing the real drop-in directory, with real
privilege drops for the non-root cases.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from asnobody import public_dir, run_as_nobody
from daemontwins import Recorder, ReplayFollower

from gpuguard.adapters import dropin
from gpuguard.adapters.systemd import provenance
from gpuguard.config import Settings
from gpuguard.core.inventory import build_inventory
from gpuguard.core.unitstate import parse_show
from gpuguard.core.values import NvmlHealth, NvmlReading, ProcScan
from gpuguard.daemon.loop import Daemon
from gpuguard.daemon.ports import Ports
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli

SHOW_NOT_FOUND = (
    "LoadState=not-found\\nActiveState=inactive\\nSubState=dead\\nMainPID=0\\n"
    "InvocationID=\\nEnvironment=\\nNRestarts=0\\n"
)
SHOW_LOADED = (
    "LoadState=loaded\\nActiveState=inactive\\nSubState=dead\\nMainPID=0\\n"
    "InvocationID=\\nEnvironment=\\nNRestarts=0\\n"
)


@dataclass(frozen=True)
class Systemctl:
    """The systemctl stand-in: which answer ``show`` gives, and the log of other verbs."""

    bin_dir: Path
    log: Path

    def answer(self, show: str) -> None:
        """(Re)write the script so ``systemctl show`` prints ``show`` (printf escapes)."""
        script = self.bin_dir / "systemctl"
        script.write_text(
            "#!/bin/sh\n"
            f"if [ \"$1\" = show ]; then printf '{show}'; exit 0; fi\n"
            f'echo "$*" >> {self.log}\n'
        )
        script.chmod(0o755)

    def calls(self) -> list[str]:
        """The non-show invocations so far."""
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def systemctl(cli: Cli, tmp_path: Path) -> Iterator[Systemctl]:
    """A systemctl that knows no unit, in place of the real one (see Cli.command)."""
    needs_root()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = Systemctl(bin_dir, tmp_path / "systemctl.log")
    fake.answer(SHOW_NOT_FOUND)
    cli.doubles["systemctl"] = bin_dir / "systemctl"
    yield fake
    del cli.doubles["systemctl"]


@pytest.fixture
def unit() -> Iterator[str]:
    """A unit name of this test; its drop-in directory is removed afterwards."""
    name = f"gg-truth-{uuid.uuid4().hex[:8]}.service"
    yield name
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(dropin.drop_in_path(name).parent)


def needs_root() -> None:
    """The drop-in directory and the privilege drop both need root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")


def needs_roots_own_gpuguard() -> None:
    """A drop-in may only run a gpuguard that root alone can change: not one in a user's venv.

    ``sudo make check`` in another user's clone runs that user's .venv, whose gpuguard
    install-gate rightly refuses to write into a drop-in.
    """
    for directory in Path(sys.executable).parents:
        if directory.stat().st_uid != 0:
            pytest.skip(f"the tests' gpuguard is under {directory}, not root's (another's clone)")


def test_install_gate_refuses_a_unit_systemd_does_not_know(
    cli: Cli, systemctl: Systemctl, unit: str
) -> None:
    """No unit file: exit 1, "LoadState=not-found" named, nothing written, no reload."""
    needs_root()
    result = cli("install-gate", "--unit", unit)
    assert result.code == 1
    assert f"systemd has no unit {unit} (LoadState=not-found" in result.err
    assert "--force" in result.err
    assert not dropin.drop_in_path(unit).exists()
    assert systemctl.calls() == []


def test_install_gate_force_installs_and_remove_gate_removes(
    cli: Cli, systemctl: Systemctl, unit: str
) -> None:
    """--force writes the drop-in anyway; remove-gate then removes the untouched file."""
    needs_root()
    needs_roots_own_gpuguard()
    installed = cli("install-gate", "--unit", unit, "--force")
    assert installed.code == 0, installed.err
    path = dropin.drop_in_path(unit)
    assert dropin.as_installed(path.read_bytes())
    removed = cli("remove-gate", "--unit", unit)
    assert removed.code == 0, removed.err
    assert f"{path}: removed" in removed.out
    assert not path.exists()
    assert systemctl.calls() == ["daemon-reload", "daemon-reload"]


def test_install_gate_on_a_known_unit_needs_no_force(
    cli: Cli, systemctl: Systemctl, unit: str
) -> None:
    """LoadState=loaded (inactive is fine: the gate guards the next start)."""
    needs_root()
    needs_roots_own_gpuguard()
    systemctl.answer(SHOW_LOADED)
    result = cli("install-gate", "--unit", unit)
    assert result.code == 0, result.err
    assert dropin.drop_in_path(unit).exists()
    assert f"it sets TimeoutStartSec=600 and KillMode=mixed for {unit}" in result.out


def test_remove_gate_keeps_an_edited_drop_in(cli: Cli, systemctl: Systemctl, unit: str) -> None:
    """An operator's edit is kept and the command says so; no daemon-reload for nothing."""
    needs_root()
    path = dropin.drop_in_path(unit)
    path.parent.mkdir(parents=True)
    edited = dropin.render("/usr/bin/gpuguard").replace("KillMode=mixed", "KillMode=control-group")
    path.write_text(edited)
    result = cli("remove-gate", "--unit", unit)
    assert result.code == 1
    assert f"kept {path}" in result.err
    assert "not what install-gate wrote" in result.err
    assert path.read_text() == edited
    assert systemctl.calls() == []


@pytest.mark.parametrize("command", ["install-gate", "remove-gate"])
def test_gate_commands_as_non_root_say_needs_root(
    cli: Cli, systemctl: Systemctl, unit: str, command: str
) -> None:
    """As nobody: one "needs root" line, exit 77, no traceback, nothing touched."""
    needs_root()
    del systemctl
    with public_dir() as public:
        config = public / "gpuguard.toml"
        shutil.copy(cli.config, config)
        config.chmod(0o644)
        args = ["--config", str(config), command, "--unit", unit]
        result = run_as_nobody(args, cli.env, prefix=cli.prefix())
    assert result.code == 77, result.err
    assert result.err == (
        f"gpuguard {command}: needs root (it changes /etc/systemd/system and runs "
        "systemctl daemon-reload)\n"
    )
    assert not dropin.drop_in_path(unit).parent.exists()


def test_status_says_a_watched_unit_does_not_exist(
    cli: Cli, systemctl: Systemctl, unit: str
) -> None:
    """Not "inactive (dead)": "not found", a WARNING, and "found": false in JSON."""
    del systemctl
    cli.configure(f'[units."{unit}"]\n')
    text = cli("status")
    assert text.code == 1, text.out
    assert f"Unit {unit}: not found (LoadState=not-found" in text.out
    assert "inactive (dead)" not in text.out
    assert f"WARNING: watched unit {unit} does not exist (LoadState=not-found)" in text.out
    doc = cli("status", "--json").json()
    assert doc["units"][0]["found"] is False


def test_daemon_says_a_watched_unit_is_not_found(tmp_path: Path) -> None:
    """Not "watching U: ok": a warning once, "unit not found" in STATUS= and the snapshot.

    The inventory is a hand-made empty one (no GPU matters here) and systemctl's answer is the
    recorded text systemd 252 prints for an unknown unit, through the real parser.
    """
    unit = "nosuch.service"
    settings = Settings(
        units={unit: UnitSettings()}, runtime_dir=tmp_path / "run", state_dir=tmp_path / "lib"
    )
    empty = build_inventory(NvmlReading(NvmlHealth.OK), ProcScan(()), 0)
    log = Recorder()
    snapshots: list[dict[str, Any]] = []
    turns: list[Daemon] = []

    def sleep(seconds: float) -> None:
        del seconds
        turns[0].request_stop()

    ports = Ports(
        gather=lambda: empty,
        show_unit=lambda name: parse_show(name, SHOW_NOT_FOUND.replace("\\n", "\n")),
        control=lambda verb, name: f"unexpected {verb} {name}",
        reap=lambda _unit, _targets: (),
        notifier=log,
        log=log,
        wall=time.time,
        monotonic=time.monotonic,
        sleep=sleep,
        write_snapshot=snapshots.append,
        load_unit_state=lambda _name: None,
        save_unit_state=lambda _name, _document: None,
        untouchable=frozenset({os.getpid()}),
        provenance=provenance,
    )
    daemon = Daemon(settings, ReplayFollower([]), ports)
    turns.append(daemon)
    assert daemon.run() == 0
    warnings = [f for level, event, f in log.lines if event == "watched unit not found"]
    assert warnings == [{"unit": unit, "load_state": "not-found"}]
    assert f"READY watching {unit}: unit not found; journal attached" in log.notes
    snapshot = snapshots[-1]["units"][unit]
    assert snapshot["unit_found"] is False
    assert snapshot["systemd_state"].startswith("not found (LoadState=not-found")
