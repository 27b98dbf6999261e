"""A unit's optional HTTP health check: where it asks, and when its failures make a dead engine.

The third liveness signal (docs/liveness.md): the server's own ``/health`` answer, for an engine
that dies without a fatal line. What is at risk: calling a healthy run dead, and asking a
stranger, or being led by the unit's user. So the address is TCP loopback only, written one
way each (no name to resolve, no redirect to follow, no path to look up: a unix socket is
refused, docs/liveness.md says why), and a verdict counts only probes of the run that is up now:
never during its start (the start phases of ``core.liveness`` say when it is ready), never a
probe of an earlier run, and only ``failures`` in a row (a success resets the count).

Slow is not dead. A busy engine answers its ``/health`` late or not within the probe's timeout;
anyone who can send the server work can make it so. So only an answer that says the engine is
down counts towards a verdict by itself: the connection refused (nothing listens) or an HTTP 5xx
(the engine's own check failed). ``failures`` of those in a row make it dead (a slow or other
failed answer in between neither counts nor resets them); failures of any kind make it dead
only once no 2xx came for ``SILENT_DEAD_S`` (``HealthDeath.silent``), far longer than any
engine's own health timeout.

Pure: the probe itself is ``adapters.healthprobe``; time (monotonic) is passed in.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Final

MAX_URL_CHARS: Final = 512
SILENT_DEAD_S: Final = 300.0
"""Failed answers of any kind (slow ones included) make the engine dead only once no 2xx came
for this long: 15 times SGLang's own 20 s health timeout (``SGLANG_HEALTH_CHECK_TIMEOUT``),
60 times the longest probe timeout. A slow engine answers within that; a hung one does not."""
REFUSED: Final = "connection refused"
"""The probe's words for a refused connection: nothing listens on the port."""
_SERVER_ERROR: Final = re.compile(r"HTTP 5[0-9][0-9]")
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

    @property
    def says_down(self) -> bool:
        """The engine said it is down: the connection refused, or an HTTP 5xx. Slow is not."""
        return not self.ok and (
            self.detail == REFUSED or _SERVER_ERROR.fullmatch(self.detail) is not None
        )


@dataclass(frozen=True, slots=True)
class HealthDeath:
    """The check failed ``failures`` times in a row for one run: its engine is dead."""

    invocation_id: str
    since_s: float
    """The first failed probe of the streak (monotonic)."""
    since_wall_s: float
    cause: str
    """ "health check failed 3 times: HTTP 503"."""
    silent: bool = False
    """Dead by silence alone: no 2xx for ``SILENT_DEAD_S``, never ``failures`` refusals or 5xx
    in a row. The daemon's recovery acts on such a verdict once, never again without a new
    cause (core.livenessview.left_alone)."""


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
        self._down = 0
        """Answers in the streak that said the engine is down (``ProbeResult.says_down``)."""
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
            self._run, self._next_s, self._first = probed_run, now, None
            self._streak = self._down = 0
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
            self._streak, self._down, self._first = 0, 0, None
            return HealthBack(run, result.detail) if dead else None
        self._streak += 1
        self._down += result.says_down
        if self._first is None:
            self._first = (now, wall)
        if dead or self._streak < self._needed:
            return None
        return self._death(run, result, now)

    def _death(self, run: str, result: ProbeResult, now: float) -> HealthDeath | None:
        """The verdict of a streak of ``failures`` or more: down often enough, or long silent."""
        since_s, since_wall = self._first or (now, now)
        silent_s = now - since_s
        if self._down >= self._needed:
            times = "once" if self._needed == 1 else f"{self._needed} times"
            cause = f"health check failed {times}: {result.detail}"
            return HealthDeath(run, since_s, since_wall, cause)
        if silent_s >= SILENT_DEAD_S:
            cause = f"health check answered no 2xx for {silent_s:.0f} s: {result.detail}"
            return HealthDeath(run, since_s, since_wall, cause, silent=True)
        return None

    def dropped(self) -> None:
        """The death just returned did not count (systemd no longer runs that run, active).

        The streak starts over.
        """
        self._streak, self._down, self._first = 0, 0, None
