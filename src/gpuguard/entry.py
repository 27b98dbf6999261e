"""The ``gpuguard`` command's entry point: the gate client's fast lane, every other use to cli.

The drop-in runs ``gpuguard gate --unit UNIT`` unprivileged before every start of the watched
unit, and all it does there is send one request to the root gate server and relay the answer.
Building the whole command line (argparse and every command's help, the configuration module,
dataclasses) costs more than the request itself, so the exact forms a drop-in writes are
recognised here, with the standard library's socket support and the wire format only. Anything
else - another command, another spelling, a value that looks like an option, --help, no socket,
a server that cannot be reached - goes to ``gpuguard.cli``, which decides it the full way (for an
unreachable server that means asking once more, then its ``gate_unreachable`` verdict).
"""

from __future__ import annotations

import os
import sys

from gpuguard.core.gate.proto import SCOPES, SOCKET_PATH

# The options `gate` takes, each as `--name VALUE`; --config may come before or after `gate`.
_OPTIONS = frozenset({"--unit", "--scope", "--grace", "--timeout", "--socket", "--config"})


def main() -> int:
    """Run ``gpuguard``; returns the exit status."""
    code = _gate_client(sys.argv[1:])
    if code is not None:
        return code
    from gpuguard.cli import main as full  # noqa: PLC0415 - only when the fast lane is no use

    return full()


def gate_options(argv: list[str]) -> dict[str, str] | None:
    """The options of ``[--config F] gate --unit U [--scope S] [--grace N] [--timeout N] ...``.

    None for anything else, including what argparse would reject or read differently (a value
    starting with '-', an abbreviation, ``--opt=value``, an unknown scope, a number float()
    refuses); the full parser then handles it. A repeated option: the last one wins, as there.
    """
    options: dict[str, str] = {}
    command_seen = False
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "gate" and not command_seen:
            command_seen = True
            index += 1
            continue
        if word not in _OPTIONS or index + 1 >= len(argv):
            return None
        value = argv[index + 1]
        if value.startswith("-") or (not command_seen and word != "--config"):
            return None
        options[word] = value
        index += 2
    if not command_seen or "--unit" not in options:
        return None
    if options.get("--scope", "unit") not in SCOPES:
        return None
    for number in ("--grace", "--timeout"):
        if number in options:
            try:
                float(options[number])
            except ValueError:
                return None
    return options


def _gate_client(argv: list[str]) -> int | None:
    """Ask the gate server when argv is a plain gate request and its socket answers."""
    options = gate_options(argv)
    if options is None:
        return None
    path = options.get("--socket", SOCKET_PATH)
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None  # no server: cli runs it here as root, or refuses
    except OSError:
        pass  # not ours to look at: connecting says why
    from gpuguard.adapters import gateclient  # noqa: PLC0415 - after the cheap checks
    from gpuguard.core.gate.proto import Request  # noqa: PLC0415

    grace, timeout = options.get("--grace"), options.get("--timeout")
    request = Request(
        command="gate",
        unit=options["--unit"],
        scope=options.get("--scope", "unit"),
        grace=None if grace is None else float(grace),
        timeout=None if timeout is None else float(timeout),
    )
    try:
        return gateclient.ask(request, path, sys.stdout, sys.stderr)
    except gateclient.UnreachableError:
        return None
