"""What every command returns, and the one place that prints it.

A command's logic gathers, decides and acts, then returns a ``Report``: its exit status, its
text or JSON document for standard output, and its notices for standard error. ``render`` (the
command line calls it once per command) writes it. Commands that must speak while they work -
the gate's progress while it waits, reap's plan before it asks - get a line sink (``say``) or a
question (``ask_on_terminal``) injected instead of writing themselves, so their logic runs in a
test without capturing anything.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gpuguard.core.escaping import escape

if TYPE_CHECKING:
    from typing import TextIO


class Report(Protocol):
    """A command's typed result, as ``render`` prints it."""

    @property
    def exit_status(self) -> int:
        """The process exit status the command ends with."""
        ...

    @property
    def notices(self) -> tuple[str, ...]:
        """Lines for standard error (warnings, refusals, the gate's verdict), in order."""
        ...

    def to_text(self) -> str:
        """Standard output as text: whole lines, every foreign string already escaped."""
        ...

    def to_json(self) -> dict[str, Any] | None:
        """The ``--json`` document; None where there is none (the text, if any, is printed)."""
        ...


@dataclass(frozen=True, slots=True)
class Said:
    """A result that is only lines: a usage error, a refusal, install-gate's change."""

    exit_status: int
    lines: tuple[str, ...] = ()
    """Standard output, one line each."""
    notices: tuple[str, ...] = ()

    def to_text(self) -> str:
        """The lines, each escaped (they may name a unit or a path someone else chose)."""
        return "".join(f"{escape(line)}\n" for line in self.lines)

    def to_json(self) -> None:
        """Nothing: such a result has no document, also under --json."""
        return


def render(report: Report, *, as_json: bool = False) -> int:
    """Print ``report`` (its document under ``as_json``, if it has one) and return its status.

    Standard output first, then the notices, each escaped and on its own line: whatever a
    notice quotes, it cannot forge a second line. The streams are looked up now, so the gate
    server's redirection of them into frames (serve_gate) catches all of it.
    """
    document = report.to_json() if as_json else None
    if document is None:
        sys.stdout.write(report.to_text())
    else:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    for notice in report.notices:
        say(notice, sys.stderr)
    return report.exit_status


def say(line: str, stream: TextIO | None = None) -> None:
    """Write one line now (standard error by default): the sink of a command's progress."""
    (stream or sys.stderr).write(f"{escape(line)}\n")


def ask_on_terminal(question: str) -> bool:
    """Whether the operator answers yes to ``question``; never without a terminal to ask on."""
    if not sys.stdin.isatty():
        return False
    sys.stdout.write(f"{question} [y/N] ")
    sys.stdout.flush()
    return sys.stdin.readline().strip().lower() in {"y", "yes"}
