"""The monitoring-plugin level every judgement speaks: status's findings and doctor's alike.

Nagios's plugin convention, which monitoring systems read from the exit status: 0 OK,
1 WARNING, 2 CRITICAL, 3 UNKNOWN. The worst finding's level is the command's exit status;
which is worst is ``worst``'s rule, not the numbers' order.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable


class Level(IntEnum):
    """Monitoring-plugin levels; the value is the exit status."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


# A CRITICAL finding is a fact that needs an operator; UNKNOWN says only that something could not
# be judged. A screen that prints a CRITICAL line exits 2, whatever else it could not judge.
_SEVERITY = (Level.OK, Level.WARNING, Level.UNKNOWN, Level.CRITICAL)


def worst(levels: Iterable[Level]) -> Level:
    """The worst of these levels (CRITICAL above UNKNOWN above WARNING above OK); OK if none."""
    return max(levels, key=_SEVERITY.index, default=Level.OK)
