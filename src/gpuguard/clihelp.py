"""The command line's long texts: each command's description, the top level's and its epilog.

cli.py defines the arguments and their one-line help; the paragraphs that explain a command,
its exit statuses and its privileges live here, so the parser reads as a list of options. What
``--help`` prints is pinned byte for byte by tests/unit/test_cli_help.py.
"""

from __future__ import annotations

from gpuguard.adapters.configfile import CONFIG_ENV, DEFAULT_CONFIG_PATH
from gpuguard.core.gate.proto import SOCKET_PATH as GATE_SOCKET

DESCRIPTION = """\
gpuguard keeps GPU inference services (SGLang, vLLM) out of restart loops caused by
processes that still hold GPU memory after the service stopped. It finds who holds each
GPU (NVML plus a scan of /dev/nvidia* file descriptors in /proc), attributes every holder
to its systemd unit or container, reaps only the stale ones, and explains what it sees.

commands:
  status   show GPUs, who holds them and whether that is healthy (--watch: live)
  reap     the surgical replacement for `kill -9 <every python>; fuser -k /dev/nvidia*`
  gate     ExecStartPre= of a watched unit: wait until its GPUs are idle before it starts
  run      the watchdog daemon: detect restart loops in the journal and recover them
  doctor   audit a unit's settings against its journal; print the drop-in that fixes them
  explain  tell a unit's incident from the journal: stops, kills, failed starts, recovery
  breaker  the daemon's host-wide limit on recoveries: its state, and --close (root)
  install-gate / remove-gate
           add or remove the gate drop-in of a unit (never done without being asked)
  serve-gate
           internal: the root side of gate and reap, run by gpuguard-gate.socket
"""

PRIVILEGES = f"""\
Privileges: in the drop-in this command runs unprivileged, in the unit's environment, and
only asks the root gate server (gpuguard-gate.socket, {GATE_SOCKET}), which identifies
the caller from the kernel and does the work. A process may ask only for its own unit,
only scope "unit", and only when gpuguard watches that unit (configured, or its gate
drop-in installed); the operator (root in a login session: ssh, or sudo from one) may ask
for any. Without a socket at
--socket, root runs the work in this process (a developer's install); anyone else, or a
socket nobody answers, gets one line and exit 1 - for the gate, unless the configuration
says gate_unreachable = "allow". See /usr/share/doc/gpuguard/security.md.
"""

STATUS = """\
Show every GPU with its memory and the processes holding it (PID, state, unit or
container, MiB, command line with secrets redacted), memory that no visible process
explains, NVML's health, and for each watched unit its GPU set, last gate decisions and
how long its GPUs took to release a reaped holder's memory (last time, typically).

Exit status (monitoring-plugin convention):
  0 OK        GPUs idle, or held only by live processes
  1 WARNING   something needs a look (a left-over of a watched unit, a zombie holder,
              memory used from outside this container,
              a watched unit systemd does not know, NVML partly unusable but /proc
              shows holders, a GPU health warning, a GPU with MIG mode on, a recent
              kernel Xid after which no kill helps, a start stuck in one phase past
              its learned budget)
  2 CRITICAL  a lost GPU, a GPU that needs a reset or reboot (NVML health: a pending
              row remap or page retirement, the driver asks for it), memory no
              visible process explains, a holder stuck in state D in the NVIDIA
              driver or stuck after an Xid (SIGKILL left it alive), NVML not
              answering, a watched unit whose engine is dead while the unit lives,
              the daemon's host-wide breaker open (gpuguard breaker --close)
  3 UNKNOWN   NVML unavailable and no evidence in /proc
 78           the configuration file is invalid

--watch [SECONDS] redraws the screen in place every SECONDS (default 2) in the
terminal's alternate screen, until Ctrl-C, SIGTERM or a hangup, which leave the terminal
as it was (exit 0). It needs a terminal: on a pipe or a file it exits 64.

--since WHEN limits the history shown - kernel Xid events, gate decisions, the daemon's
recoveries and sweeps - to what was logged from WHEN on: 90s, 30m, 1h, 2d (that long
ago) or an ISO time (2026-12-01T06:00, local time without an offset). History is what
the daemon keeps in its snapshot (the newest 50 Xid events, 10 recoveries and sweeps
per unit). A GPU's current state and health are shown whatever the window.

Runs without root; it then shows what it can see and says what it cannot: another
user's job is "not inspectable without root", never reported as vanished. With the v1
memory API (drivers older than 515) the driver's reserved memory is estimated
(v1_reserved_mib, else learned as root from idle GPUs) and the figures say so.

NVML's PID is a claim: a process is credited NVML's memory figure only when it holds
that GPU's device file. Inside a container with its own PID namespace (the "Runs:"
line says so) the driver names host PIDs: a GPU's memory is then "held by processes of
this container" (OK) while a live process here holds it, else "used from outside this
container" (WARNING, never reaped).
--prometheus prints the metrics the daemon exports (/usr/share/doc/gpuguard/metrics.md),
drawn now from a fresh inventory, with the daemon's counters from its snapshot; exit
status 0.
"""

EXPLAIN = """\
Tell one unit's incident from the journal alone, as a timeline: the stop that timed out,
what systemd SIGKILLed, who survived or was left over, each failed start and the
start-failure signature it printed, what gpuguard decided and did, and when the unit
came up again. Only journald's trusted fields decide who said what: systemd's rows are
PID 1's own entries; the unit's output is shown as its word (even a line identical to
the gate's verdict); gpuguard's rows come from gpuguard.service and gpuguard-gate.service
as root. gpuguard's own detector is replayed over systemd's entries: the story ends with
its verdict (a start limit systemd hit, stops an operator asked for, left-overs that make
no loop), and any verdict the daemon logged that the replay does not reach is printed with
the reason. With no gpuguard line in the journal (an incident before it was installed),
the replay says what it would have done, and only what its ownership rule would allow.
The release log adds when each GPU let go of the reaped holders' memory (gpu-released
rows), also after an operator's reap, which leaves no journal line.

Exit status: 0 a timeline was printed; 1 the journal had nothing about the unit;
64 a bad argument; 69 journalctl could not be run; 78 the configuration file is invalid.
"""

REAP = """\
Find the stale holders of a watched unit's GPUs and kill exactly those: SIGTERM, a grace
period, then SIGKILL, through pidfds so a reused PID is never hit. Shows the plan first -
who will be signalled and why, who is spared and why - and asks on a terminal unless
--yes. Then waits until the unit's GPUs are idle and prints their memory, and how long
each GPU took to release the reaped holders' memory after the last signal (kept in the
release log that status, explain and the metrics read).

Scopes:
  unit      (default) processes in the unit's cgroup that do not belong to its running
            invocation, plus processes outside it proven to come from an ended run of the
            unit (their INVOCATION_ID names one, and they run as the unit's User=); a
            command line matching the patterns is no proof. Nothing in the cgroup is
            reaped while systemd cannot say whether the unit runs
  patterns  also any holder whose command line matches the unit's patterns and that runs
            as the unit's User= (another user's process never, whatever its name)
  all       every holder that is not protected: the old `fuser -k`, opt-in only

Never signalled, whatever the scope: PID 1 and 2, kernel threads, gpuguard and its
ancestors, protected processes (nvidia-persistenced, DCGM, nvidia-smi, display servers,
anything in protected_processes), and holders only of GPUs outside the unit's set.

With --yes and --unit (and without --dry-run) the reap goes through the gate server; a
plan that asks for confirmation on a terminal, and --dry-run, run in this process.

As the unit's own ExecStopPost= in its stop (the gate drop-in's), the reap fits its waits
into the unit's TimeoutStopSec=, past which systemd kills it: the wait for the memory goes
first (the next start's gate waits for it), then the grace and the wait after SIGKILL
shrink; its plan says so in a note.

Exit status: 0 the GPUs are idle; 1 they are not (or the plan was declined, or the request
was refused or could not be sent); 64 usage, or an unknown --unit (not configured, not
gated, and systemd has no such unit: a typo; --force goes ahead); 78 invalid configuration.
"""

GATE = """\
Run as ExecStartPre= of a watched unit (the drop-in install-gate writes): exit 0 at once
when every GPU of the unit's set is idle; otherwise reap the stale holders of those GPUs
(at this point everything in the unit's cgroup but the gate itself is left over from an
earlier run), wait until the GPUs are idle, then exit 0. While it waits it prints one line
per blocker every 10 s (who holds what). On timeout it exits 1 with one message naming who
still holds what and why gpuguard would not touch it; Restart= then tries again until the
unit's start limit ends the tries (`gpuguard doctor` says whether it ever does). When
waiting cannot help - NVML unavailable or not answering, a GPU of the set lost, absent or
needing a reset (NVML health), or, for an automatic restart (NRestarts > 0), a reset-class
kernel Xid on a GPU of the set that the running daemon counts since the unit last came up
- it refuses at once, in one line with the reason. Each decision is recorded and shown by
`gpuguard status`.

The unit's GPU set is its `gpus` in the config, else CUDA_VISIBLE_DEVICES from the unit's
real environment (read by root from the calling process: EnvironmentFile= values count),
else all GPUs. Keep the unit's TimeoutStartSec above --timeout.

Exit status: 0 start allowed; 1 GPUs still busy at the timeout, refused at once, the
request refused, or the gate server unreachable; 64 an unknown --unit (not configured, not
gated, and systemd has no such unit; --force goes ahead); 78 invalid configuration.
"""

SERVE_GATE = """\
Internal: not for operators to run. gpuguard-gate.service runs it, as root with a clean
environment, on the listening socket gpuguard-gate.socket passes it (/run/gpuguard/gate.sock,
fd 3 with LISTEN_PID and LISTEN_FDS). It forks one process per
connection of an operator or a watched unit's control process (its ExecStartPre= or
ExecStopPost=, systemd's ControlPID=, asked without waiting; the unit's other processes get
one line, nothing forked; one per unit at a time, at most 64 at once of
which 8 are kept for operators, 16 per caller's UID, 3700 s each), which reads one request
line (at most 4 KiB, within 10 s), identifies the caller (SO_PEERCRED, a pidfd,
/proc/PID/cgroup and environ), refuses a request for any unit but the caller's own, or
from a unit gpuguard does not watch (except from root in a login session), runs the gate or
reap and streams its output back, then the
exit status. One line per request goes to its own journal. SIGTERM: it stops accepting and
waits for the requests in progress.

Exit status: 0 after SIGTERM; 71 not given a listening socket by systemd. A client gets its
request's verdict: 1 refused (or the server busy); 64 a malformed request.
"""


RUN = """\
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
`gpuguard status`). A loop on a GPU that needs a reset - NVML health, a reset-class kernel
Xid (_TRANSPORT=kernel only) since the unit last came up, or a holder that an application
Xid named and SIGKILL left alive - goes straight to "needs operator". An out-of-memory
line's device (cuda:1) is named as the GPU the unit sees by that number and its holders.
Loops without a GPU cause are reported, never acted on. A unit stopped
by a stop job (an operator's `systemctl stop`) or inactive is never started. With
`[daemon] dry_run = true` it logs what it would do and does nothing.

It also sees what systemd cannot: an engine dead while its unit lives (the server's own
fatal lines in the unit's output, such as "EngineCore encountered a fatal error" or "Rank 0
scheduler is dead", an exit 0 no stop job asked for, or the unit's health_url failing
health_failures times in a row once the run is up), reported as CRITICAL in `gpuguard
status` and recovered only with the unit's on_engine_dead = "recover"; and the phases of each
start (weights, CUDA graphs, ready), learned per unit, with a start stuck in one phase past
its learned budget reported as a WARNING and recovered only with the unit's on_start_stuck =
"recover" (/usr/share/doc/gpuguard/liveness.md).

History replayed at start rebuilds the detection window but is never acted on; time is the
journal's monotonic clock, never the wall. A recovery interrupted by its death is resumed
only in the same boot, soon after, with the unit still stopped. It logs JSON lines to stdout
(the journal), sends READY=1 after the first inventory and journal attach, WATCHDOG=1 from
its main loop and through each long step, and writes a snapshot to runtime_dir/daemon.json that
`gpuguard status` shows. With it, Prometheus metrics (/usr/share/doc/gpuguard/metrics.md)
to node_exporter's textfile directory ([metrics] textfile) and, when [metrics] listen is
set, over HTTP. SIGTERM stops it cleanly.

Exit status: 0 after SIGTERM; 73 runtime_dir or state_dir cannot be written (it runs as
root); 78 invalid configuration.
"""

INSTALL_GATE = """\
Install the gate drop-in for a unit (explicitly; gpuguard never does it by itself).
Writes /etc/systemd/system/UNIT.d/gpuguard-gate.conf - ExecStartPre= gate, ExecStopPost=
reap, TimeoutStartSec=600, KillMode=mixed, each line commented (see gate.md in
/usr/share/doc/gpuguard/) - and runs `systemctl daemon-reload`. It says that it replaces the
unit's TimeoutStartSec= and KillMode=; it leaves TimeoutStopSec= to the unit (`gpuguard
doctor` proposes one).
The drop-in calls this gpuguard's path, unprivileged; it asks the gate server over
/run/gpuguard/gate.sock. That file and every directory above it must be root's alone (it
runs as the unit's user at every start), else nothing is installed; PATH is not searched.
A unit whose own sandbox would keep it from that socket
(RestrictAddressFamilies= without AF_UNIX, a SystemCallFilter= without socket/connect,
InaccessiblePaths= or TemporaryFileSystem= over /run, RootDirectory=, RootImage=) is refused
with the reason. A file there that gpuguard did not write, or that was edited since, is
left alone and the command fails. A unit systemd does not know (LoadState=not-found, a
typo?) is refused, as is one systemd cannot be asked about; --force installs anyway.
Needs root. Undo with `gpuguard remove-gate --unit UNIT`.

Exit status: 0 installed or already there; 1 refused or daemon-reload failed; 77 not root.
"""

DOCTOR = """\
Audit a watched unit's effective settings (systemctl show, drop-ins included) against its
own history in the journal (systemd's trusted messages of the last 30 days), and say what to
change: a TimeoutStopSec= shorter than the observed drains (how many stops ended in SIGKILL,
the drain distribution, a timeout of p99 x 1.5), a KillMode= that leaves workers running and
the processes that survived stops, a Restart= policy whose loops the start limit never ends
(and what a loop costs per hour in model loads, including a refusing gate), the gate missing
or its timeout above TimeoutStartSec=, a TimeoutStartSec= and a gate timeout from the starts
and gate waits gpuguard learned (none proposed from fewer than 3), GPU sets shared with another
watched unit, PATH,
LD_LIBRARY_PATH or EnvironmentFile= paths the service user can change,
nvidia-persistenced not running, and GPUs with MIG mode on (gpuguard judges nothing there).
It also reads the server's own settings from ExecStart= and the unit's environment (vLLM's
--shutdown-timeout and VLLM_ENGINE_READY_TIMEOUT_S, SGLang's unbounded drain and
--watchdog-timeout): TimeoutStopSec= against the drain + 30 s (never proposed past 10 min),
the ready timeout against the learned starts, and Restart=on-failure on vLLM, which an exit 0
after its engine died leaves down; a server or value it cannot read is said, never guessed.
Every finding has its evidence and the drop-in lines that
fix it; --fix prints one complete drop-in to save by hand (doctor never changes anything).
Without --unit every watched unit in the configuration is audited.

Exit status: the worst finding - 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (systemd or the
journal could not be asked); 64 an unknown --unit (not configured, not gated, and systemd
has no such unit; --force audits it anyway); 78 invalid configuration.
"""

BREAKER = """\
The host-wide breaker. gpuguard's daemon lets at most breaker_max_recoveries recoveries (a
stop, reap and restart of a looping unit; a sweep that reaps an ended run's survivors) happen
in breaker_window_s across all watched units (default 6 in 30 min). The next one opens the
breaker: from then on the daemon only reports, `gpuguard status` is CRITICAL with "breaker
open since T after N recoveries", and the breaker stays open across daemon restarts until a
reboot or a person closes it. Without options: say its state. --close (root) closes it, with
a fresh window; check the host first (`gpuguard status`: several units looping at once is
often a driver or GPU fault that more recoveries only hide).

Exit status: 0 closed (or closed now); 2 open; 73 the breaker's file could not be written;
77 --close without root; 64 usage error; 78 invalid configuration.
"""

REMOVE_GATE = """\
Remove the gate drop-in that `gpuguard install-gate` wrote for a unit, then run
`systemctl daemon-reload`. Only a file that is byte for byte what install-gate wrote is
removed; an edited one is kept, and the command says so and fails. Any other file is left
alone. Needs root. The next start of the unit runs without the gate.

Exit status: 0 removed or not there; 1 kept or daemon-reload failed; 77 not root.
"""

EPILOG = (
    f"Configuration: --config FILE (before or after the command), else ${CONFIG_ENV},\n"
    f"else {DEFAULT_CONFIG_PATH} (optional; every key has a default).\n"
    "Exit status: 64 usage error, 78 invalid configuration; each command's --help says\n"
    "the rest. Documentation: gpuguard(8) and /usr/share/doc/gpuguard/."
)
