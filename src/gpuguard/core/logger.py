"""The structured logger every layer writes to, as a protocol (structlog's bound logger is one).

The core decides what to say, adapters and the daemon say it: one shape for all of them, so a
test twin that records lines serves the reaper, the container stopper and the daemon alike.
"""

from __future__ import annotations

from typing import Protocol


class Logger(Protocol):
    """Key-value log lines at five levels (adapters/logs.py escapes the foreign values)."""

    def debug(self, event: str, **fields: object) -> object:
        """A detail for a developer (the daemon's journal drops it: it logs INFO and above)."""
        ...

    def info(self, event: str, **fields: object) -> object:
        """Something that went as expected."""
        ...

    def warning(self, event: str, **fields: object) -> object:
        """Something an operator should see."""
        ...

    def error(self, event: str, **fields: object) -> object:
        """Something failed."""
        ...

    def critical(self, event: str, **fields: object) -> object:
        """An operator must act now."""
        ...
