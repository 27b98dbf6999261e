"""The monitoring-plugin level every judgement speaks: status's findings and doctor's alike.

Nagios's plugin convention, which monitoring systems read from the exit status: 0 OK,
1 WARNING, 2 CRITICAL, 3 UNKNOWN. The worst finding's level is the command's exit status.
"""

from __future__ import annotations

from enum import IntEnum


class Level(IntEnum):
    """Monitoring-plugin levels; the value is the exit status."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3
