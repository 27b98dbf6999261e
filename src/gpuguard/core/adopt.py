"""Which other cgroups an operator says a unit's processes legitimately move to (pure).

``adopt = ["tp-worker-*.scope"]`` names systemd units (scopes, mostly) by a glob in which only
``*`` is special (any run of characters, possibly none). Matching is linear: the pieces between
the stars are found left to right with ``str.find``, so a name or a pattern chosen to be
pathological costs no more than a scan, unlike a regular expression's backtracking.

Some scopes are never a unit's workers, whoever runs in them: a login session
(``session-3.scope``, ``session-c1.scope``) and a transient scope ``systemd-run`` names for
itself (``run-r3f2….scope``, ``run-u7.scope``), which hold whatever someone ran by hand: a glob
that can match one would hand a user's own processes to the gate. So a glob must begin with a
literal prefix (the characters before its first ``*``) that no such name can begin with:
``glob_problem`` refuses it otherwise, and ``adopting_glob`` never adopts such a name whatever
the glob (a configuration read before this rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

MAX_GLOB_CHARS = 256
NEVER_ADOPTED: Final = ("session-", "run-")
"""Prefixes of the scopes no glob may adopt: login sessions, ``systemd-run``'s own names."""


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


def glob_problem(glob: str) -> str | None:
    """Why ``glob`` may not be adopted (it can match a login session or a ``run-*`` scope)."""
    prefix = glob.split("*", 1)[0]
    for never in NEVER_ADOPTED:
        if never.startswith(prefix) or prefix.startswith(never):
            what = "login sessions" if never == "session-" else "systemd-run's own scopes"
            return (
                f"{glob!r} can match {never}*.scope ({what}, which any user makes): an adopt "
                f"glob begins with a literal prefix no {', '.join(NEVER_ADOPTED)} name begins "
                'with, such as "tp-worker-*.scope"'
            )
    return None


def adopting_glob(unit: str | None, globs: Sequence[str]) -> str | None:
    """The first of ``globs`` that names ``unit`` (a holder's innermost systemd unit), if any.

    A login session or a ``run-*`` scope is never adopted, whatever the glob.
    """
    if unit is None or unit.startswith(NEVER_ADOPTED):
        return None
    return next((glob for glob in globs if glob_match(glob, unit)), None)
