"""The loud skip summary: counts per reason, and the one command that installs what is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from skipsummary import EVERY_REASON, REMEDY, SHOWN_REASONS, summary_lines


def test_nothing_skipped_says_nothing() -> None:
    """A run that skipped nothing prints no summary."""
    assert summary_lines([], 10) == []


def test_reasons_are_counted_most_common_first_with_the_remedy() -> None:
    """Each reason once with its count, the most common first; the last line is the remedy."""
    reasons = ["needs root"] * 3 + ["needs debootstrap"]
    lines = summary_lines(reasons, 542)
    assert lines[0] == "4 of 542 tests were SKIPPED - they did not run:"
    assert lines[1:3] == ["     3 x needs root", "     1 x needs debootstrap"]
    assert lines[-1].endswith(REMEDY)


def test_many_reasons_are_cut_and_the_rest_counted() -> None:
    """More distinct reasons than shown: the rest are summed in one line."""
    reasons = [f"reason {n}" for n in range(SHOWN_REASONS + 3)]
    lines = summary_lines(reasons, 100)
    assert len(lines) == 1 + SHOWN_REASONS + 2
    assert lines[-2] == f"     3 x for 3 other reasons (each one: {EVERY_REASON})"


def _conftest(tmp_path: Path) -> None:
    """A conftest in ``tmp_path`` that is this repository's (its hook, its paths)."""
    tests = Path(__file__).resolve().parents[1]
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tests / 'support')!r})\n"
        f"sys.path.insert(0, {str(tests / 'fakenvml')!r})\n"
        f"exec(open({str(tests / 'conftest.py')!r}).read())\n"
    )


def test_a_module_skipped_whole_counts_as_pytest_counts_it(tmp_path: Path) -> None:
    """A module skipped at collection: the summary's count is pytest's own (it was one short)."""
    _conftest(tmp_path)
    (tmp_path / "test_a.py").write_text(
        "import pytest\ndef test_runs():\n    pass\n"
        "def test_skips():\n    pytest.skip('needs a unicorn')\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\npytest.skip('needs a dragon', allow_module_level=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "1 passed, 2 skipped" in result.stdout.splitlines()[-1], result.stdout
    assert "2 of 3 tests were SKIPPED" in result.stdout
    assert "1 x needs a dragon" in result.stdout


def test_a_real_pytest_run_ends_with_the_summary(tmp_path: Path) -> None:
    """A real run with this repository's hook: the skip summary comes after the failures list.

    One test passes, one fails, one skips, with ``-ra`` (every reason listed): the summary is
    the last thing before pytest's counts.
    """
    tests = Path(__file__).resolve().parents[1]
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(tests / 'support')!r})\n"
        f"sys.path.insert(0, {str(tests / 'fakenvml')!r})\n"
        f"exec(open({str(tests / 'conftest.py')!r}).read())\n"
    )
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_runs():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "def test_skips():\n    pytest.skip('needs a unicorn')\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "1 of 3 tests were SKIPPED" in result.stdout
    assert "1 x needs a unicorn" in result.stdout
    assert lines[-2].endswith(REMEDY), lines[-6:]
    assert "1 failed, 1 passed, 1 skipped" in lines[-1]
    assert max(n for n, line in enumerate(lines) if line.startswith("FAILED")) < len(lines) - 5
