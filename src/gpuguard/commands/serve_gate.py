"""``gpuguard serve-gate``: the warm gate server, one forked child per request on its socket."""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import sys
from typing import TYPE_CHECKING

import gpuguard
from gpuguard.adapters import dropin, gaterequest, gateserver, nvml
from gpuguard.adapters.configfile import config_path
from gpuguard.commands.arguments import from_request
from gpuguard.config import ConfigError, load_settings
from gpuguard.core.exits import EX_OSERR

# A request never runs the daemon; the entry point's module would run gpuguard on import.
_NEVER_REQUESTED = ("gpuguard.daemon.", "gpuguard.__main__")

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Protocol, TextIO

    from gpuguard.commands.arguments import CommandArgs
    from gpuguard.core.gate.auth import Caller
    from gpuguard.core.gate.proto import Request as GateRequest

    class Execute(Protocol):
        """The command line's own dispatch (cli._execute)."""

        def __call__(
            self, config: Path | None, command: CommandArgs, caller: Caller | None, *, as_json: bool
        ) -> int:
            """Run ``command`` in this process for ``caller``; its exit status."""


def run(config: Path | None, execute: Execute) -> int:
    """Serve the socket gpuguard-gate.socket passed until SIGTERM.

    ``config``: --config. ``execute`` is the command line's own dispatch: a request runs as the
    same command would, with the arguments ``from_request`` makes of it.
    Everything a request needs is imported here, once, before the first fork, so a request
    pays for none of it; NVML itself is initialised only in each request's own process.
    """
    try:
        listener = gateserver.take_listener(os.environ)
    except gateserver.ActivationError as err:
        sys.stderr.write(f"gpuguard serve-gate: {err}: run by gpuguard-gate.socket only\n")
        return EX_OSERR  # not started the way gpuguard-gate.socket starts it
    _import_request_path()
    nvml.import_bindings()

    def handle(request: GateRequest, caller: Caller, out: TextIO, err: TextIO) -> int:
        work = from_request(request)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return execute(config, work, caller, as_json=request.json)

    watched = Watched(config)
    with listener:
        return gateserver.serve_forever(
            listener,
            lambda conn, pidfd: gaterequest.serve(
                conn, handle, sys.stderr, watched=watched, pinned=pidfd
            ),
            sys.stderr,
            who=lambda pid, uid: gateserver.classify(pid, uid, watched),
        )


class Watched:
    """Which units gpuguard watches: named in the configuration, or with its gate drop-in.

    Only a watched unit's processes are served (docs/security.md). The configured names are
    read again only when the file changes (its inode, size and modification time), so a
    flood of connections costs a stat() each, not a validation.
    """

    def __init__(self, config: Path | None) -> None:
        """Watch what ``config`` (None: the default file) names; nothing is read yet."""
        self._config = config
        self._stamp: tuple[int, int, int] | None = None
        self._units: frozenset[str] = frozenset()
        self._loaded = False

    def __call__(self, unit: str) -> bool:
        """Whether ``unit`` is watched."""
        return unit in self._configured() or dropin.installed(unit)

    def _configured(self) -> frozenset[str]:
        path, _ = config_path(self._config)
        try:
            info = path.stat()
            stamp: tuple[int, int, int] | None = (info.st_ino, info.st_size, info.st_mtime_ns)
        except OSError:
            stamp = None
        if not self._loaded or stamp != self._stamp:
            try:
                self._units = frozenset(load_settings(self._config).units)
            except ConfigError:
                self._units = frozenset()  # an invalid configuration watches nothing
            self._stamp, self._loaded = stamp, True
        return self._units


def _import_request_path() -> None:
    """Import, once, in the parent, every module a request could reach, found from the package.

    That is all of gpuguard but the daemon (``gpuguard run``: no command imports it, an
    import-linter contract) and the ``-m`` entry point; walking the package cannot miss a module
    a command gains, as a hand-kept list of them did. What a module imports from outside only
    on first use stays lazy (structlog, once something is logged) except NVML's bindings,
    which every request uses (``nvml.import_bindings``).
    tests/integration/test_gate_socket.py fails when a request still imports a module itself.
    """
    for module in pkgutil.walk_packages(gpuguard.__path__, "gpuguard."):
        if not module.name.startswith(_NEVER_REQUESTED):
            importlib.import_module(module.name)
