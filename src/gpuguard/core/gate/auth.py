"""Who may ask the gate server for what (pure): the caller is who the kernel says it is.

The server learns the caller's PID and UID from ``SO_PEERCRED`` and its unit from its cgroup
(peer.py); a request only *names* a unit. A process may ask for its own unit only — the gate
and stop-reap of the unit it runs in, as the drop-in's ``ExecStartPre=``/``ExecStopPost=`` do —
and only with the default scope, and only for a unit gpuguard watches (named in the
configuration, or with gpuguard's gate drop-in installed): an unwatched service's process
(any user's job in ``cron.service``) gets one refusal line, never root's signals. And of the
unit's processes only its control process may ask - the one systemd runs for its
``ExecStartPre=``/``ExecStopPost=`` (``ControlPID=``): a worker, a left-over of an earlier run
or another user's job in a shared service would otherwise take the unit's request slot,
rewrite root's record of its environment and put its own requests in the unit's history.

The one exception is the operator: root in a login session (``ssh root@host``, or ``sudo``
from anyone's session, which keeps that session's scope), or in the root cgroup itself. It may
ask for any unit and any scope, as it could run the same code in-process anyway. Root anywhere
else - a service, a transient scope (``systemd-run --scope``), a container runtime's scope that
is not recognised as a container (containerd, runc, crun, Apptainer), a user's own units - is
not: it may be confined there, and the socket must not lend it unconfined root's power.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuguard.core.escaping import escape

if TYPE_CHECKING:
    from gpuguard.core.cgroup import Attribution
    from gpuguard.core.gate.proto import Request

#: The scope logind gives a login session; it lies directly in the user's ``user-UID.slice``.
_SESSION_SCOPE = re.compile(r"session-[A-Za-z0-9]{1,64}\.scope")
_USER_SLICE = re.compile(r"user-[0-9]{1,10}\.slice")
#: What the operator is, for refusal lines.
OPERATOR = "root in a login session (ssh, or sudo from one)"


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
    cgroup: str | None = None
    """The cgroup path the attribution was made from, None when unknown."""
    control: bool | None = None
    """Whether systemd names the caller its unit's control process (``ControlPID=``, its
    ExecStartPre=/ExecStopPost=); None: not asked (only the in-process gate, gpuguard itself)."""

    def runs_in(self, unit: str) -> bool:
        """Whether the caller is a process of the system unit ``unit`` (its own cgroup)."""
        where = self.attribution
        return where.unit == unit and not where.user_unit and where.container is None

    @property
    def is_operator(self) -> bool:
        """Root in a login session's scope (any user's: sudo keeps it), or in the root cgroup.

        ``in_root_cgroup`` is the literal ``/``: nothing on a systemd host runs there but what
        root put there by hand. A cgroup outside every unit but not ``/`` is not it (a container
        runtime's own tree, ``/default/ID``, looks just like that).
        """
        where = self.attribution
        if self.uid != 0 or where.container is not None or where.unknown or where.user_unit:
            return False
        if where.unit is None:
            return self.in_root_cgroup
        return bool(
            _SESSION_SCOPE.fullmatch(where.unit)
            and where.slice is not None
            and _USER_SLICE.fullmatch(where.slice)
        )

    @property
    def in_root_cgroup(self) -> bool:
        """Whether the caller's cgroup is ``/`` itself (Attribution keeps no path: see peer)."""
        return self.cgroup == "/"

    @property
    def system_service(self) -> str | None:
        """The caller's own system service, None when it runs in none."""
        where = self.attribution
        in_service = (
            where.unit is not None
            and where.unit.endswith(".service")
            and not where.user_unit
            and where.container is None
            and not where.unknown
        )
        return where.unit if in_service else None

    def describe(self) -> str:
        """Where the caller runs, for refusal lines (foreign names escaped)."""
        where = self.attribution
        if where.container is not None:
            return f"a process in container {escape(where.container)}"
        if where.unit is None:
            return f"a process outside any service (uid {self.uid})"
        kind = "user unit" if where.user_unit else ""
        return f"a process of {kind + ' ' if kind else ''}{escape(where.unit)}"


def admission(caller: Caller, *, watched: bool) -> str | None:
    """Why ``caller`` may make no request at all (one line), None when it may.

    ``watched``: whether the caller's own system service is watched by gpuguard. Checked before
    a byte is read, so a caller that could never be answered holds no server slot.
    """
    if caller.is_operator:
        return None
    service = caller.system_service
    line = f"request from {caller.describe()}: refused"
    if service is None:
        if caller.uid == 0 and not caller.attribution.unknown:
            return f"{line} (root is an operator only as {OPERATOR})"
        return line
    if not watched:
        return (
            f"{line} ({escape(service)} is not watched by gpuguard: neither configured nor with "
            "its gate drop-in installed)"
        )
    return None


def refusal(request: Request, caller: Caller) -> str | None:
    """Why ``caller`` may not make ``request``; None when it may (after :func:`admission`)."""
    if caller.is_operator:
        return None
    what = f"{request.command} request for {request.unit} from {caller.describe()}: refused"
    if not caller.runs_in(request.unit):
        return what
    if request.scope != "unit":
        return f"{what} (scope {request.scope} only from {OPERATOR})"
    if not caller.control:
        return f"{what} ({NOT_CONTROL})"
    return None


#: Why a process of the unit that is not its control process is refused.
NOT_CONTROL = (
    "only the unit's control process - its ExecStartPre=/ExecStopPost=, systemd's ControlPID= - "
    "asks for its gate or reap"
)
