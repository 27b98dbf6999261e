"""Judge an inventory and render it for an operator: one screen of text, or versioned JSON (pure).

The exit status follows the monitoring-plugin convention (0 OK, 1 WARNING, 2 CRITICAL,
3 UNKNOWN) so the same command serves a human at a terminal and a Nagios/Icinga-style check.
The package holds one step each: ``report`` the values (context in, report out), ``judge`` the
findings and the level (with ``gpufindings`` and ``holderfindings``), ``text`` the screen,
``document`` the JSON, ``words`` the phrases the findings and the screen share. Its callers
import from here.
"""

from gpuguard.core.status.document import SCHEMA_VERSION, to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.report import (
    DaemonView,
    Finding,
    Level,
    StatusContext,
    StatusReport,
    UnitView,
)
from gpuguard.core.status.text import render_text

__all__ = [
    "SCHEMA_VERSION",
    "DaemonView",
    "Finding",
    "Level",
    "StatusContext",
    "StatusReport",
    "UnitView",
    "assess",
    "render_text",
    "to_json",
]
