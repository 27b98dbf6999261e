"""What each command is asked, as typed values: from the command line or from the gate server.

cli.py alone reads argparse's Namespace and turns it into one of these; the gate server builds
the gate's and reap's from the request it parsed (``from_request``; ``to_request`` is the
client's way there), so a command never learns
where its arguments came from and a renamed option cannot silently read as "not given". The
options every command takes (``--config``) and how the result is printed (``--json``) are the
command line's, and travel beside these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuguard.core.gate.proto import Request

if TYPE_CHECKING:
    from gpuguard.core.since import Since


@dataclass(frozen=True, slots=True)
class StatusArgs:
    """``gpuguard status``."""

    prometheus: bool = False
    watch: float | None = None
    since: Since | None = None


@dataclass(frozen=True, slots=True)
class ExplainArgs:
    """``gpuguard explain``."""

    unit: str | None = None
    since: str | None = None


@dataclass(frozen=True, slots=True)
class GateArgs:
    """``gpuguard gate``; ``grace``/``timeout`` None mean the configured values."""

    unit: str
    scope: str = "unit"
    grace: float | None = None
    timeout: float | None = None
    force: bool = False


#: How long ``reap`` waits for the GPUs to go idle when --timeout does not say.
REAP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ReapArgs:
    """``gpuguard reap``; ``unit`` None: the only watched one; ``grace`` None: the configured."""

    unit: str | None = None
    scope: str = "unit"
    grace: float | None = None
    timeout: float = REAP_TIMEOUT_S
    json: bool = False
    dry_run: bool = False
    yes: bool = False
    force: bool = False


@dataclass(frozen=True, slots=True)
class DoctorArgs:
    """``gpuguard doctor``; ``unit`` None means every watched unit."""

    unit: str | None = None
    fix: bool = False
    force: bool = False


@dataclass(frozen=True, slots=True)
class BreakerArgs:
    """``gpuguard breaker``; ``close`` closes the host-wide breaker (root)."""

    close: bool = False


@dataclass(frozen=True, slots=True)
class RunArgs:
    """``gpuguard run``: the daemon takes nothing but the configuration."""


@dataclass(frozen=True, slots=True)
class InstallGateArgs:
    """``gpuguard install-gate`` and ``remove-gate`` (``install`` False)."""

    unit: str
    install: bool = True
    force: bool = False


CommandArgs = (
    StatusArgs
    | ExplainArgs
    | GateArgs
    | ReapArgs
    | DoctorArgs
    | RunArgs
    | InstallGateArgs
    | BreakerArgs
)


def from_request(request: Request) -> GateArgs | ReapArgs:
    """A gate server request (a gate or a reap: gate.proto.COMMANDS) as its command's arguments.

    A request's reap never asks (nobody is at a terminal) and never dry-runs; without its own
    timeout it waits as long as the command line's reap does.
    """
    if request.command == "gate":
        return GateArgs(request.unit, request.scope, request.grace, request.timeout)
    timeout = REAP_TIMEOUT_S if request.timeout is None else request.timeout
    return ReapArgs(
        request.unit, request.scope, request.grace, timeout, json=request.json, yes=True
    )


def to_request(args: GateArgs | ReapArgs) -> Request | None:
    """What the gate server is asked to run for ``args``; None: not the server's to run.

    Every gate is one; a reap only when it signals without asking (--yes, no --dry-run) and
    names its unit: the server asks nobody and chooses no unit.
    """
    if isinstance(args, GateArgs):
        return Request("gate", args.unit, args.scope, args.grace, args.timeout)
    if args.yes and not args.dry_run and args.unit:
        return Request("reap", args.unit, args.scope, args.grace, args.timeout, args.json)
    return None
