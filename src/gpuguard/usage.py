"""The argparse parser gpuguard's command line is built with, and the options commands share.

Usage errors exit 64 (sysexits.h EX_USAGE), not argparse's 2: gpuguard.service's
``RestartPreventExitStatus=64 78`` keeps systemd from restarting a daemon whose command line is
wrong, and the man page documents 64 for every command. Global options are also accepted after
the command (``gpuguard status --config FILE``), as operators type them.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gpuguard.adapters.configfile import CONFIG_ENV, DEFAULT_CONFIG_PATH
from gpuguard.core.exits import EX_USAGE
from gpuguard.core.gate.proto import MAX_TIMEOUT_S

if TYPE_CHECKING:
    from gpuguard.core.since import Since


class UsageParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors exit 64; subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and the error, then exit 64 instead of argparse's 2."""
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def add_global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """Add the options every command accepts, before the command or (``after_command``) after.

    After the command the default is SUPPRESS, so an option given before it is not reset.
    """
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=argparse.SUPPRESS if after_command else None,
        help=f"configuration file (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})",
    )


def timeout_seconds(text: str) -> float:
    """A ``--timeout`` value: seconds from 0 to MAX_TIMEOUT_S, else a usage error (exit 64).

    The same range the gate server accepts, so a request is never refused for what the
    command line let through; an in-process wait is bounded the same way.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_TIMEOUT_S:  # also NaN, which no comparison admits
        message = f"must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, not {text!r}"
        raise argparse.ArgumentTypeError(message)
    return value


def add_force_option(command: argparse.ArgumentParser) -> None:
    """--force: go ahead for a unit neither configured, gated nor known to systemd."""
    command.add_argument(
        "--force",
        action="store_true",
        help="go ahead for a --unit that is neither configured, gated nor known to systemd "
        "(refused with exit 64 otherwise, a typo being likelier); as root it runs in this "
        "process, the gate server takes no --force",
    )


def watch_interval(text: str) -> float:
    """The --watch type: 0.1 to 86400 seconds (watchframe.interval), else a usage error."""
    from gpuguard.core.watchframe import interval  # noqa: PLC0415 - only with --watch

    try:
        return interval(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def since_argument(text: str) -> Since:
    """The --since type: since.parse_since, where a bad window is a usage error naming the forms."""
    from gpuguard.core.since import parse_since  # noqa: PLC0415 - only when --since is given

    try:
        return parse_since(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_scope_option(parser: argparse.ArgumentParser) -> None:
    """--scope: how far the gate's and reap's reaping may reach."""
    parser.add_argument(
        "--scope",
        choices=("unit", "patterns", "all"),
        default="unit",
        help="how far reaping may reach (default: unit)",
    )
