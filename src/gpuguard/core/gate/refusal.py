"""Whether the gate refuses a unit's starts now, from its recorded decisions (pure).

The gate server (root) appends each decision to the unit's log in ``runtime_dir``
(``adapters/state.record_gate_decision``): the newest one tells whether the gate refused the
last start and what it named. A refusal is evidence that the unit's GPUs are the cause of its
failed starts: the server never ran, so it printed no start-failure line of its own. Status and
the daemon read it through this one rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


def last_refusal(decisions: Sequence[Mapping[str, object]]) -> tuple[str, ...] | None:
    """The blockers the newest decision named when it was a refusal; None when it was not.

    A refusal that named nothing is an empty tuple, still a refusal.
    """
    if not decisions or decisions[-1].get("result") != "refused":
        return None
    named = decisions[-1].get("blockers")
    return tuple(str(b) for b in named) if isinstance(named, list) else ()
