"""Size limits for what gpuguard keeps about its decisions (gate and recovery history).

A holder's command line, a cgroup name or a journal line is foreign text of any length: a 2 MiB
command line must not grow /run by 2 MiB per gate run. Every string is cut to TEXT_MAX
characters with a marker saying how much was cut, and a whole record to RECORD_MAX bytes of
JSON by dropping the tails of its lists, again with a note of how many entries were left out.
"""

from __future__ import annotations

import json
from typing import Any

TEXT_MAX = 4096
RECORD_MAX = 64 * 1024


def bound_text(text: str, limit: int = TEXT_MAX) -> str:
    """``text``, or its first ``limit`` characters and a marker of how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[{len(text) - limit} more characters cut]"


def _bounded(value: object) -> object:
    if isinstance(value, str):
        return bound_text(value)
    if isinstance(value, dict):
        return {bound_text(str(key)): _bounded(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_bounded(item) for item in value]
    return value


def _size(value: object) -> int:
    return len(json.dumps(value, default=str).encode())


def bound_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with long strings cut and, past RECORD_MAX, the tails of its lists dropped.

    The scalar fields (time, unit, result) always survive; ``omitted`` says which lists lost how
    many entries.
    """
    bounded = _bounded(record)
    assert isinstance(bounded, dict)  # noqa: S101 - _bounded keeps a dict a dict
    if _size(bounded) <= RECORD_MAX:
        return bounded
    lists = {key: value for key, value in bounded.items() if isinstance(value, list)}
    kept: dict[str, Any] = {key: value for key, value in bounded.items() if key not in lists}
    kept["omitted"] = {key: len(value) for key, value in lists.items()}
    budget = RECORD_MAX - _size(kept) - 64 * len(lists)  # room for the keys and the counts
    for key, entries in lists.items():
        taken: list[object] = []
        for entry in entries:
            cost = _size(entry) + 2
            if cost > budget:
                break
            taken.append(entry)
            budget -= cost
        kept[key] = taken
        kept["omitted"][key] = len(entries) - len(taken)
    kept["omitted"] = {key: n for key, n in kept["omitted"].items() if n}
    return kept
