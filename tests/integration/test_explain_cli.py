"""`gpuguard explain` end to end in a subprocess, over a recorded journal.

systemd cannot run here outside a container, so ``journalctl`` is a shell script bound over the
real program in a private mount namespace (the only stand-in; root only). It prints a journal
recorded from a real systemd 252 (tests/journal_samples) for every query, as a journal with
more in it would: the timeline must still keep only what journald's fields let it believe. The
e2e suite runs explain against a real systemd (scenario (c)).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from clirunner import Cli

SAMPLES = Path(__file__).parent.parent / "journal_samples" / "bookworm"
UNIT = "sglang.service"


@pytest.fixture
def journal(cli: Cli, tmp_path: Path) -> Iterator[Path]:
    """A journalctl stand-in printing ``journal.jsonl``; returns that file (empty at first)."""
    if os.geteuid() != 0:
        pytest.skip("binding the stand-in needs root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    printed = tmp_path / "journal.jsonl"
    printed.write_text("")
    script = bin_dir / "journalctl"
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/journalctl.args\n'
        f'[ -e {tmp_path}/fail ] && {{ echo "Failed to open journal: EIO" >&2; exit 3; }}\n'
        f"[ -e {tmp_path}/flood ] && while :; do cat {tmp_path}/flood; done\n"
        f"cat {printed}\n"
    )
    script.chmod(0o755)
    cli.doubles["journalctl"] = script
    cli.configure(f'[units."{UNIT}"]\n')
    yield printed
    cli.doubles.clear()


def test_loop_before_gpuguard_is_told_with_what_it_would_have_done(
    cli: Cli, journal: Path, tmp_path: Path
) -> None:
    """A restart loop of OOM failures, no gpuguard line: 5 failed starts, 'would … recover'."""
    journal.write_text(
        (SAMPLES / "restart-loop-start-limit.jsonl").read_text()
        + (SAMPLES / "forged-entries.jsonl").read_text()
    )
    text = cli("explain")
    assert text.code == 0, text.err
    assert "failed starts: 5" in text.out
    assert "what gpuguard would have done: 1" in text.out
    assert "gpuguard would have acted: recover (stale-gpu-holders)" in text.out
    doc = cli("explain", "--unit", UNIT, "--json", "--since=-2h").json()  # "=": argparse
    assert doc["unit"] == UNIT
    assert doc["since"] == "-2h"
    assert not doc["gpuguard_seen"]
    # The forger's 27 lifecycle claims are in what journalctl printed, and nowhere in the rows.
    assert {row["source"] for row in doc["rows"]} == {"systemd", "unit", "would"}
    assert sum(row["kind"] == "restart-scheduled" for row in doc["rows"]) == 5
    args = (tmp_path / "journalctl.args").read_text().splitlines()
    assert len(args) == 8  # four sources, twice
    assert all(line.startswith("--output=json --all") for line in args)
    assert all("--since=-2h" in line for line in args[4:])
    assert all("--boot" in line for line in args[:4])


def test_nothing_found_is_exit_1(cli: Cli, journal: Path) -> None:
    """An empty journal: one line saying so, exit 1."""
    del journal
    result = cli("explain", "--unit", UNIT)
    assert result.code == 1
    assert result.out == f"gpuguard explain: {UNIT}: nothing in the journal (this boot)\n"


def test_journalctl_failing_is_exit_69_with_its_words(cli: Cli, journal: Path) -> None:
    """A journalctl that cannot open the journal: its last line, exit 69 (EX_UNAVAILABLE)."""
    (journal.parent / "fail").touch()
    result = cli("explain", "--unit", UNIT)
    assert result.code == 69
    assert "journalctl exited 3: Failed to open journal: EIO" in result.err


@pytest.mark.parametrize(
    "args",
    [
        ("--unit", "sglang.service; rm -rf /"),
        ("--unit=-u",),
        ("--unit", UNIT, "--since", "today; ls"),
        ("--unit", UNIT, "--since", "\x1b[2J"),
    ],
)
def test_bad_arguments_are_refused_escaped(cli: Cli, journal: Path, args: tuple[str, ...]) -> None:
    """A unit or --since that is not one: exit 64, the value escaped, journalctl never run."""
    result = cli("explain", *args)
    assert result.code == 64, result.err
    assert "\x1b" not in result.err
    assert not (journal.parent / "journalctl.args").exists()


def test_several_watched_units_need_unit(cli: Cli, journal: Path) -> None:
    """With two watched units and no --unit: exit 64, saying why."""
    del journal
    cli.configure('[units."a.service"]\n[units."b.service"]\n')
    result = cli("explain")
    assert result.code == 64
    assert "name the unit with --unit" in result.err


def test_a_flood_is_cut_at_the_byte_limit(cli: Cli, journal: Path) -> None:
    """Entries of 1 MiB (a unit's native-protocol MESSAGE) without end: cut at 64 MiB a source."""
    entry = {"__CURSOR": "s=1", "_SYSTEMD_UNIT": UNIT, "MESSAGE": "CUDA out of memory" * 58_000}
    (journal.parent / "flood").write_text(json.dumps(entry) + "\n")
    result = cli("explain", "--unit", UNIT, timeout=120)
    assert result.code == 1  # nothing about the unit in what was read
    assert (
        result.err.count("journalctl: output over 64 MiB; the rest of this source is left out") == 4
    )
