"""What a newcomer sees first: the daemon run by hand, status without a driver, the help.

Each message names what happened and the next step once, without pointing into the source
tree (an installed gpuguard has none).
"""

from __future__ import annotations

import re
import subprocess
from typing import TYPE_CHECKING

import pytest
from clirunner import gpuguard_argv

from gpuguard import cli
from gpuguard.adapters import nvmllibrary

if TYPE_CHECKING:
    from pathlib import Path

    from clirunner import Cli

_GPUGUARD = gpuguard_argv()  # the tests' systemctl and journalctl, not this host's
# A path inside the source tree, as an installed gpuguard's help must not cite one.
_TREE_PATH = re.compile(r"(?<![\w/.])(?:docs|tests|src|systemd|packaging|bench)/")


def test_a_daemon_that_cannot_write_its_state_stops_at_once_saying_why(tmp_path: Path) -> None:
    """`gpuguard run` without a writable runtime_dir exits 73 in one line instead of running on."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = tmp_path / "gpuguard.toml"
    config.write_text(f'runtime_dir = "{blocker}/run"\nstate_dir = "{tmp_path}/lib"\n')
    done = subprocess.run(
        [*_GPUGUARD, "--config", str(config), "run"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 73, done.stderr
    assert done.stderr == (
        f"gpuguard run: cannot write {blocker}/run (Not a directory): the daemon runs as root "
        "(gpuguard.service); to try it as a user, give it a runtime_dir and state_dir it can "
        "write (--config FILE)\n"
    )


def test_status_without_a_driver_says_why_once_and_briefly(tmp_path: Path) -> None:
    """No libnvidia-ml.so.1 anywhere: a short reason in the headline and finding, not thrice."""
    if nvmllibrary.library_candidates(None):
        pytest.skip("this host has a libnvidia-ml.so.1")
    config = tmp_path / "gpuguard.toml"
    config.write_text(f'runtime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/lib"\n')
    done = subprocess.run(
        [*_GPUGUARD, "--config", str(config), "status"],
        capture_output=True,
        text=True,
        timeout=120,  # a full /proc scan, slow only on a loaded machine
        check=False,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    headline = done.stdout.splitlines()[0]
    reason = headline.removeprefix("gpuguard status: UNKNOWN - ")
    assert reason.startswith("NVML unavailable: libnvidia-ml.so.1 not in ldconfig's cache")
    assert len(headline) <= 140, headline
    assert done.stdout.count(reason) == 2, done.stdout  # the headline and its finding
    assert "NVML: unavailable (above)\n" in done.stdout


def test_status_tells_how_the_daemon_runs_without_assuming_the_package(cli: Cli) -> None:
    """A pip install has no gpuguard.service: the daemon line names `gpuguard run` too."""
    done = cli("status")
    [line] = [line for line in done.out.splitlines() if line.startswith("Daemon:")]
    assert line == (
        "Daemon: not running (no snapshot; the package's gpuguard.service, or `gpuguard run`)"
    )


def test_an_unknown_option_prints_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """`reap --bogus`: reap's usage and the error, exit 64, not the top-level usage."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["reap", "--bogus"])
    assert stopped.value.code == 64
    err = capsys.readouterr().err
    assert err.startswith("usage: gpuguard reap [-h] [--unit UNIT]"), err
    assert err.endswith("gpuguard reap: error: unrecognized arguments: --bogus\n")


def test_the_top_help_lists_each_command_once(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuguard --help` names every command in one list, not again in argparse's own."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: gpuguard [-h] [--version] [--config FILE] COMMAND ...\n")
    for command in ("status", "reap", "gate", "run", "doctor", "explain", "serve-gate"):
        listed = [line for line in out.splitlines() if re.match(rf"\s+{command}\b", line)]
        assert len(listed) == 1, (command, listed)
    assert "positional arguments" not in out


@pytest.mark.parametrize(
    "command",
    [
        "status",
        "explain",
        "reap",
        "gate",
        "serve-gate",
        "run",
        "doctor",
        "install-gate",
        "remove-gate",
    ],
)
def test_help_cites_no_path_of_the_source_tree(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed gpuguard has no source tree: its --help names installed paths only."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert _TREE_PATH.findall(out) == [], out
