"""The loud end of a test run that skipped tests: how many, why, and the one command that helps.

A quiet ``s`` in pytest's progress line hides that a whole class of tests (root, containers,
packaging) never ran; a newcomer's green ``make check`` must say so.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _pytest.reports import TestReport
    from _pytest.terminal import TerminalReporter

#: What installs every tool the skipped tests need; then run the suite as root.
REMEDY = "sudo make deps && sudo make check"
#: How many distinct reasons to list (the rest are counted).
SHOWN_REASONS = 8
#: How to see every reason: from make (the Makefile passes PYTEST_ARGS on), or pytest itself.
EVERY_REASON = "make check PYTEST_ARGS=-rs, or .venv/bin/python -m pytest -rs"


def skip_reason(report: TestReport) -> str:
    """The reason pytest recorded for one skipped test."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def summary_lines(reasons: list[str], total: int) -> list[str]:
    """The lines of the summary for the reasons of the skipped tests among ``total`` tests."""
    if not reasons:
        return []
    counts = Counter(reasons).most_common()
    lines = [f"{len(reasons)} of {total} tests were SKIPPED - they did not run:"]
    lines += [f"  {count:4d} x {reason}" for reason, count in counts[:SHOWN_REASONS]]
    if len(counts) > SHOWN_REASONS:
        rest = sum(count for _, count in counts[SHOWN_REASONS:])
        others = len(counts) - SHOWN_REASONS
        lines.append(f"  {rest:4d} x for {others} other reasons (each one: {EVERY_REASON})")
    lines.append(f"To run them, install what they need and run as root:  {REMEDY}")
    return lines


def report_skips(terminalreporter: TerminalReporter) -> None:
    """Write the summary at the end of the run, in red, when any test was skipped.

    Counted as pytest's own last line counts (``count_towards_summary``): a module skipped whole
    at collection is one skip there, and one here.
    """

    def counted(key: str) -> list[Any]:
        reports = terminalreporter.stats.get(key, [])
        return [r for r in reports if getattr(r, "count_towards_summary", True)]

    skipped = counted("skipped")
    ran = sum(len(counted(key)) for key in ("passed", "failed", "error"))
    lines = summary_lines([skip_reason(report) for report in skipped], ran + len(skipped))
    if not lines:
        return
    terminalreporter.write_sep("!", "SKIPPED TESTS", red=True, bold=True)
    for line in lines:
        terminalreporter.write_line(line, red=True, bold=True)
