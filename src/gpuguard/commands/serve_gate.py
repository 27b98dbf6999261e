"""``gpuguard serve-gate``: answer one request on the connection the gate socket accepted."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from gpuguard.commands.reap import REAP_TIMEOUT_S

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TextIO

    from gpuguard.core.gateauth import Caller
    from gpuguard.core.gateproto import Request as GateRequest


def run(args: argparse.Namespace, execute: Callable[[argparse.Namespace, Caller], int]) -> int:
    """Answer one request on standard input, the connection gpuguard-gate.socket accepted.

    ``execute`` is the command line's own dispatch: the request runs as the same command would.
    """
    import contextlib  # noqa: PLC0415 - see the package doc
    import socket  # noqa: PLC0415

    from gpuguard.adapters import gateserver  # noqa: PLC0415

    def handle(request: GateRequest, caller: Caller, out: TextIO, err: TextIO) -> int:
        work = argparse.Namespace(
            config=args.config,
            command=request.command,
            unit=request.unit,
            scope=request.scope,
            grace=request.grace,
            timeout=REAP_TIMEOUT_S
            if request.timeout is None and request.command == "reap"
            else request.timeout,
            json=request.json,
            yes=True,
            dry_run=False,
        )
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return execute(work, caller)

    with socket.socket(fileno=0) as conn:  # StandardInput=socket: the accepted connection
        return gateserver.serve(conn, handle, sys.stderr)
