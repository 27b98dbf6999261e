"""The package's postrm on this machine's /bin/sh, in a private mount namespace (needs root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

POSTRM = Path(__file__).resolve().parents[2] / "packaging" / "debian" / "gpuguard.postrm"
TEXTFILE_DIR = Path("/var/lib/prometheus")


def run_postrm(action: str, prometheus: Path) -> subprocess.CompletedProcess[str]:
    """``postrm ACTION`` with ``prometheus`` mounted over /var/lib/prometheus, for it alone."""
    script = f'mount --bind "$1" {TEXTFILE_DIR} && exec sh "$2" "$3"'
    return subprocess.run(
        [
            *("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"),
            *(str(prometheus), str(POSTRM), action),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a private mount namespace")
@pytest.mark.skipif(not TEXTFILE_DIR.is_dir(), reason="needs /var/lib/prometheus to mount over")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_remove_takes_the_metrics_textfile_and_never_follows_a_link(tmp_path: Path) -> None:
    """After `apt remove` nothing writes gpuguard.prom: postrm deletes it, a planted link only."""
    prometheus = tmp_path / "prometheus"
    exporter = prometheus / "node-exporter"
    exporter.mkdir(parents=True)
    textfile = exporter / "gpuguard.prom"
    textfile.write_text("gpuguard_daemon_up 1\n")
    other = exporter / "node.prom"
    other.write_text("x 1\n")
    done = run_postrm("remove", prometheus)
    assert done.returncode == 0, done.stderr
    assert not textfile.exists()
    assert other.exists()
    target = tmp_path / "precious"
    target.write_text("keep\n")
    textfile.symlink_to(target)
    done = run_postrm("remove", prometheus)
    assert done.returncode == 0, done.stderr
    assert not textfile.is_symlink()
    assert target.read_text() == "keep\n"
