"""The gate server's own record of each verdict in its journal: prefixed, escaped, bounded."""

from __future__ import annotations

import io

from gpuguard.adapters import gaterequest


def test_each_line_is_prefixed_escaped_and_a_flood_is_bounded() -> None:
    """Lines get the request's prefix, escapes stay escaped, past 200 only the exit is logged."""
    log = io.StringIO()
    copy = gaterequest._JournalCopy(log, "gate for a.service from PID 7: ")
    copy.line("gpuguard gate: a.service: Start allowed \x1b[2J\nOK: forged")
    for number in range(300):
        copy.line(f"line {number}")
    copy.line("exit 0", last=True)
    lines = log.getvalue().splitlines()
    assert all(line.startswith("gate for a.service from PID 7: ") for line in lines)
    assert lines[0].endswith("Start allowed \\x1b[2J\\nOK: forged")
    assert len(lines) == gaterequest.JOURNAL_LINES + 1
    assert "further lines not logged" in lines[-2]
    assert lines[-1] == "gate for a.service from PID 7: exit 0"
    long = io.StringIO()
    gaterequest._JournalCopy(long, "p: ").line("x" * 100_000)
    assert len(long.getvalue()) < gaterequest.JOURNAL_LINE_CHARS + 100
