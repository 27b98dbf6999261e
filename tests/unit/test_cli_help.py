"""Every command's --help is byte for byte what tests/help_samples recorded (80 columns)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpuguard import cli

SAMPLES = Path(__file__).resolve().parents[1] / "help_samples"


def _commands() -> list[str]:
    parser = cli.build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


def test_every_command_has_a_recorded_help() -> None:
    """A new command gets a sample too, so its --help is pinned from its first day."""
    recorded = {path.stem for path in SAMPLES.glob("*.txt")}
    assert recorded == {"gpuguard", *_commands()}


@pytest.mark.parametrize("command", ["gpuguard", *_commands()])
def test_help_is_what_was_recorded(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuguard COMMAND --help` prints the recorded text and exits 0."""
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["--help"] if command == "gpuguard" else [command, "--help"]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 0
    assert capsys.readouterr().out == (SAMPLES / f"{command}.txt").read_text()
