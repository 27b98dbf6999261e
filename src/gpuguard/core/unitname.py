r"""What gpuguard accepts as a systemd unit's name: the syntax every module checks, in one place.

systemd.unit(5): a unit name's prefix consists of ASCII letters, digits, ":", "-", "_", ".",
"\" (and "@" for a template's instance), and the whole name is at most 255 characters
(UNIT_NAME_MAX, 256 with its terminating NUL, in systemd's unit-name.h). A name is checked
before it reaches journalctl's argv, a drop-in's path or a gate request, so a forged one cannot
become an option or a path. ``UNIT_NAME`` is any unit (the journal follower, the drop-in's
directory, explain); a gate request and the configuration name a service (``SERVICE_NAME``).
"""

from __future__ import annotations

import re
from typing import Final

UNIT_NAME: Final = re.compile(r"[A-Za-z0-9:_.\\@-]{1,255}")
SERVICE_NAME: Final = re.compile(r"[A-Za-z0-9:_.\\@-]{1,247}\.service")
UNIT_TYPES: Final = (
    "service",
    "socket",
    "target",
    "device",
    "mount",
    "automount",
    "swap",
    "timer",
    "path",
    "slice",
    "scope",
)
"""The suffixes a unit's name ends in (systemd.unit(5)); any other name names no unit."""


def unit_syntax_problem(name: str) -> str | None:
    """Why ``name`` cannot name a unit, whatever systemd knows; None when it could.

    Decided without systemd: the characters and length, then the type suffix (``.servce`` is
    none), so a typo is refused even where systemd cannot be asked.
    """
    if not UNIT_NAME.fullmatch(name) or name.startswith(".") or "." not in name:
        return "not a unit's name (NAME.service)"
    suffix = name.rpartition(".")[2]
    if suffix not in UNIT_TYPES:
        return f".{suffix} is no unit type (a service's name ends in .service)"
    return None
