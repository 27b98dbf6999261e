"""What systemd says of a unit at one moment (``UnitState``), parsed from ``systemctl show``.

adapters/systemd runs systemctl and names the main process; the parse is pure and lives here
so that the core's decisions (the gate's and reap's plan, the daemon's recovery, status) take
the value itself rather than a protocol standing for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuguard.core import unitconfig
from gpuguard.core.ledger import is_invocation_id

# Where a unit is while systemd runs its ExecStartPre= (start-pre) or ExecStopPost= (stop-post,
# and the final-* states that follow it when it overstays).
_CONTROL_STATES = frozenset(
    {"start-pre", "stop-post", "final-sigterm", "final-sigkill", "final-watchdog"}
)
_ENDING_STATES = _CONTROL_STATES - {"start-pre"}
NOT_FOUND = "not-found"
"""``LoadState=`` of a unit systemd does not know (a typo, a package not installed)."""


def no_such_unit(unit: str) -> str:
    """What doctor and install-gate say of a unit systemd does not know."""
    return f"systemd has no unit {unit} (LoadState=not-found; a typo?)"


if TYPE_CHECKING:
    from gpuguard.core.values import ProcessIdentity


@dataclass(frozen=True, slots=True)
class UnitState:
    """What systemd says about a unit; ``error`` is set when it could not be asked."""

    unit: str
    active_state: str | None = None
    sub_state: str | None = None
    main_pid: int | None = None
    invocation_id: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    n_restarts: int | None = None
    user: str | None = None
    dynamic_user: bool = False
    error: str | None = None
    load_state: str | None = None
    control_pid: int | None = None
    """The ExecStartPre=/ExecStopPost=/… process systemd runs now; None when there is none."""
    control_group: str | None = None
    """The unit's cgroup (``/system.slice/sglang.service``) while it has one (the ledger)."""
    kill_mode: str | None = None
    """``KillMode=`` (control-group, mixed, process, none): what a stop kills of the cgroup."""
    main: ProcessIdentity | None = None
    """The process at ``main_pid`` as /proc named it right after systemd did (``show_unit``):
    what a KillMode=process stop signals, which a process given its PID later is not."""
    stop_timeout_s: float | None = None
    """``TimeoutStopSec=`` in seconds: what each phase of a stop, ExecStopPost= too, may take;
    None for infinity, or when systemd did not say (core/stopbudget.py)."""

    @property
    def not_found(self) -> bool:
        """Whether systemd has no such unit (a typo, a package not installed).

        ``ActiveState=inactive`` says nothing here: systemctl answers ``LoadState=not-found``
        with ``ActiveState=inactive`` for any name.
        """
        return self.load_state == NOT_FOUND

    @property
    def running(self) -> bool:
        """Active, reloading or still starting: its current invocation's processes are live."""
        return self.active_state in {"active", "reloading", "activating", "deactivating"}

    def ending_run(self) -> str | None:
        """The run whose stop systemd is finishing (ExecStopPost=, final kills); None otherwise.

        While the unit is in one of these states its control process runs and systemd starts no
        new run, so what is in the cgroup now is that run's (or an earlier one's, never a later).
        """
        invocation = self.invocation_id
        if self.error is not None or self.sub_state not in _ENDING_STATES or not invocation:
            return None
        return invocation if is_invocation_id(invocation) else None

    def is_control_process(self, pid: int, *, trust_unknown: bool) -> bool:
        """Whether ``pid`` is the unit's ExecStartPre=/ExecStopPost= process, as systemd says.

        Only that process may speak for the unit's run being over: any other process in the
        cgroup (a worker, another user's job in a multi-user service) may not. When systemd
        cannot be asked, ``trust_unknown`` decides (root running gpuguard itself in the cgroup).
        """
        if self.error is not None or self.sub_state is None:
            return trust_unknown
        return self.sub_state in _CONTROL_STATES and self.control_pid == pid

    def in_words(self) -> str:
        """The unit's state as status and the daemon's snapshot say it.

        A unit systemd does not know is "not found", not "inactive"; one systemd could not be
        asked about is "state unknown", with why.
        """
        if self.error:
            return f"state unknown ({self.error})"
        if self.not_found:
            return "not found (LoadState=not-found: systemd has no such unit)"
        return f"{self.active_state} ({self.sub_state})"


def properties(text: str) -> dict[str, str]:
    """``systemctl show``'s KEY=VALUE lines as a dict."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value
    return values


def _pid(text: str) -> int | None:
    """A PID property (0 means none); None when absent, zero or not a plain number."""
    return (
        int(text)
        if text.isascii() and text.isdigit() and 0 < len(text) <= 10 and int(text)
        else None
    )


def parse_show(unit: str, text: str) -> UnitState:
    """Parse ``systemctl show`` KEY=VALUE output (Environment= as systemctl shell-quotes it)."""
    values = properties(text)
    restarts = values.get("NRestarts", "")
    return UnitState(
        unit=unit,
        active_state=values.get("ActiveState") or None,
        sub_state=values.get("SubState") or None,
        main_pid=_pid(values.get("MainPID", "")),
        control_pid=_pid(values.get("ControlPID", "")),
        control_group=values.get("ControlGroup") or None,
        invocation_id=values.get("InvocationID") or None,
        environment=unitconfig.parse_environment(values.get("Environment", "")),
        n_restarts=int(restarts) if restarts.isdecimal() else None,
        load_state=values.get("LoadState") or None,
        user=values.get("User") or None,
        dynamic_user=values.get("DynamicUser") == "yes",
        kill_mode=values.get("KillMode") or None,
        stop_timeout_s=_span(values.get("TimeoutStopUSec", "")),
    )


def _span(text: str) -> float | None:
    """A time span property ("5s", "1min 30s"); None for infinity, absent or unreadable."""
    return None if text in {"", "infinity"} else unitconfig.parse_timespan(text)
