"""The package build's copy of the source leaves out a user's caches and build outputs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHES = (
    ".venv/bin/python",
    ".venv-3.12/bin/python",
    "tests/fakenvml/build/libnvidia-ml.so.1",
    "tests/fakenvml/build/old/libnvidia-ml.so.1",
    ".pytest_cache/v/cache/lastfailed",
    ".mypy_cache/3.11/gpuguard.json",
    ".ruff_cache/content",
    ".hypothesis/examples/x",
    ".coverage",
    "src/gpuguard/__pycache__/cli.cpython-311.pyc",
    "src/gpuguard.egg-info/PKG-INFO",
    "dist/gpuguard_0.1.0-3_amd64.deb",
    ".ci-logs/as-ci.log",
)
SOURCE = ("src/gpuguard/cli.py", "tests/fakenvml/fakenvml.c", "packaging/debian/control")


def test_a_tree_without_git_is_copied_without_what_gitignore_names(tmp_path: Path) -> None:
    """No .git: sources copied, every cache and build output .gitignore lists left behind."""
    tree, out = tmp_path / "tree", tmp_path / "out"
    for name in (*CACHES, *SOURCE):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    shutil.copy(ROOT / ".gitignore", tree / ".gitignore")
    out.mkdir()
    subprocess.run([ROOT / "packaging" / "copy-source", tree, out], check=True, timeout=60)
    copied = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert copied == sorted([".gitignore", *SOURCE])
