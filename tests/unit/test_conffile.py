"""The shipped conffile documents every configuration key with its default.

Here rather than with the package tests: it needs no root and no container, so every run of the
unit suite catches a key added to gpuguard.config without its line in packaging/gpuguard.toml.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
