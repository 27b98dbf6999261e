"""Command line: parse arguments, gather, hand the result to a renderer, exit with its status.

Heavy modules (pydantic through the config, structlog, pynvml) are imported only by the
commands that need them, so ``--help`` is instant and the gate's fast path stays light.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard import __version__
from gpuguard.adapters.configfile import CONFIG_ENV, DEFAULT_CONFIG_PATH
from gpuguard.core.escaping import escape
from gpuguard.core.gateproto import SOCKET_PATH as GATE_SOCKET

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import TextIO

    from gpuguard.adapters.systemd import UnitState
    from gpuguard.config import Settings, UnitSettings
    from gpuguard.core.gate import GateOutcome
    from gpuguard.core.gateauth import Caller
    from gpuguard.core.gateproto import Request as GateRequest
    from gpuguard.core.gpuset import GpuSet
    from gpuguard.core.holders import Inventory
    from gpuguard.core.policy import KillPlan, PlanRequest
    from gpuguard.core.status import DaemonView
    from gpuguard.core.values import NvmlReading, ReapResult, ReapTarget, UnitProvenance

EX_USAGE = 64
EX_NOPERM = 77  # sysexits.h: the command needs a permission this user lacks (root)
_REAP_TIMEOUT_S = 60.0

# The gate's verdict is one journal entry; journald splits lines longer than LineMax (48K).
_GATE_LINE_LIMIT = 8192
_DESCRIPTION = """\
gpuguard keeps GPU inference services (SGLang, vLLM) out of restart loops caused by
processes that still hold GPU memory after the service stopped. It finds who holds each
GPU (NVML plus a scan of /dev/nvidia* file descriptors in /proc), attributes every holder
to its systemd unit or container, reaps only the stale ones, and explains what it sees.

commands:
  status   show GPUs, who holds them and whether that is healthy
  reap     the surgical replacement for `kill -9 <every python>; fuser -k /dev/nvidia*`
  gate     ExecStartPre= of a watched unit: wait until its GPUs are idle before it starts
  run      the watchdog daemon: detect restart loops in the journal and recover them
  doctor   audit a unit's settings against its journal; print the drop-in that fixes them
  install-gate / remove-gate
           add or remove the gate drop-in of a unit (never done without being asked)
  serve-gate
           internal: the root side of gate and reap, run by gpuguard-gate.socket
"""

_PRIVILEGES = f"""\
Privileges: in the drop-in this command runs unprivileged, in the unit's environment, and
only asks the root gate server (gpuguard-gate.socket, {GATE_SOCKET}), which identifies
the caller from the kernel and does the work. A process may ask only for its own unit
(and only scope "unit"); root outside any service may ask for any. Without a socket at
--socket, root runs the work in this process (a developer's install); anyone else, or a
socket nobody answers, gets one line and exit 1 - for the gate, unless the configuration
says gate_unreachable = "allow". See docs/security.md.
"""

_STATUS_HELP = """\
Show every GPU with its memory and the processes holding it (PID, state, unit or
container, MiB, command line with secrets redacted), memory that no visible process
explains, NVML's health, and for each watched unit its GPU set and last gate decisions.

Exit status (monitoring-plugin convention):
  0 OK        GPUs idle, or held only by live processes
  1 WARNING   something needs a look (a left-over of a watched unit, a zombie holder,
              a watched unit systemd does not know, NVML partly unusable but /proc
              shows holders, a GPU health warning, a recent kernel Xid after which
              no kill helps)
  2 CRITICAL  a lost GPU, a GPU that needs a reset or reboot (NVML health: a pending
              row remap or page retirement, the driver asks for it), memory no
              visible process explains, a holder stuck in state D in the NVIDIA
              driver, NVML not answering
  3 UNKNOWN   NVML unavailable and no evidence in /proc
 78           the configuration file is invalid

Runs without root; it then shows what it can see and says what it cannot: another
user's job is "not inspectable without root", never reported as vanished. With the v1
memory API (drivers older than 515) the driver's reserved memory is estimated
(v1_reserved_mib, else learned as root from idle GPUs) and the figures say so.
"""

_REAP_HELP = """\
Find the stale holders of a watched unit's GPUs and kill exactly those: SIGTERM, a grace
period, then SIGKILL, through pidfds so a reused PID is never hit. Shows the plan first -
who will be signalled and why, who is spared and why - and asks on a terminal unless
--yes. Then waits until the unit's GPUs are idle and prints their memory.

Scopes:
  unit      (default) processes in the unit's cgroup that do not belong to its running
            invocation, plus processes outside it proven to come from an ended run of the
            unit (their INVOCATION_ID names one, and they run as the unit's User=); a
            command line matching the patterns is no proof. Nothing in the cgroup is
            reaped while systemd cannot say whether the unit runs
  patterns  also any holder whose command line matches the unit's patterns
  all       every holder that is not protected: the old `fuser -k`, opt-in only

Never signalled, whatever the scope: PID 1 and 2, kernel threads, gpuguard and its
ancestors, protected processes (nvidia-persistenced, DCGM, nvidia-smi, display servers,
anything in protected_processes), and holders only of GPUs outside the unit's set.

With --yes and --unit (and without --dry-run) the reap goes through the gate server; a
plan that asks for confirmation on a terminal, and --dry-run, run in this process.

Exit status: 0 the GPUs are idle; 1 they are not (or the plan was declined, or the request
was refused or could not be sent); 64 usage; 78 invalid configuration.
"""

_GATE_HELP = """\
Run as ExecStartPre= of a watched unit (see `systemd/gpuguard-gate.conf`): exit 0 at once
when every GPU of the unit's set is idle; otherwise reap the stale holders of those GPUs
(at this point everything in the unit's cgroup but the gate itself is left over from an
earlier run), wait until the GPUs are idle, then exit 0. While it waits it prints one line
per blocker every 10 s (who holds what). On timeout it exits 1 with one message naming who
still holds what and why gpuguard would not touch it; Restart= then tries again until the
unit's start limit ends the tries (`gpuguard doctor` says whether it ever does). When
waiting cannot help - NVML unavailable or not answering, a GPU of the set lost, absent or
needing a reset (NVML health) - it refuses at once, in one line with the reason. Each
decision is recorded and shown by `gpuguard status`.

The unit's GPU set is its `gpus` in the config, else CUDA_VISIBLE_DEVICES from the unit's
real environment (read by root from the calling process: EnvironmentFile= values count),
else all GPUs. Keep the unit's TimeoutStartSec above --timeout.

Exit status: 0 start allowed; 1 GPUs still busy at the timeout, refused at once, the
request refused, or the gate server unreachable; 78 invalid configuration.
"""

_SERVE_GATE_HELP = """\
Internal: not for operators to run. gpuguard-gate@.service runs it, as root with a clean
environment, for each connection to gpuguard-gate.socket (/run/gpuguard/gate.sock); its
standard input is the connection. It reads one request line (at most 4 KiB, within 10 s),
identifies the caller (SO_PEERCRED, a pidfd, /proc/PID/cgroup and environ), refuses a
request for any unit but the caller's own (except from root outside any service), runs the
gate or reap and streams its output back, then the exit status. One line per request goes
to its own journal.

Exit status: the request's verdict; 1 refused; 64 a malformed request.
"""


_RUN_HELP = """\
The watchdog daemon, run by systemd as gpuguard.service (Type=notify). It follows the
journal of every watched unit (journalctl, systemd's own trusted messages only), detects
restart loops - several failed starts inside a window, a high restart counter, a left-over
process at start - and works out whether stale GPU holders cause them. When a run ends
(its main process exits, its stop times out), the processes of that run that still hold the
unit's GPUs (its INVOCATION_ID, in the cgroup or out) are reaped at once, before systemd's
next start; survivors of a run stopped on purpose are only reported unless
[daemon] reap_stopped_survivors = true. A loop with a GPU
cause is recovered: stop the unit, reap its stale holders (the same policy and reaper as the
gate), wait until its GPUs are idle, reset-failed, start. Recoveries back off; after
recovery_max_attempts that did not help the unit is marked "needs operator" (CRITICAL in
`gpuguard status`). Loops without a GPU cause are reported, never acted on. A unit stopped
by a stop job (an operator's `systemctl stop`) or inactive is never started. With
`[daemon] dry_run = true` it logs what it would do and does nothing.

History replayed at start rebuilds the detection window but is never acted on; time is the
journal's monotonic clock, never the wall. A recovery interrupted by its death is resumed
only in the same boot, soon after, with the unit still stopped. It logs JSON lines to stdout
(the journal), sends READY=1 after the first inventory and journal attach, WATCHDOG=1 from
its main loop and through each long step, and writes a snapshot to runtime_dir/daemon.json that
`gpuguard status` shows. SIGTERM stops it cleanly.

Exit status: 0 after SIGTERM; 78 invalid configuration.
"""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; every subcommand's --help stands alone."""
    parser = argparse.ArgumentParser(
        prog="gpuguard",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Configuration: --config, else ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} "
        "(optional; every key has a default). Documentation: docs/ in the source tree.",
    )
    parser.add_argument("--version", action="version", version=f"gpuguard {__version__}")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"configuration file (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    status = commands.add_parser(
        "status", help="show GPUs and their holders", description=_STATUS_HELP, formatter_class=raw
    )
    status.add_argument("--json", action="store_true", help="print a versioned JSON document")

    reap = commands.add_parser(
        "reap", help="kill stale GPU holders of a unit", description=_REAP_HELP, formatter_class=raw
    )
    reap.add_argument("--unit", help="watched unit (default: the only one configured)")
    _scope_argument(reap)
    reap.add_argument("--dry-run", action="store_true", help="print the plan, signal nothing")
    reap.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    reap.add_argument("--json", action="store_true", help="print the plan and result as JSON")
    reap.add_argument("--grace", type=float, metavar="S", help="seconds from SIGTERM to SIGKILL")
    reap.add_argument(
        "--timeout",
        type=float,
        default=_REAP_TIMEOUT_S,
        metavar="S",
        help="seconds to wait for the GPUs to become idle afterwards (default 60)",
    )

    gate = commands.add_parser(
        "gate", help="ExecStartPre= gate for a unit", description=_GATE_HELP, formatter_class=raw
    )
    gate.add_argument("--unit", required=True, help="the unit this gate guards")
    _scope_argument(gate)
    gate.add_argument("--grace", type=float, metavar="S", help="seconds from SIGTERM to SIGKILL")
    gate.add_argument(
        "--timeout", type=float, metavar="S", help="give up after S seconds (config gate_timeout_s)"
    )
    for command in (gate, reap):
        command.epilog = _PRIVILEGES
        command.add_argument(
            "--socket",
            default=GATE_SOCKET,
            metavar="PATH",
            help=f"the gate server's socket (default {GATE_SOCKET}; see 'Privileges' below)",
        )
    commands.add_parser(
        "serve-gate",
        help="internal: the root gate server (gpuguard-gate@.service)",
        description=_SERVE_GATE_HELP,
        formatter_class=raw,
    )
    commands.add_parser(
        "run",
        help="the watchdog daemon (gpuguard.service)",
        description=_RUN_HELP,
        formatter_class=raw,
    )
    doctor = commands.add_parser(
        "doctor",
        help="audit a unit's settings against its journal",
        description=_DOCTOR_HELP,
        formatter_class=raw,
    )
    doctor.add_argument("--unit", help="one unit (default: every watched unit)")
    doctor.add_argument("--json", action="store_true", help="print a versioned JSON document")
    doctor.add_argument(
        "--fix", action="store_true", help="print a drop-in that fixes the findings"
    )
    for name, text in (
        ("install-gate", _INSTALL_GATE_HELP),
        ("remove-gate", _REMOVE_GATE_HELP),
    ):
        command = commands.add_parser(
            name, help=text.splitlines()[0], description=text, formatter_class=raw
        )
        command.add_argument("--unit", required=True, help="the unit, e.g. sglang.service")
        if name == "install-gate":
            command.add_argument(
                "--force",
                action="store_true",
                help="install even when systemd does not know the unit (or cannot be asked)",
            )
    return parser


_INSTALL_GATE_HELP = """\
Install the gate drop-in for a unit (explicitly; gpuguard never does it by itself).
Writes /etc/systemd/system/UNIT.d/gpuguard-gate.conf - ExecStartPre= gate, ExecStopPost=
reap, TimeoutStartSec=600, KillMode=mixed, each line commented (see `gpuguard` docs/gate.md)
- and runs `systemctl daemon-reload`. It says that it replaces the unit's TimeoutStartSec=
and KillMode=; it leaves TimeoutStopSec= to the unit (`gpuguard doctor` proposes one).
The drop-in calls this gpuguard's path, unprivileged; it asks the gate server over
/run/gpuguard/gate.sock. A unit whose own sandbox would keep it from that socket
(RestrictAddressFamilies= without AF_UNIX, a SystemCallFilter= without socket/connect,
InaccessiblePaths= or TemporaryFileSystem= over /run, RootDirectory=, RootImage=) is refused
with the reason. A file there that gpuguard did not write, or that was edited since, is
left alone and the command fails. A unit systemd does not know (LoadState=not-found, a
typo?) is refused, as is one systemd cannot be asked about; --force installs anyway.
Needs root. Undo with `gpuguard remove-gate --unit UNIT`.

Exit status: 0 installed or already there; 1 refused or daemon-reload failed; 77 not root.
"""

_DOCTOR_HELP = """\
Audit a watched unit's effective settings (systemctl show, drop-ins included) against its
own history in the journal (systemd's trusted messages of the last 30 days), and say what to
change: a TimeoutStopSec= shorter than the observed drains (how many stops ended in SIGKILL,
the drain distribution, a timeout of p99 x 1.5), a KillMode= that leaves workers running and
the processes that survived stops, a Restart= policy whose loops the start limit never ends
(and what a loop costs per hour in model loads, including a refusing gate), the gate missing
or its timeout above TimeoutStartSec=, GPU sets shared with another watched unit, PATH,
LD_LIBRARY_PATH or EnvironmentFile= paths the service user can change, and
nvidia-persistenced not running. Every finding has its evidence and the drop-in lines that
fix it; --fix prints one complete drop-in to save by hand (doctor never changes anything).
Without --unit every watched unit in the configuration is audited.

Exit status: the worst finding - 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (systemd or the
journal could not be asked); 78 invalid configuration.
"""

_REMOVE_GATE_HELP = """\
Remove the gate drop-in that `gpuguard install-gate` wrote for a unit, then run
`systemctl daemon-reload`. Only a file that is byte for byte what install-gate wrote is
removed; an edited one is kept, and the command says so and fails. Any other file is left
alone. Needs root. The next start of the unit runs without the gate.

Exit status: 0 removed or not there; 1 kept or daemon-reload failed; 77 not root.
"""


def _scope_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scope",
        choices=("unit", "patterns", "all"),
        default="unit",
        help="how far reaping may reach (default: unit)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpuguard`` command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EX_USAGE
    if args.command == "serve-gate":
        return _serve_gate(args)
    signals_unasked = args.command == "reap" and args.yes and not args.dry_run and args.unit
    if args.command == "gate" or signals_unasked:
        asked = _ask_gate_server(args)
        if asked is not None:
            return asked
    return _execute(args, None)


def _execute(args: argparse.Namespace, caller: Caller | None) -> int:
    """Run a command in this process; ``caller`` is who asked the gate server (None: we did)."""
    reading = None
    if args.command == "gate":
        fast, reading = _gate_fast_path(args, caller)
        if fast is not None:
            return fast
    from gpuguard.config import ConfigError, load_settings, warnings  # noqa: PLC0415

    try:
        settings = load_settings(args.config)
    except ConfigError as err:
        sys.stderr.write(f"gpuguard: invalid configuration: {err}\n")
        return err.exit_code
    from gpuguard.adapters.configfile import config_path  # noqa: PLC0415 - see module doc

    for warning in warnings(settings):
        sys.stderr.write(f"gpuguard: warning: {config_path(args.config)[0]}: {warning}\n")
    commands: dict[str, Callable[[], int]] = {
        "status": lambda: _status(settings, as_json=args.json),
        "gate": lambda: _gate(settings, args, reading, caller),
        "run": lambda: _run(settings),
        "reap": lambda: _reap(settings, args, caller),
        "install-gate": lambda: _change_gate(args.unit, install=True, force=args.force),
        "remove-gate": lambda: _change_gate(args.unit, install=False),
        "doctor": lambda: _doctor(settings, args),
    }
    return commands[args.command]()


def _doctor(settings: Settings, args: argparse.Namespace) -> int:
    """Audit each unit; print findings, JSON or the fixing drop-in; exit with the worst level."""
    from gpuguard.adapters import doctorio, inventory  # noqa: PLC0415 - see module doc
    from gpuguard.core import doctor  # noqa: PLC0415 - see module doc

    units = [args.unit] if args.unit else list(settings.units)
    found = inventory.gather(settings)
    facts = {
        u: doctorio.gather_unit(u, settings, found)
        for u in dict.fromkeys([*units, *settings.units])
    }
    host = doctorio.host_facts(settings, found)
    results = {
        unit: doctor.diagnose(
            facts[unit], {o: f for o, f in facts.items() if o != unit and o in settings.units}, host
        )
        for unit in units
    }
    if args.json:
        sys.stdout.write(json.dumps(doctor.render_json(results), indent=2) + "\n")
    elif args.fix:
        sys.stdout.write("\n".join(doctor.render_fix(u, f) for u, f in results.items()))
    else:
        sys.stdout.write(doctor.render_text(results))
    return int(doctor.worst(f for findings in results.values() for f in findings))


def _ask_gate_server(args: argparse.Namespace) -> int | None:
    """Send a gate or reap to the root gate server; None: run it here instead (root, no server).

    The rule (docs/security.md): a socket at --socket means the packaged server, so always ask
    it; no socket and root means a developer's install, which runs in-process; no socket and
    not root, or a socket nobody answers, refuses - unless gate_unreachable = "allow".
    """
    from gpuguard.adapters import gateclient  # noqa: PLC0415 - see module doc
    from gpuguard.core.gateproto import Request  # noqa: PLC0415

    path = args.socket
    try:
        os.lstat(path)
        present = True
    except FileNotFoundError:
        present = False
    except OSError:
        present = True  # not ours to look at: connecting says why
    if not present:
        if os.geteuid() == 0:
            sys.stderr.write(f"gpuguard {args.command}: no gate server at {path}: runs here\n")
            return None
        reason = "no such socket"
    else:
        request = Request(
            command=args.command,
            unit=args.unit,
            scope=args.scope,
            grace=args.grace,
            timeout=args.timeout,
            json=bool(getattr(args, "json", False)),
        )
        try:
            return gateclient.ask(request, path, sys.stdout, sys.stderr)
        except gateclient.UnreachableError as err:
            reason = str(err)
    allowed = args.command == "gate" and _unreachable_allowed(args.config)
    verdict = (
        "start allowed without the gate (gate_unreachable = allow)"
        if allowed
        else ("start refused" if args.command == "gate" else "nothing reaped")
    )
    sys.stderr.write(
        f"gpuguard {args.command}: cannot reach the gate server at {path} ({reason}): {verdict}\n"
    )
    return 0 if allowed else 1


def _unreachable_allowed(cli_path: Path | None) -> bool:
    """Whether the operator's configuration lets a start proceed without the gate server.

    Read only from --config or the default path: the unit's environment (GPUGUARD_CONFIG)
    must not decide this. Anything unreadable or invalid means the default, refuse.
    """
    from gpuguard.adapters import configfile  # noqa: PLC0415 - see module doc

    path = cli_path or DEFAULT_CONFIG_PATH
    cached = configfile.load_validated(path)
    if cached is not None:
        return cached.get("gate_unreachable") == "allow"
    from gpuguard.config import ConfigError, load_settings  # noqa: PLC0415

    try:
        return load_settings(path).gate_unreachable == "allow"
    except ConfigError:
        return False


def _serve_gate(args: argparse.Namespace) -> int:
    """Answer one request on standard input, the connection gpuguard-gate.socket accepted."""
    import contextlib  # noqa: PLC0415 - see module doc
    import socket  # noqa: PLC0415

    from gpuguard.adapters import gateserver  # noqa: PLC0415

    def handle(request: GateRequest, caller: Caller, out: TextIO, err: TextIO) -> int:
        work = argparse.Namespace(
            config=args.config,
            command=request.command,
            unit=request.unit,
            scope=request.scope,
            grace=request.grace,
            timeout=_REAP_TIMEOUT_S
            if request.timeout is None and request.command == "reap"
            else request.timeout,
            json=request.json,
            yes=True,
            dry_run=False,
        )
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return _execute(work, caller)

    with socket.socket(fileno=0) as conn:  # StandardInput=socket: the accepted connection
        return gateserver.serve(conn, handle, sys.stderr)


def _change_gate(unit: str, *, install: bool, force: bool = False) -> int:
    """Install or remove the gate drop-in, then make systemd read it."""
    from gpuguard.adapters import dropin  # noqa: PLC0415 - see module doc

    command = "install-gate" if install else "remove-gate"
    refused = _gate_change_refused(command, unit, check_unit=install and not force)
    if refused is not None:
        return refused
    if install:
        refused = _sandbox_refused(unit, force=force)
        if refused is not None:
            return refused
    try:
        change = dropin.install(unit, _own_executable()) if install else dropin.remove(unit)
    except OSError as err:
        sys.stderr.write(f"gpuguard {command}: {err.filename}: {err.strerror}\n")
        return 1
    if change.refused:
        sys.stderr.write(f"gpuguard: {change.refused}\n")
        return 1
    sys.stdout.write(f"{change.path}: {change.action}\n")
    if change.action in {"installed", "removed"}:
        problem = dropin.daemon_reload()
        if problem:
            sys.stderr.write(f"gpuguard: {problem}\n")
            return 1
    if install:
        # Said out loud: these replace the unit's own values (docs/gate.md, "What it overrides").
        overrides = " and ".join(
            line
            for line in dropin.render().splitlines()
            if line and not line.startswith(("#", "[", "Exec"))
        )
        sys.stdout.write(
            f"it sets {overrides} for {unit}, replacing the unit's own; the stop timeout stays "
            f"the unit's: check it with gpuguard doctor --unit {unit}\n"
            f"undo with: gpuguard remove-gate --unit {unit}\n"
        )
    return 0


def _sandbox_refused(unit: str, *, force: bool) -> int | None:
    """Exit 1, saying why, when the unit's own sandbox would keep its gate from the socket."""
    from gpuguard.adapters import dropin, systemd  # noqa: PLC0415 - see module doc

    properties = systemd.show_properties(unit, dropin.SANDBOX_PROPERTIES)
    if isinstance(properties, str):
        if force:
            return None
        problems = [f"cannot check its sandbox: {properties}"]
    else:
        problems = dropin.sandbox_problems(properties, GATE_SOCKET)
    if not problems:
        return None
    sys.stderr.write(
        f"gpuguard install-gate: not installed: {unit}'s own sandbox would keep its gate from "
        f"the gate server ({GATE_SOCKET}), and every start would be refused:\n"
        + "".join(f"  {problem}\n" for problem in problems)
        + "Change the unit (a drop-in of your own), then run install-gate again.\n"
    )
    return 1


def _gate_change_refused(command: str, unit: str, *, check_unit: bool) -> int | None:
    """The exit status when the change must not be tried at all; None to go ahead."""
    from gpuguard.adapters import dropin, systemd  # noqa: PLC0415 - see module doc

    if not unit.endswith(".service"):
        sys.stderr.write(f"gpuguard: {unit!r} is not a service unit name such as sglang.service\n")
        return EX_USAGE
    if os.geteuid() != 0:
        sys.stderr.write(
            f"gpuguard {command}: needs root (it changes {dropin.SYSTEMD_DIR} and runs "
            "systemctl daemon-reload)\n"
        )
        return EX_NOPERM
    problem = _unit_missing(systemd.show_unit(unit)) if check_unit else None
    if problem:
        sys.stderr.write(f"gpuguard {command}: {problem}; --force installs it anyway\n")
        return 1
    return None


def _unit_missing(unit_state: UnitState) -> str | None:
    """Why a drop-in for this unit would guard nothing: systemd has no such unit, or cannot say."""
    if unit_state.error:
        return f"cannot ask systemd whether {unit_state.unit} exists ({unit_state.error})"
    if unit_state.not_found:
        return f"systemd has no unit {unit_state.unit} (LoadState=not-found; a typo?)"
    return None


def _own_executable() -> str:
    """The absolute path the drop-in should call: this gpuguard, else the packaged one."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "gpuguard":
        return str(argv0.absolute())
    found = shutil.which("gpuguard")
    return str(Path(found).resolve()) if found else "/usr/bin/gpuguard"


def _run(settings: Settings) -> int:
    """Wire the real adapters into the daemon and run it until SIGTERM."""
    import re  # noqa: PLC0415 - see module doc
    import signal  # noqa: PLC0415 - see module doc

    from gpuguard.adapters import (  # noqa: PLC0415
        inventory,
        journal,
        logs,
        notify,
        procfs,
        reaper,
        state,
        systemd,
        unitenv,
    )
    from gpuguard.core import events, xidevents  # noqa: PLC0415
    from gpuguard.daemon import loop as daemon  # noqa: PLC0415

    logs.configure_logging(json=True, stream=sys.stdout)
    log = logs.get_logger().bind(command="run")

    def write_snapshot(document: dict[str, Any]) -> None:
        try:
            state.write_json(settings.runtime_dir / "daemon.json", document)
        except OSError as err:
            log.warning("cannot write the status snapshot", error=str(err))

    def save_unit_state(unit: str, document: dict[str, Any]) -> None:
        try:
            state.write_json(
                daemon.unit_state_path(settings.state_dir, unit), document, durable=True
            )
        except OSError as err:
            log.warning("cannot save unit state", unit=unit, error=str(err))

    def load_unit_state(unit: str) -> dict[str, Any] | None:
        saved = state.read_json(daemon.unit_state_path(settings.state_dir, unit))
        return saved if isinstance(saved, dict) else None

    # A signal writes a byte here, so SIGTERM ends the loop's long idle wait at once.
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    follower = journal.JournalFollower(
        list(settings.units),
        settings.state_dir / "journal-cursor.json",
        output_patterns=events.GPU_OOM_PATTERNS if settings.daemon.watch_output else (),
        kernel_patterns=(re.escape(xidevents.MARKER),),
        replay_s=settings.daemon.loop_window_s,
        fields=events.FIELDS_READ,
    )
    ports = daemon.Ports(
        gather=lambda: inventory.gather(settings),
        show_unit=systemd.show_unit,
        control=systemd.control,
        reap=lambda targets: reaper.reap(targets, grace_s=settings.reap_grace_s, logger=log),
        notifier=notify.Notifier(),
        log=log,
        wall=time.time,
        monotonic=time.monotonic,
        sleep=time.sleep,
        write_snapshot=write_snapshot,
        load_unit_state=load_unit_state,
        save_unit_state=save_unit_state,
        untouchable=_untouchable(),
        provenance=systemd.provenance,
        boot_id=_boot_id(),
        identity=procfs.read_identity(os.getpid()),
        watchdog_interval_s=notify.watchdog_interval_s(),
        wakeup_fd=wake_read,
        gate_environment=lambda unit: unitenv.recorded(settings.runtime_dir, unit),
    )
    watchdog = daemon.Daemon(settings, follower, ports)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: watchdog.request_stop())
    signal.set_wakeup_fd(wake_write)
    return watchdog.run()


def _boot_id() -> str | None:
    """The current boot's ID: the daemon compares monotonic times only within one boot."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return text.replace("-", "") or None


def _status(settings: Settings, *, as_json: bool) -> int:
    from gpuguard.adapters import inventory, procfs, state, systemd, unitenv  # noqa: PLC0415
    from gpuguard.core import status  # noqa: PLC0415
    from gpuguard.core.gpuset import resolve_gpu_set  # noqa: PLC0415

    found = inventory.gather(settings)
    units = []
    for name, unit in settings.units.items():
        unit_state = systemd.show_unit(name)
        # The set the gate and the daemon use: the gate's record includes EnvironmentFile=.
        recorded = unitenv.recorded(settings.runtime_dir, name)
        environment = unit_state.environment if recorded is None else recorded
        gpu_set = resolve_gpu_set(unit.gpus, environment, found.nvml.gpus)
        units.append(
            status.UnitView(
                name=name,
                state=_unit_state_text(unit_state),
                not_found=unit_state.not_found,
                gpu_set=gpu_set.describe() + (f"; {gpu_set.note}" if gpu_set.note else ""),
                gate_decisions=tuple(state.gate_decisions(settings.runtime_dir, name)[-3:]),
            )
        )
    report = status.assess(
        found,
        status.StatusContext(
            watched_units={name: unit.patterns for name, unit in settings.units.items()},
            protected_names=settings.protected_processes,
            idle_threshold_bytes=settings.idle_threshold_mib * 1024 * 1024,
            as_root=os.geteuid() == 0,
            units=tuple(units),
            boot_time=procfs.boot_time(),
            clock_ticks=procfs.clock_ticks_per_second(),
            daemon=_daemon_view(settings),
        ),
        datetime.now(UTC),
    )
    if as_json:
        sys.stdout.write(json.dumps(status.to_json(report), indent=2) + "\n")
    else:
        sys.stdout.write(status.render_text(report))
    return int(report.level)


def _unit_state_text(unit_state: UnitState) -> str:
    """The unit's state in words; a unit systemd does not know is "not found", not "inactive"."""
    if unit_state.error:
        return f"state unknown ({unit_state.error})"
    if unit_state.not_found:
        return "not found (LoadState=not-found: systemd has no such unit)"
    return f"{unit_state.active_state} ({unit_state.sub_state})"


def _daemon_view(settings: Settings) -> DaemonView:
    """The daemon's snapshot and whether the process that wrote it still lives."""
    from gpuguard.adapters import procfs, state  # noqa: PLC0415 - see module doc
    from gpuguard.core.status import DaemonView  # noqa: PLC0415
    from gpuguard.core.values import ProcessIdentity  # noqa: PLC0415

    snapshot = state.read_json(settings.runtime_dir / "daemon.json")
    if not isinstance(snapshot, dict):
        return DaemonView("absent", {})
    if not snapshot.get("running"):
        return DaemonView("stopped", snapshot)
    pid, start = snapshot.get("pid"), snapshot.get("start_time")
    alive = (
        isinstance(pid, int)
        and isinstance(start, int)
        and procfs.read_identity(pid) == ProcessIdentity(pid, start)
    )
    return DaemonView("running" if alive else "dead", snapshot)


def _unit_settings(settings: Settings, unit: str) -> UnitSettings:
    from gpuguard.config import UnitSettings  # noqa: PLC0415 - see module doc

    return settings.units.get(unit) or UnitSettings()


def _untouchable(caller: Caller | None = None) -> frozenset[int]:
    """Our own PID and every ancestor's, and the caller's: the gate's client runs in the unit."""
    from gpuguard.adapters import procfs  # noqa: PLC0415 - see module doc

    pids = {os.getpid(), *procfs.ancestor_pids(os.getpid())}
    if caller is not None:
        pids |= {caller.pid, *procfs.ancestor_pids(caller.pid)}
    return frozenset(pids)


def _request(  # noqa: PLR0913, PLR0917 - one plan request, assembled from what each command learned
    settings: Settings,
    unit: str,
    scope: str,
    gpu_set: GpuSet,
    live: str | None,
    provenance: UnitProvenance,
    *,
    caller: Caller | None = None,
) -> PlanRequest:
    from gpuguard.core.policy import PlanRequest, Scope  # noqa: PLC0415 - see module doc

    return PlanRequest(
        unit=unit,
        scope=Scope(scope),
        patterns=_unit_settings(settings, unit).patterns,
        gpu_set=gpu_set.indices,
        protected_names=settings.protected_processes,
        untouchable_pids=_untouchable(caller),
        provenance=provenance,
        live_invocation=live,
    )


def _who(caller: Caller | None) -> Caller:
    """Who the command runs for: the gate server's caller, else this process itself."""
    from gpuguard.adapters import peer  # noqa: PLC0415 - see module doc

    return caller if caller is not None else peer.own_caller()


def _unit_environment(caller: Caller, unit: str, runtime_dir: Path) -> dict[str, str] | None:
    """The unit's real environment when the caller is one of its processes (else None).

    An ExecStartPre=/ExecStopPost= process has the unit's environment, EnvironmentFile= values
    included. Root records its GPU variables for the daemon's recoveries (unitenv).
    """
    if not caller.runs_in(unit) or caller.environment is None:
        return None
    if os.geteuid() == 0:
        from gpuguard.adapters import unitenv  # noqa: PLC0415 - see module doc

        try:
            unitenv.record(runtime_dir, unit, caller.environment, caller.pid)
        except OSError as err:
            sys.stderr.write(f"gpuguard: cannot record {unit}'s GPU variables: {err}\n")
    return caller.environment


def _gate_fast_path(
    args: argparse.Namespace, caller: Caller | None
) -> tuple[int | None, NvmlReading | None]:
    """Exit 0 at once when the unit's GPUs are idle, without pydantic, structlog or /proc.

    Uses the validated configuration cached by an earlier full load (configfile) and NVML alone
    (idle is a matter of memory, see protection.is_idle). Returns None whenever anything needs
    the full path: no cache, run outside the unit, NVML not healthy, a GPU not idle; the NVML
    reading taken on the way is handed on so the full path does not read it again.
    """
    from gpuguard.adapters import configfile, nvml  # noqa: PLC0415 - see module doc
    from gpuguard.core.gate import GateOutcome  # noqa: PLC0415
    from gpuguard.core.gpuset import resolve_gpu_set  # noqa: PLC0415
    from gpuguard.core.protection import is_idle  # noqa: PLC0415
    from gpuguard.core.values import MIB, NvmlHealth  # noqa: PLC0415

    started = time.monotonic()
    cached = configfile.load_validated(args.config)
    if cached is None:
        return None, None
    runtime_dir = Path(cached["runtime_dir"])
    environment = _unit_environment(_who(caller), args.unit, runtime_dir)
    if environment is None:
        return None, None
    unit = cached["units"].get(args.unit) or {}
    library = cached["nvml_library"]
    reading = nvml.read_gpus(float(cached["nvml_timeout_s"]), library and Path(library))
    if reading.health not in (NvmlHealth.OK, NvmlHealth.DRIVER_TOO_OLD):
        return None, reading
    gpu_set = resolve_gpu_set(unit.get("gpus"), environment, reading.gpus)
    present = {gpu.index for gpu in reading.gpus}
    if gpu_set.indices is not None and not gpu_set.indices <= present:
        return None, reading
    threshold = int(cached["idle_threshold_mib"]) * MIB
    for gpu in reading.gpus:
        wanted = gpu_set.indices is None or gpu.index in gpu_set.indices
        if wanted and not is_idle(gpu, threshold):
            return None, reading
    outcome = GateOutcome(
        args.unit,
        passed=True,
        fast_path=True,
        waited_s=time.monotonic() - started,
        reaped=(),
        spared=(),
        blockers=(),
    )
    return _finish_gate(runtime_dir, outcome, gpu_set), reading


def _gate(
    settings: Settings,
    args: argparse.Namespace,
    reading: NvmlReading | None,
    caller: Caller | None,
) -> int:
    from gpuguard.adapters import inventory, logs, reaper, systemd  # noqa: PLC0415
    from gpuguard.core import gate  # noqa: PLC0415
    from gpuguard.core.gpuset import resolve_gpu_set  # noqa: PLC0415

    unit = _unit_settings(settings, args.unit)
    first = inventory.gather(settings, reading)
    who = _who(caller)
    # The unit's own process (its ExecStartPre=) has its real environment, EnvironmentFile=
    # included; anyone else: systemd's Environment= only, and the running invocation's
    # processes are kept. Either way systemd names the unit's user and runs, the evidence for
    # its left-overs.
    unit_state = systemd.show_unit(args.unit)
    inside = who.runs_in(args.unit) and systemd.is_control_process(
        unit_state, who.pid, trust_unknown=caller is None
    )
    environment = _unit_environment(who, args.unit, settings.runtime_dir)
    if environment is None:
        environment = unit_state.environment
    live = unit_state.invocation_id if unit_state.running and not inside else None
    gpu_set = resolve_gpu_set(unit.gpus, environment, first.nvml.gpus)
    provenance = systemd.provenance(unit_state, inside=inside)
    request = _request(settings, args.unit, args.scope, gpu_set, live, provenance, caller=who)
    timeout = args.timeout if args.timeout is not None else settings.gate_timeout_s
    grace = args.grace if args.grace is not None else settings.reap_grace_s
    pending = [first]

    def gather() -> Inventory:
        return pending.pop() if pending else inventory.gather(settings)

    def reap(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        logs.configure_logging(json=False)  # structlog loads only when something is signalled
        log = logs.get_logger().bind(unit=args.unit, command="gate")
        return reaper.reap(targets, grace_s=grace, logger=log)

    def report(line: str) -> None:
        sys.stderr.write(f"gpuguard gate: {args.unit}: {escape(line, _GATE_LINE_LIMIT)}\n")

    outcome = gate.run_gate(
        gate.GateSettings(request, settings.idle_threshold_mib * 1024 * 1024, timeout),
        gather,
        reap,
        time.monotonic,
        time.sleep,
        report=report,
    )
    return _finish_gate(settings.runtime_dir, outcome, gpu_set)


def _finish_gate(runtime_dir: Path, outcome: GateOutcome, gpu_set: GpuSet) -> int:
    """Record the decision for `gpuguard status`, say it in one line, return the exit status."""
    from gpuguard.adapters import state  # noqa: PLC0415 - see module doc

    record = {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "unit": outcome.unit,
        "gpu_set": gpu_set.describe(),
        "result": "passed" if outcome.passed else "refused",
        "fast_path": outcome.fast_path,
        "waited_s": round(outcome.waited_s, 2),
        "reaped": [_result_json(r) for r in outcome.reaped],
        "spared": [
            {"pid": d.holder.pid, "command": d.holder.command, "reason": d.reason}
            for d in outcome.spared
        ],
        "blockers": list(outcome.blockers),
    }
    try:
        state.record_gate_decision(runtime_dir, outcome.unit, record)
    except OSError as err:
        sys.stderr.write(f"gpuguard gate: cannot record the decision in {runtime_dir}: {err}\n")
    # One journal entry whatever the blockers hold: escaped, and cut below journald's LineMax.
    line = escape(f"{outcome.message} [{gpu_set.describe()}]", _GATE_LINE_LIMIT)
    sys.stderr.write(f"gpuguard gate: {line}\n")
    return 0 if outcome.passed else 1


def _result_json(result: ReapResult) -> dict[str, Any]:
    return {
        "pid": result.target.identity.pid,
        "command": result.target.command,
        "reason": result.target.reason,
        "outcome": result.outcome.value,
        "signals": list(result.signals),
        "detail": result.detail,
    }


def _reap(settings: Settings, args: argparse.Namespace, caller: Caller | None) -> int:
    from gpuguard.adapters import inventory, logs, reaper, systemd  # noqa: PLC0415
    from gpuguard.core import policy  # noqa: PLC0415
    from gpuguard.core.gpuset import resolve_gpu_set  # noqa: PLC0415

    unit_name = args.unit or _only_unit(settings)
    if unit_name is None:
        sys.stderr.write(
            "gpuguard reap: several units are watched; name one with --unit "
            f"({', '.join(settings.units)})\n"
        )
        return EX_USAGE
    unit_state = systemd.show_unit(unit_name)
    who = _who(caller)
    # As the unit's ExecStopPost= the run is over even though systemd still says
    # "deactivating": everything else in the cgroup is left over, as at the gate.
    inside = who.runs_in(unit_name) and systemd.is_control_process(
        unit_state, who.pid, trust_unknown=caller is None
    )
    environment = _unit_environment(who, unit_name, settings.runtime_dir)
    live = unit_state.invocation_id if unit_state.running and not inside else None
    found = inventory.gather(settings)
    unit = _unit_settings(settings, unit_name)
    gpu_set = resolve_gpu_set(
        unit.gpus,
        unit_state.environment if environment is None else environment,
        found.nvml.gpus,
    )
    provenance = systemd.provenance(unit_state, inside=inside)
    request = _request(settings, unit_name, args.scope, gpu_set, live, provenance, caller=who)
    kill_plan = policy.plan(found.holders, request)
    notes = (
        [f"cannot ask systemd about {unit_name} ({unit_state.error})"] if unit_state.error else []
    )
    if not args.json:
        sys.stdout.write(_plan_text(kill_plan, gpu_set, notes))
    if args.dry_run or not kill_plan.to_reap:
        return _reap_finish(
            settings,
            found,
            kill_plan=kill_plan,
            gpu_set=gpu_set,
            results=(),
            args=args,
            waited=False,
        )
    if not args.yes and not _confirmed(len(kill_plan.to_reap)):
        sys.stderr.write("gpuguard reap: nothing signalled (confirm on a terminal, or --yes)\n")
        return 1
    logs.configure_logging(json=False)
    log = logs.get_logger().bind(unit=unit_name, command="reap")
    grace = args.grace if args.grace is not None else settings.reap_grace_s
    from gpuguard.core.gate import reap_targets  # noqa: PLC0415

    results = reaper.reap(reap_targets(kill_plan.to_reap), grace_s=grace, logger=log)
    return _reap_finish(
        settings,
        found,
        kill_plan=kill_plan,
        gpu_set=gpu_set,
        results=results,
        args=args,
        waited=True,
    )


def _only_unit(settings: Settings) -> str | None:
    return next(iter(settings.units)) if len(settings.units) == 1 else None


def _confirmed(count: int) -> bool:
    if not sys.stdin.isatty():
        return False
    sys.stdout.write(f"Signal {count} process(es)? [y/N] ")
    sys.stdout.flush()
    return sys.stdin.readline().strip().lower() in {"y", "yes"}


def _plan_text(kill_plan: KillPlan, gpu_set: GpuSet, notes: list[str]) -> str:
    request = kill_plan.request
    lines = [f"Plan for {request.unit}, scope {request.scope.value}, {gpu_set.describe()}:"]
    lines.extend(f"  note: {note}" for note in notes)
    if gpu_set.note:
        lines.append(f"  note: {gpu_set.note}")
    for decision in kill_plan.to_reap:
        command = escape(decision.holder.command, 60)
        lines.append(f"  reap  pid {decision.holder.pid:<7} {command}  - {decision.reason}")
    for decision in kill_plan.spared:
        command = escape(decision.holder.command, 60)
        lines.append(
            f"  spare pid {decision.holder.pid:<7} {command}  - "
            f"{decision.verdict.value}: {decision.reason}"
        )
    if not kill_plan.decisions:
        lines.append("  no process holds these GPUs")
    return "".join(f"{escape(line)}\n" for line in lines)


def _reap_finish(  # noqa: PLR0913 - the pieces of one report, passed once
    settings: Settings,
    found: Inventory,
    *,
    kill_plan: KillPlan,
    gpu_set: GpuSet,
    results: tuple[ReapResult, ...],
    args: argparse.Namespace,
    waited: bool,
) -> int:
    from gpuguard.adapters import inventory  # noqa: PLC0415 - see module doc
    from gpuguard.core import gate  # noqa: PLC0415 - see module doc

    gate_settings = gate.GateSettings(
        kill_plan.request, settings.idle_threshold_mib * 1024 * 1024, args.timeout
    )
    deadline = time.monotonic() + (args.timeout if waited else 0)
    current = found if not waited else inventory.gather(settings)
    blockers = gate.set_blockers(current, gate_settings)
    while blockers and time.monotonic() < deadline:
        time.sleep(0.2)
        current = inventory.gather(settings)
        blockers = gate.set_blockers(current, gate_settings)
    wanted = [
        g for g in current.gpus if gpu_set.indices is None or g.reading.index in gpu_set.indices
    ]
    if args.json:
        document = {
            "schema_version": 1,
            "unit": kill_plan.request.unit,
            "scope": kill_plan.request.scope.value,
            "gpu_set": gpu_set.describe(),
            "dry_run": bool(args.dry_run),
            "plan": [
                {
                    "pid": d.holder.pid,
                    "command": d.holder.command,
                    "verdict": d.verdict.value,
                    "reason": d.reason,
                }
                for d in kill_plan.decisions
            ],
            "results": [_result_json(r) for r in results],
            "gpus": [
                {
                    "index": g.reading.index,
                    "used_mib": None
                    if g.reading.memory is None
                    else g.reading.memory.used_bytes >> 20,
                }
                for g in wanted
            ],
            "idle": not blockers,
            "blockers": list(blockers),
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        lines = [
            f"pid {r.target.identity.pid}: {r.outcome.value}"
            + (f" ({', '.join(r.signals)})" if r.signals else "")
            + (f" - {r.detail}" if r.detail else "")
            for r in results
        ]
        for g in wanted:
            memory = g.reading.memory
            used = "unknown" if memory is None else f"{memory.used_bytes >> 20} MiB"
            lines.append(f"GPU {g.reading.index}: {used} used")
        lines.extend(f"still busy: {b}" for b in blockers)
        sys.stdout.write("".join(f"{escape(line)}\n" for line in lines))
    if args.dry_run:
        return 0  # a plan was asked for and shown; busy GPUs are its subject, not a failure
    return 0 if not blockers else 1
