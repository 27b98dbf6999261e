"""Send ``gate`` or ``reap --yes`` to the root gate server and relay its answer."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from gpuguard.adapters.configfile import DEFAULT_CONFIG_PATH
from gpuguard.commands.output import Said

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from gpuguard.core.gate.proto import Request


def ask_gate_server(
    request: Request, path: str, config: Path | None, say: Callable[[str], None]
) -> Said | None:
    """Send a gate or reap to the root gate server; None: run it here instead (root, no server).

    The server's answer is relayed as it comes (its output is the unit's journal); the result
    holds its exit status, or the verdict when the server cannot be reached. ``path``: the
    server's socket (--socket); ``config``: --config; ``say`` gets the line that tells root the
    work runs in this process.

    The rule (docs/security.md): a socket at --socket means the packaged server, so always ask
    it; no socket and root means a developer's install, which runs in-process; no socket and
    not root, or a socket nobody answers, refuses - unless gate_unreachable = "allow".
    """
    from gpuguard.adapters import gateclient  # noqa: PLC0415 - see the package doc

    command = request.command
    try:
        os.lstat(path)
        present = True
    except FileNotFoundError:
        present = False
    except OSError:
        present = True  # not ours to look at: connecting says why
    if not present:
        if os.geteuid() == 0:
            say(f"gpuguard {command}: no gate server at {path}: runs here")
            return None
        reason = "no such socket"
    else:
        try:
            return Said(gateclient.ask(request, path, sys.stdout, sys.stderr))
        except gateclient.UnreachableError as err:
            reason = str(err)
    allowed = command == "gate" and _unreachable_allowed(config)
    verdict = (
        "start allowed without the gate (gate_unreachable = allow)"
        if allowed
        else ("start refused" if command == "gate" else "nothing reaped")
    )
    unreachable = f"cannot reach the gate server at {path} ({reason}): {verdict}"
    return Said(0 if allowed else 1, notices=(f"gpuguard {command}: {unreachable}",))


def _unreachable_allowed(cli_path: Path | None) -> bool:
    """Whether the operator's configuration lets a start proceed without the gate server.

    Read only from --config or the default path: the unit's environment (GPUGUARD_CONFIG)
    must not decide this. Anything unreadable or invalid means the default, refuse.
    """
    from gpuguard.adapters import configfile  # noqa: PLC0415 - see the package doc

    path = cli_path or DEFAULT_CONFIG_PATH
    cached = configfile.load_validated(path)
    if cached is not None:
        return cached.get("gate_unreachable") == "allow"
    from gpuguard.config import ConfigError, load_settings  # noqa: PLC0415

    try:
        return load_settings(path).gate_unreachable == "allow"
    except ConfigError:
        return False
