"""The host-wide breaker: at most N recoveries by the daemon in a sliding window (pure).

The daemon backs off per unit (core.recovery); nothing else bounds what it does to a host
across units. After a driver fault several units can loop at once, and each recovery is a stop,
a reap and a model load: repeated across units it only hides the fault behind more loads. So
every action the daemon takes on its own (a recovery: stop, reap, restart; a sweep that reaps
an ended run's survivors) first asks ``admit``. Within the window at most ``max_recoveries``
pass; the next one opens the breaker: from then on the daemon only reports, until a person
closes it (``close``, ``gpuguard breaker --close``). It never closes by itself, like
NVSentinel's remediation breaker.

The state is one small document (``runtime_dir/breaker.json``, /run: gone at reboot, so the
monotonic times it keeps are only read back in the boot that wrote them). ``parse`` is total.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final, TypeGuard

BREAKER_FILE: Final = "breaker.json"
SCHEMA: Final = 1
_KEPT: Final = 1000  # recoveries kept in the document at most (the window's, newest)


@dataclass(frozen=True, slots=True)
class BreakerLimits:
    """At most ``max_recoveries`` recoveries in any ``window_s`` seconds."""

    max_recoveries: int = 6
    window_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class Recovery:
    """One action the breaker let through: when (monotonic and wall), on which unit, what."""

    at_s: float
    at: str
    unit: str
    kind: str


@dataclass(frozen=True, slots=True)
class BreakerState:
    """The window's recoveries, and since when the breaker is open (None: closed)."""

    boot_id: str | None = None
    recoveries: tuple[Recovery, ...] = ()
    open_since: str | None = None
    """When it opened (ISO 8601, the wall clock: for people)."""
    opened_after: int = 0
    """Recoveries in the window when it opened."""
    refused: int = 0
    """Recoveries refused since it opened."""
    closed_at: str | None = None
    """When a person last closed it."""
    closed_by: str | None = None

    @property
    def is_open(self) -> bool:
        """Whether the daemon only reports."""
        return self.open_since is not None

    def to_json(self) -> dict[str, Any]:
        """The document ``runtime_dir/breaker.json`` holds."""
        return {
            "schema_version": SCHEMA,
            "boot_id": self.boot_id,
            "recoveries": [
                {"at_monotonic_s": r.at_s, "at": r.at, "unit": r.unit, "kind": r.kind}
                for r in self.recoveries[-_KEPT:]
            ],
            "open_since": self.open_since,
            "opened_after": self.opened_after,
            "refused": self.refused,
            "closed_at": self.closed_at,
            "closed_by": self.closed_by,
        }


def in_window(state: BreakerState, limits: BreakerLimits, now_s: float) -> tuple[Recovery, ...]:
    """The recoveries of the last ``window_s`` seconds."""
    return tuple(r for r in state.recoveries if 0 <= now_s - r.at_s < limits.window_s)


def admit(state: BreakerState, limits: BreakerLimits, asked: Recovery) -> tuple[bool, BreakerState]:
    """Whether the recovery ``asked`` (at ``asked.at_s``, now) may happen, and the state after.

    Closed with fewer than ``max_recoveries`` in the window: it passes and is counted. At the
    limit: the breaker opens and it is refused. Open: refused, until a person closes it.
    """
    if state.is_open:
        return False, replace(state, refused=state.refused + 1)
    recent = in_window(state, limits, asked.at_s)
    if len(recent) >= limits.max_recoveries:
        return False, replace(
            state, recoveries=recent, open_since=asked.at, opened_after=len(recent), refused=1
        )
    return True, replace(state, recoveries=(*recent, asked))


def close(state: BreakerState, *, at: str, by: str) -> BreakerState:
    """Closed by a person: a fresh window (the recoveries that opened it no longer count)."""
    return BreakerState(boot_id=state.boot_id, closed_at=at, closed_by=by)


def open_phrase(state: BreakerState, limits: BreakerLimits | None = None) -> str:
    """The open breaker as status, the log and the command say it (since T after N …)."""
    within = f" in {limits.window_s / 60:g} min" if limits is not None else ""
    return (
        f"breaker open since {state.open_since} after {state.opened_after} "
        f"{'recovery' if state.opened_after == 1 else 'recoveries'}{within}"
    )


def parse(document: object, *, boot_id: str | None) -> BreakerState | None:
    """The state a document holds, if it is one of this boot; None otherwise (never raises).

    A document of another boot (its monotonic times mean nothing now), of another version, or
    malformed is None: the breaker starts closed and fresh, which is what a reboot does too.
    """
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA:
        return None
    if boot_id is None or document.get("boot_id") != boot_id:
        return None
    recoveries = document.get("recoveries")
    if not isinstance(recoveries, list):
        return None
    kept: list[Recovery] = []
    for item in recoveries[-_KEPT:]:
        recovery = _recovery(item)
        if recovery is None:
            return None
        kept.append(recovery)
    texts = [document.get(key) for key in ("open_since", "closed_at", "closed_by")]
    opened_after, refused = document.get("opened_after"), document.get("refused")
    if not all(_text(value) for value in texts) or not _count(opened_after) or not _count(refused):
        return None
    open_since, closed_at, closed_by = (str(v) if v is not None else None for v in texts)
    return BreakerState(
        boot_id, tuple(kept), open_since, int(opened_after), int(refused), closed_at, closed_by
    )


def _recovery(item: object) -> Recovery | None:
    if not isinstance(item, dict):
        return None
    at_s, at, unit, kind = (item.get(k) for k in ("at_monotonic_s", "at", "unit", "kind"))
    if not isinstance(at_s, (int, float)) or isinstance(at_s, bool):
        return None
    if not all(isinstance(v, str) and len(v) <= 512 for v in (at, unit, kind)):
        return None
    return Recovery(float(at_s), str(at), str(unit), str(kind))


def _text(value: object) -> bool:
    """Whether ``value`` is None or a short string."""
    return value is None or (isinstance(value, str) and len(value) <= 512)


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
