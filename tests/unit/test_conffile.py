"""The shipped conffile: every configuration key with its default; the docs' off switch works.

Here rather than with the package tests: it needs no root and no container, so every run of the
unit suite catches a key added to gpuguard.config without its line in packaging/gpuguard.toml.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from gpuguard.adapters.configfile import read_config
from gpuguard.config import parse_settings

ROOT = Path(__file__).resolve().parents[2]
CONFFILE = "/etc/gpuguard/gpuguard.toml"


def test_conffile_documents_every_key_with_its_default() -> None:
    """packaging/gpuguard.toml, uncommented, is exactly the defaults and names every key."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "packaging/check_conffile.py"), "packaging/gpuguard.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _off_switch(doc: str) -> tuple[list[str], str]:
    """The off switch ``doc`` prints: its ``sed`` as argv, and what runs after it."""
    lines = [
        line
        for line in (ROOT / doc).read_text(encoding="utf-8").splitlines()
        if line.startswith("sed -i ") and "dry_run" in line
    ]
    assert len(lines) == 1, f"{doc}: one off-switch line, not {lines}"
    sed, restart = lines[0].split(" && ")
    return shlex.split(sed), restart


def _dry_run(path: Path) -> bool:
    """[daemon] dry_run as gpuguard's configuration loader reads ``path``."""
    return parse_settings(read_config(path), path).daemon.dry_run


def test_documented_off_switch_sets_dry_run_in_the_shipped_conffile(tmp_path: Path) -> None:
    """install.md's off switch, run on the conffile the package ships, makes dry_run true."""
    conffile = tmp_path / "gpuguard.toml"
    shutil.copyfile(ROOT / "packaging/gpuguard.toml", conffile)
    conffile.chmod(0o644)
    assert _dry_run(conffile) is False  # as shipped, the daemon acts
    sed, restart = _off_switch("docs/install.md")
    assert restart == "systemctl restart gpuguard"
    assert sed[-1] == CONFFILE
    subprocess.run([*sed[:-1], str(conffile)], check=True)
    assert _dry_run(conffile) is True


def test_runbook_prints_the_same_off_switch() -> None:
    """The runbook's off switch is install.md's, character for character."""
    assert _off_switch("docs/runbook.md") == _off_switch("docs/install.md")
