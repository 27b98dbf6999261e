"""Who may ask the gate server for what (pure): the caller is who the kernel says it is.

The server learns the caller's PID and UID from ``SO_PEERCRED`` and its unit from its cgroup
(peer.py); a request only *names* a unit. A process may ask for its own unit only — the gate
and stop-reap of the unit it runs in, as the drop-in's ``ExecStartPre=``/``ExecStopPost=`` do —
and only with the default scope. The one exception is root outside any service (an operator's
shell, ``sudo gpuguard gate``): it may ask for any unit and any scope, as it could run the same
code in-process anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuguard.core.cgroup import Attribution
    from gpuguard.core.gateproto import Request


@dataclass(frozen=True, slots=True)
class Caller:
    """The process a request came from, as the kernel describes it.

    ``environment`` is the caller's real environment (``/proc/PID/environ``, which includes the
    unit's ``EnvironmentFile=`` values), None when it could not be read.
    """

    pid: int
    uid: int
    attribution: Attribution
    environment: dict[str, str] | None

    def runs_in(self, unit: str) -> bool:
        """Whether the caller is a process of the system unit ``unit`` (its own cgroup)."""
        where = self.attribution
        return where.unit == unit and not where.user_unit and where.container is None

    @property
    def is_operator(self) -> bool:
        """Root outside any service: a login session, sudo, a transient scope."""
        where = self.attribution
        outside_services = where.unit is None or where.unit.endswith(".scope")
        return self.uid == 0 and where.container is None and outside_services

    def describe(self) -> str:
        """Where the caller runs, for refusal lines (foreign names escaped)."""
        from gpuguard.core.escaping import escape  # noqa: PLC0415 - only for a refusal

        where = self.attribution
        if where.container is not None:
            return f"a process in container {escape(where.container)}"
        if where.unit is None:
            return f"a process outside any service (uid {self.uid})"
        kind = "user unit" if where.user_unit else ""
        return f"a process of {kind + ' ' if kind else ''}{escape(where.unit)}"


def may_ask(caller: Caller) -> bool:
    """Whether ``caller`` could make any request at all: an operator, or a system service.

    Checked before a byte is read, so a process in a login session or a user's own units
    (which could never be answered) cannot hold a server slot.
    """
    where = caller.attribution
    in_service = (
        where.unit is not None
        and where.unit.endswith(".service")
        and not where.user_unit
        and where.container is None
    )
    return caller.is_operator or in_service


def refusal(request: Request, caller: Caller) -> str | None:
    """Why ``caller`` may not make ``request``; None when it may."""
    if caller.is_operator:
        return None
    what = f"{request.command} request for {request.unit} from {caller.describe()}: refused"
    if not caller.runs_in(request.unit):
        return what
    if request.scope != "unit":
        return f"{what} (scope {request.scope} only from root outside any service)"
    return None
