"""Which other cgroups an operator says a unit's processes legitimately move to (pure).

``adopt = ["tp-worker-*.scope"]`` names systemd units (scopes, mostly) by a glob in which only
``*`` is special (any run of characters, possibly none). Matching is linear: the pieces between
the stars are found left to right with ``str.find``, so a name or a pattern chosen to be
pathological costs no more than a scan, unlike a regular expression's backtracking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

MAX_GLOB_CHARS = 256


def glob_match(pattern: str, name: str) -> bool:
    """Whether ``name`` matches ``pattern``, ``*`` matching any run of characters."""
    pieces = pattern.split("*")
    if len(pieces) == 1:
        return name == pattern
    first, *middle, last = pieces
    if len(name) < len(first) + len(last) or not (name.startswith(first) and name.endswith(last)):
        return False
    position, end = len(first), len(name) - len(last)
    for piece in middle:
        found = name.find(piece, position, end)
        if found < 0:
            return False
        position = found + len(piece)
    return True


def adopting_glob(unit: str | None, globs: Sequence[str]) -> str | None:
    """The first of ``globs`` that names ``unit`` (a holder's innermost systemd unit), if any."""
    if unit is None:
        return None
    return next((glob for glob in globs if glob_match(glob, unit)), None)
