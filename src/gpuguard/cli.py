"""Command line: parse arguments, run the command, render its typed result, exit with its status.

Heavy modules (pydantic through the config, structlog, pynvml) are imported only by the
commands that need them, so ``--help`` is instant and the gate's fast path stays light.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from gpuguard import __version__, clihelp
from gpuguard.commands.arguments import (
    REAP_TIMEOUT_S,
    BreakerArgs,
    CommandArgs,
    DoctorArgs,
    ExplainArgs,
    GateArgs,
    InstallGateArgs,
    ReapArgs,
    RunArgs,
    StatusArgs,
    to_request,
)
from gpuguard.core.exits import EX_USAGE
from gpuguard.core.gate.proto import SOCKET_PATH as GATE_SOCKET
from gpuguard.usage import (
    UsageParser,
    add_force_option,
    add_global_options,
    add_scope_option,
    since_argument,
    timeout_seconds,
    watch_interval,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from gpuguard.commands.output import Report
    from gpuguard.config import Settings
    from gpuguard.core.gate.auth import Caller
    from gpuguard.core.values import NvmlReading


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; every subcommand's --help stands alone."""
    parser = UsageParser(
        prog="gpuguard",
        usage="%(prog)s [-h] [--version] [--config FILE] COMMAND ...",
        description=clihelp.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=clihelp.EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    add_global_options(parser, after_command=False)
    # The description lists the commands, each with a line; argparse's list would repeat them.
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", help=argparse.SUPPRESS, prog="gpuguard"
    )
    raw = argparse.RawDescriptionHelpFormatter

    status = commands.add_parser("status", description=clihelp.STATUS, formatter_class=raw)
    status.add_argument("--json", action="store_true", help="print a versioned JSON document")
    status.add_argument(
        "--prometheus",
        action="store_true",
        help="print the daemon's metrics in Prometheus' text format, drawn now (gpuguard(8))",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=watch_interval,
        metavar="SECONDS",
        help="redraw in place every SECONDS (default 2) until Ctrl-C; needs a terminal",
    )
    status.add_argument(
        "--since",
        type=since_argument,
        metavar="WHEN",
        help="history from WHEN on: 30m, 1h, 2d (ago), or an ISO time (default: all kept)",
    )
    explain = commands.add_parser(
        "explain",
        description=clihelp.EXPLAIN,
        formatter_class=raw,
    )
    explain.add_argument("--unit", help="the unit (default: the one watched unit)")
    explain.add_argument(
        "--since",
        help="where to start, in journalctl's forms: 'today', '2026-12-01 05:00', "
        "--since=-2h (default: this boot)",
    )
    explain.add_argument("--json", action="store_true", help="print a versioned JSON document")

    reap = commands.add_parser("reap", description=clihelp.REAP, formatter_class=raw)
    reap.add_argument("--unit", help="watched unit (default: the only one configured)")
    add_scope_option(reap)
    reap.add_argument("--dry-run", action="store_true", help="print the plan, signal nothing")
    reap.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    reap.add_argument("--json", action="store_true", help="print the plan and result as JSON")
    reap.add_argument("--grace", type=float, metavar="S", help="seconds from SIGTERM to SIGKILL")
    reap.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=REAP_TIMEOUT_S,
        metavar="S",
        help="wait at most S seconds, 0-3600, for the GPUs to become idle afterwards, then exit 1 "
        "if they are not (default 60; a unit's own request waits at most gate_timeout_s; "
        "outside 0-3600: exit 64)",
    )

    gate = commands.add_parser("gate", description=clihelp.GATE, formatter_class=raw)
    gate.add_argument("--unit", required=True, help="the unit this gate guards")
    add_scope_option(gate)
    gate.add_argument("--grace", type=float, metavar="S", help="seconds from SIGTERM to SIGKILL")
    gate.add_argument(
        "--timeout", type=float, metavar="S", help="give up after S seconds (config gate_timeout_s)"
    )
    add_force_option(reap)
    add_force_option(gate)
    for command in (gate, reap):
        command.epilog = clihelp.PRIVILEGES
        command.add_argument(
            "--socket",
            default=GATE_SOCKET,
            metavar="PATH",
            help=f"the gate server's socket (default {GATE_SOCKET}; see 'Privileges' below)",
        )
    commands.add_parser(
        "serve-gate",
        description=clihelp.SERVE_GATE,
        formatter_class=raw,
    )
    commands.add_parser(
        "run",
        description=clihelp.RUN,
        formatter_class=raw,
    )
    doctor = commands.add_parser(
        "doctor",
        description=clihelp.DOCTOR,
        formatter_class=raw,
    )
    doctor.add_argument("--unit", help="one unit (default: every watched unit)")
    add_force_option(doctor)
    doctor.add_argument("--json", action="store_true", help="print a versioned JSON document")
    doctor.add_argument(
        "--fix", action="store_true", help="print a drop-in that fixes the findings"
    )
    breaker = commands.add_parser("breaker", description=clihelp.BREAKER, formatter_class=raw)
    breaker.add_argument(
        "--close",
        action="store_true",
        help="close the open breaker, after checking the host (root)",
    )
    for name, text in (
        ("install-gate", clihelp.INSTALL_GATE),
        ("remove-gate", clihelp.REMOVE_GATE),
    ):
        command = commands.add_parser(name, description=text, formatter_class=raw)
        command.add_argument("--unit", required=True, help="the unit, e.g. sglang.service")
        if name == "install-gate":
            command.add_argument(
                "--force",
                action="store_true",
                help="install even when systemd does not know the unit (or cannot be asked)",
            )
    for command in commands.choices.values():
        add_global_options(command, after_command=True)
        command.set_defaults(command_parser=command)  # whose usage an unknown option prints
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpuguard`` command; returns the process exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would print the top-level usage for `reap --bogus`
        owner: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return EX_USAGE
    if args.command == "serve-gate":
        from gpuguard.commands import serve_gate  # noqa: PLC0415 - see module doc

        return serve_gate.run(args.config, _execute)
    command = _typed(args)
    # --force is root's own decision: the server takes none, so root runs it in this process.
    request = None
    if isinstance(command, GateArgs | ReapArgs) and not (command.force and os.geteuid() == 0):
        request = to_request(command)
    if request is not None:
        from gpuguard.commands import relay  # noqa: PLC0415 - see module doc
        from gpuguard.commands.output import render, say  # noqa: PLC0415 - see module doc

        asked = relay.ask_gate_server(request, args.socket, args.config, say)
        if asked is not None:
            return render(asked)
    return _execute(args.config, command, None, as_json=getattr(args, "json", False))


def _typed(args: argparse.Namespace) -> CommandArgs:  # noqa: PLR0911 - one per command
    """The parsed command line as its command's typed arguments (commands/arguments.py)."""
    match args.command:
        case "status":
            return StatusArgs(args.prometheus, args.watch, args.since)
        case "explain":
            return ExplainArgs(args.unit, args.since)
        case "gate":
            return GateArgs(args.unit, args.scope, args.grace, args.timeout, force=args.force)
        case "reap":
            return ReapArgs(
                args.unit,
                args.scope,
                args.grace,
                args.timeout,
                json=args.json,
                dry_run=args.dry_run,
                yes=args.yes,
                force=args.force,
            )
        case "run":
            return RunArgs()
        case "breaker":
            return BreakerArgs(args.close)
        case "install-gate" | "remove-gate":
            install = args.command == "install-gate"
            return InstallGateArgs(args.unit, install, force=install and args.force)
        case _:
            return DoctorArgs(args.unit, args.fix, args.force)


def _execute(
    config: Path | None, command: CommandArgs, caller: Caller | None, *, as_json: bool
) -> int:
    """Run a command in this process; ``caller`` is who asked the gate server (None: we did)."""
    from gpuguard.commands.output import render  # noqa: PLC0415 - see module doc

    reading = None
    if isinstance(command, GateArgs):
        from gpuguard.commands import gate  # noqa: PLC0415 - see module doc

        fast, reading = gate.fast_path(config, command, caller)
        if fast is not None:
            return render(fast)
    from gpuguard.config import ConfigError, load_settings, warnings  # noqa: PLC0415

    try:
        settings = load_settings(config)
    except ConfigError as err:
        sys.stderr.write(f"gpuguard: invalid configuration: {err}\n")
        return err.exit_code
    from gpuguard.adapters.configfile import config_path  # noqa: PLC0415 - see module doc

    for warning in warnings(settings):
        sys.stderr.write(f"gpuguard: warning: {config_path(config)[0]}: {warning}\n")
    return render(_dispatch(settings, command, reading, caller, config), as_json=as_json)


def _no_config_file(config: Path | None) -> bool:
    """Whether gpuguard runs on its defaults: no --config, no GPUGUARD_CONFIG, no default file."""
    from gpuguard.adapters.configfile import config_path  # noqa: PLC0415 - see module doc

    path, explicit = config_path(config)
    return not explicit and not path.exists()


def _dispatch(  # noqa: PLR0911 - one return per command
    settings: Settings,
    command: CommandArgs,
    reading: NvmlReading | None,
    caller: Caller | None,
    config: Path | None = None,
) -> Report:
    """Hand the typed command to its module, imported only now (see the module doc)."""
    from gpuguard.commands.output import Said, ask_on_terminal, say  # noqa: PLC0415

    match command:
        case StatusArgs():
            from gpuguard.commands import status  # noqa: PLC0415

            if command.prometheus:
                return status.prometheus(settings)
            return status.run(
                settings,
                watch=command.watch,
                since=command.since,
                no_config_file=_no_config_file(config),
            )
        case ExplainArgs():
            from gpuguard.commands import explain  # noqa: PLC0415

            return explain.run(settings, command.unit, command.since)
        case GateArgs():
            from gpuguard.commands import gate  # noqa: PLC0415

            return gate.run(settings, command, reading, caller, say)
        case RunArgs():
            from gpuguard.daemon import wiring  # noqa: PLC0415

            return Said(wiring.run(settings))
        case ReapArgs():
            from gpuguard.commands import reap  # noqa: PLC0415

            return reap.run(settings, command, caller, show=sys.stdout.write, ask=ask_on_terminal)
        case InstallGateArgs():
            from gpuguard.commands import install_gate  # noqa: PLC0415

            return install_gate.run(command.unit, install=command.install, force=command.force)
        case DoctorArgs():
            from gpuguard.commands import doctor  # noqa: PLC0415

            return doctor.run(settings, command)
        case BreakerArgs():
            from gpuguard.commands import breaker  # noqa: PLC0415

            return breaker.run(settings, close_it=command.close)
