"""Command line: parse arguments, gather, hand the result to a renderer, exit with its status."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard import __version__
from gpuguard.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, ConfigError, Settings, load_settings

if TYPE_CHECKING:
    from collections.abc import Sequence

EX_USAGE = 64

_DESCRIPTION = """\
gpuguard keeps GPU inference services (SGLang, vLLM) out of restart loops caused by
processes that still hold GPU memory after the service stopped. It finds who holds each
GPU (NVML plus a scan of /dev/nvidia* file descriptors in /proc), attributes every holder
to its systemd unit or container, and explains what it sees.
"""

_STATUS_HELP = """\
Show every GPU with its memory and the processes holding it (PID, state, unit or
container, MiB, command line with secrets redacted), memory that no visible process
explains, and NVML's health.

Exit status (monitoring-plugin convention):
  0 OK        GPUs idle, or held only by live processes
  1 WARNING   something needs a look (a left-over of a watched unit, a zombie holder,
              NVML partly unusable but /proc shows holders)
  2 CRITICAL  a lost GPU, memory no visible process explains, a holder stuck in
              state D, NVML not answering
  3 UNKNOWN   NVML unavailable and no evidence in /proc
 78           the configuration file is invalid

Runs without root; it then shows what it can see and says what it cannot.
"""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; every subcommand's --help stands alone."""
    parser = argparse.ArgumentParser(
        prog="gpuguard",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Configuration: --config, else ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} "
        "(optional; every key has a default). Documentation: /usr/share/doc/gpuguard/ "
        "and docs/ in the source tree.",
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"configuration file (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    status = commands.add_parser(
        "status",
        help="show GPUs, who holds them and whether that is healthy",
        description=_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_argument(
        "--json",
        action="store_true",
        help="print a versioned JSON document (schema_version) instead of text",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpuguard`` command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EX_USAGE
    try:
        settings = load_settings(args.config)
    except ConfigError as err:
        sys.stderr.write(f"gpuguard: invalid configuration: {err}\n")
        return err.exit_code
    return _status(settings, as_json=args.json)


def _status(settings: Settings, *, as_json: bool) -> int:
    # Imported per command so `gpuguard --help` and future fast paths stay light.
    from gpuguard import inventory, status  # noqa: PLC0415

    report = status.assess(
        inventory.gather(settings),
        status.StatusContext(
            watched_units={name: unit.patterns for name, unit in settings.units.items()},
            protected_names=settings.protected_processes,
            idle_threshold_bytes=settings.idle_threshold_mib * 1024 * 1024,
            as_root=os.geteuid() == 0,
        ),
        datetime.now(UTC),
    )
    if as_json:
        sys.stdout.write(json.dumps(status.to_json(report), indent=2) + "\n")
    else:
        sys.stdout.write(status.render_text(report))
    return int(report.level)
