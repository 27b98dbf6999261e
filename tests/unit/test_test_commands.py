"""The developer's test commands: ``make unit`` is the quick loop, ``make check`` the floor.

What the README promises about them, read from the Makefile (``make -n`` prints the commands
without running them), pyproject.toml and the hypothesis profiles tests/conftest.py registers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def planned(target: str) -> str:
    """The commands ``make TARGET`` would run, as ``make -n`` prints them."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    environment = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
    )
    return done.stdout


def test_the_dev_profile_tries_fewer_examples_and_the_default_is_cis() -> None:
    """``dev`` tries a tenth of the examples; without HYPOTHESIS_PROFILE the default is loaded."""
    dev, thorough = settings.get_profile("dev"), settings.get_profile("gpuguard")
    assert dev.max_examples == 10 < thorough.max_examples
    assert dev.deadline is None
    assert thorough.deadline is None
    chosen = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpuguard"))
    assert settings.default is not None
    assert settings.default.max_examples == chosen.max_examples


def test_make_unit_runs_only_the_unit_tests_quietly_with_the_dev_profile() -> None:
    """``make unit``: tests/unit, ``-q``, HYPOTHESIS_PROFILE=dev, and no coverage."""
    [command] = [line for line in planned("unit").splitlines() if "-m pytest" in line]
    assert command.startswith("HYPOTHESIS_PROFILE=dev ")
    assert " -q tests/unit" in command
    assert "--cov" not in command


def test_make_check_holds_the_core_to_its_coverage_floor() -> None:
    """``make check`` runs pytest with coverage of gpuguard.core and a floor to fail under."""
    [command] = [line for line in planned("check").splitlines() if "-m pytest" in line]
    assert "--cov" in command
    assert "HYPOTHESIS_PROFILE" not in command
    coverage = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "coverage"
    ]
    assert coverage["run"]["source_pkgs"] == ["gpuguard.core"]
    assert 90 <= coverage["report"]["fail_under"] < 100


def test_no_two_test_modules_share_a_basename() -> None:
    """Each test module's basename is unique under tests/.

    The test directories are no packages, so pytest imports each module by its basename: a
    clash stops the whole suite's collection, which e2e-only or unit-only runs do not show.
    """
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
