"""``gpuguard serve-gate``: the warm gate server, one forked child per request on its socket."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from gpuguard.commands.arguments import from_request
from gpuguard.core.exits import EX_OSERR

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Protocol, TextIO

    from gpuguard.commands.arguments import CommandArgs
    from gpuguard.core.gateauth import Caller
    from gpuguard.core.gateproto import Request as GateRequest

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
    import contextlib  # noqa: PLC0415 - see the package doc
    import os  # noqa: PLC0415

    from gpuguard.adapters import gaterequest, gateserver, nvml  # noqa: PLC0415

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
        from gpuguard.adapters import dropin  # noqa: PLC0415 - see the package doc

        return unit in self._configured() or dropin.installed(unit)

    def _configured(self) -> frozenset[str]:
        from gpuguard.adapters.configfile import config_path  # noqa: PLC0415
        from gpuguard.config import ConfigError, load_settings  # noqa: PLC0415

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
    """Import what the gate and the reap import only when they run, once, in the parent.

    tests/integration/test_gate_socket.py fails when a request still imports a module of its
    own (the list has gone stale).
    """
    from gpuguard import config  # noqa: PLC0415, F401 - pydantic: the full path's settings
    from gpuguard.adapters import (  # noqa: PLC0415, F401
        containerprobe,
        containerstop,
        daemonsnapshot,
        dropin,
        engineapi,
        inventory,
        ledgerstore,
        logs,
        reaper,
        releaselog,
        state,
        systemd,
        unitenv,
    )
    from gpuguard.commands import gate, reap  # noqa: PLC0415, F401
    from gpuguard.core import (  # noqa: PLC0415, F401
        baseline,
        containment,
        events,
        gpuset,
        health,
        idle,
        policy,
        protection,
        records,
        redaction,
        release,
        since,
        snapshot,
        unitconfig,
        xid,
        xidevents,
        xidfaults,
        xidstuck,
    )
    from gpuguard.core import gate as gate_core  # noqa: PLC0415, F401
    from gpuguard.core import inventory as inventory_core  # noqa: PLC0415, F401
