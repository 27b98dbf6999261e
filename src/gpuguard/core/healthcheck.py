"""A unit's optional HTTP health check: where it asks, and when its failures make a dead engine.

The third liveness signal (docs/liveness.md): the server's own ``/health`` answer, for an engine
that dies without a fatal line. What is at risk: calling a healthy run dead, and asking a
stranger, or being led by the unit's user. So the address is TCP loopback only, written one
way each (no name to resolve, no redirect to follow, no path to look up: a unix socket is
refused, docs/liveness.md says why), and a verdict counts only probes of the run that is up now:
never during its start (the start phases of ``core.liveness`` say when it is ready), never a
probe of an earlier run, and only ``failures`` in a row (a success resets the count).

Pure: the probe itself is ``adapters.healthprobe``; time (monotonic) is passed in.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Final

MAX_URL_CHARS: Final = 512
_PATH: Final = r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*"
"""RFC 3986's path and query characters: no space, no CR/LF (no header injection), no '#'."""
_TCP: Final = re.compile(
    r"http://(?P<host>127\.0\.0\.1|\[::1\]|localhost)(?::(?P<port>[0-9]{1,5}))?(?P<path>"
    + _PATH
    + r")"
)
_ADDRESSES: Final = {"127.0.0.1": "127.0.0.1", "[::1]": "::1", "localhost": "127.0.0.1"}
"""``localhost`` is 127.0.0.1, never a name lookup (NSS could block the daemon or answer
anything)."""
_HINT: Final = (
    "use http://127.0.0.1:PORT/PATH, http://[::1]:PORT/PATH or http://localhost:PORT/PATH "
    "(TCP loopback only)"
)
_NO_UNIX: Final = (
    "a unix socket is not supported: the root daemon would connect through a path the unit's "
    "user controls (a symlink to a root-only socket, or a FUSE mount that blocks the lookup "
    "and stops the daemon's loop); see docs/liveness.md"
)


@dataclass(frozen=True, slots=True)
class HealthTarget:
    """Where a health check asks: a loopback TCP address and port, and the request path."""

    path: str
    """The request's path (and query), as written: checked, printable ASCII."""
    address: str
    """The loopback address to connect to: "127.0.0.1" or "::1"."""
    port: int = 80

    @property
    def host_header(self) -> str:
        """The request's ``Host:``: the loopback address and port."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


@functools.lru_cache(maxsize=64)
def parse_health_url(text: str) -> HealthTarget:
    """The target ``text`` names; ValueError saying what is wrong and what to write instead.

    Cached: the daemon asks for a unit's target before each probe.
    """
    if len(text) > MAX_URL_CHARS:
        raise ValueError(f"is longer than {MAX_URL_CHARS} characters")
    if text.startswith("https://"):
        raise ValueError(
            f"{text!r}: https is not supported (a loopback check is plain HTTP); {_HINT}"
        )
    if text.startswith(("http://unix:", "unix:")):
        raise ValueError(f"{text!r}: {_NO_UNIX}; {_HINT}")
    if found := _TCP.fullmatch(text):
        port = int(found["port"] or "80")
        if not 1 <= port <= 65535:
            raise ValueError(f"{text!r}: port {port} is outside 1..65535")
        return HealthTarget(found["path"], _ADDRESSES[found["host"]], port)
    raise ValueError(f"{text!r} is not a loopback HTTP URL; {_HINT}")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe's answer: healthy or not, and in a few words why ("HTTP 503", "timed out")."""

    ok: bool
    detail: str
    """Our own words and the status code only: never the response's text."""
    counts: bool = True
    """False when the daemon could not even ask (its sandbox refused the socket): that says
    nothing about the engine, so it is neither a failure nor a success."""


@dataclass(frozen=True, slots=True)
class HealthDeath:
    """The check failed ``failures`` times in a row for one run: its engine is dead."""

    invocation_id: str
    since_s: float
    """The first failed probe of the streak (monotonic)."""
    since_wall_s: float
    cause: str
    """ "health check failed 3 times: HTTP 503"."""


@dataclass(frozen=True, slots=True)
class HealthBack:
    """A run the check had made dead answered healthy again: that verdict ends."""

    invocation_id: str
    detail: str
    """ "HTTP 200"."""


class HealthCheck:
    """One unit's check: when the next probe is due, and what the probes' answers add up to."""

    def __init__(self, every_s: float, failures: int) -> None:
        """Probe every ``every_s`` while the run is up; ``failures`` in a row make it dead."""
        self._every_s = every_s
        self._needed = failures
        self._run: str | None = None
        self._next_s = 0.0
        self._streak = 0
        self._first: tuple[float, float] | None = None
        self.blocked: str | None = None
        """Why the last probe could not even be made (``ProbeResult.counts`` False); None."""

    def due_in(self, probed_run: str | None, now: float) -> float | None:
        """Seconds until the next probe of ``probed_run``; None: no run to probe.

        ``probed_run`` is the run core.liveness lets the check ask (``Liveness.probed_run``):
        up, or dead by this check only. A new run is probed at once.
        """
        if probed_run is None:
            return None
        if probed_run != self._run:
            self._run, self._next_s, self._streak, self._first = probed_run, now, 0, None
        return max(0.0, self._next_s - now)

    @property
    def next_s(self) -> float:
        """When the next probe of the current run is due (monotonic): the oldest goes first."""
        return self._next_s

    def answered(  # noqa: PLR0913 - one answer, its moment, and the run's state then
        self,
        run: str,
        result: ProbeResult,
        *,
        now: float,
        wall: float,
        probed_run: str | None,
        dead: bool = False,
    ) -> HealthDeath | HealthBack | None:
        """Count a probe of ``run``'s answer: the death once ``failures`` in a row failed.

        For a run this check made ``dead``, the first success ends that verdict. A probe of a
        run that is no longer the one probed (it ended, or another began while the probe
        waited) counts for nothing.
        """
        if run != self._run or run != probed_run:
            return None
        self._next_s = now + self._every_s
        self.blocked = None if result.counts else result.detail
        if not result.counts:
            return None
        if result.ok:
            self._streak, self._first = 0, None
            return HealthBack(run, result.detail) if dead else None
        self._streak += 1
        if self._first is None:
            self._first = (now, wall)
        if dead or self._streak < self._needed:
            return None
        times = "once" if self._needed == 1 else f"{self._needed} times"
        since_s, since_wall = self._first
        cause = f"health check failed {times}: {result.detail}"
        return HealthDeath(run, since_s, since_wall, cause)

    def dropped(self) -> None:
        """The death just returned did not count (systemd no longer runs that run, active).

        The streak starts over.
        """
        self._streak, self._first = 0, None
