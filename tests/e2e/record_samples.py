"""Re-record the golden journal samples in tests/journal_samples/ from a real systemd.

Run on demand, as root, not in the test suite:

    .venv/bin/python tests/e2e/record_samples.py                     # bookworm and trixie
    .venv/bin/python tests/e2e/record_samples.py --release trixie --scenario forged-entries

Each scenario boots a fresh container (so its journal holds nothing else), writes the unit,
drives it, and dumps `journalctl -o json --all` for the unit exactly as journalctl printed it.
Beside each sample it writes `<name>.expect.json`: what a parser must make of every line. The
expectations are computed here by a deliberately plain classifier and were reviewed by hand
against the raw lines; review the diff whenever you re-record. Each release directory gets a
README.md listing the systemd version, the unit files and every command, as they were run.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# Run as a script: make tests/ importable, where the harness lives as `e2e.container`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.container import RELEASES, Container, JournalEntry, ensure_rootfs

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterator, Sequence

LOG = logging.getLogger("record_samples")
SAMPLES = Path(__file__).resolve().parents[1] / "journal_samples"
UNIT = "sglang.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
FORGER = "forger"

# MESSAGE_IDs (systemd src/systemd/sd-messages.h; identical in 252 and 257).
STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
STARTED = "39f53479d3a045ac8e11786248231fbf"
START_FAILED = "be02cf6855d2428ba40df7e9d022f03d"
STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"
STOPPED = "9d1aaa27d60140bd96365438aad20286"
RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"
SUCCESS = "7ad2d189f7e94e70a38c781354912448"
FAILURE_RESULT = "d9b373ed55a64feb8242e02dbe79a49c"
PROCESS_EXIT = "98e322203f7a4ed290d09fe03c09fe15"

# --- driving a container and writing down what was done ----------------------------------------


@dataclass
class Recorder:
    """A container plus the exact list of what was done to it, for the README."""

    box: Container
    steps: list[str] = field(default_factory=list)

    def run(
        self,
        cmd: Sequence[str],
        *,
        user: str | None = None,
        stdin: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside and note it (with its stdin)."""
        who = f"(as {user}) " if user else ""
        line = f"{who}{shlex.join(cmd)}"
        if stdin is not None:
            line += " <<'EOF'\n" + stdin + ("" if stdin.endswith("\n") else "\n") + "EOF"
        self.steps.append(line)
        return self.box.run(cmd, user=user, input=stdin, check=check, timeout=120)

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside and note its content."""
        self.steps.append(f"write {path} (mode {mode:o}):\n{_indent(text)}")
        self.box.write_file(path, text, mode=mode)

    def note(self, text: str) -> None:
        """Note something done from the host side."""
        self.steps.append(f"# on the host: {text}")

    def unit_entries(self, extra: Sequence[str] = ()) -> list[JournalEntry]:
        """The entries about the unit (not noted: polling)."""
        return self.box.journal(["--all", *dump_filter(extra)])

    def wait_for_message(self, pattern: str, *, count: int = 1, timeout: float = 30.0) -> None:
        """Wait until `count` entries about the unit have a MESSAGE matching `pattern`."""
        self.steps.append(f"# wait until the journal has {count} message(s) matching {pattern!r}")
        regex = re.compile(pattern)
        self.box.wait_journal(
            ["--all", *dump_filter()],
            lambda entries: sum(bool(regex.search(message(e))) for e in entries) >= count,
            timeout=timeout,
        )

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
        """Wait until `check()` holds, noting `what`."""
        self.steps.append(f"# wait until {what}")
        self.box.wait_for(what, check, timeout=timeout)

    def unit_property(self, name: str) -> str:
        """`systemctl show -P NAME sglang.service` (not noted: polling)."""
        return self.box.run(["systemctl", "show", "-P", name, UNIT]).stdout.strip()


def _indent(text: str) -> str:
    return "".join(("    " + line).rstrip() + "\n" for line in text.splitlines())


def dump_filter(extra: Sequence[str] = ()) -> list[str]:
    """The journalctl matches of a dump.

    PID 1 (and on 257 its helpers) about the unit, the unit's own output, and whatever a
    scenario adds (the forger's uid).
    """
    matches = [f"UNIT={UNIT}", "+", f"_SYSTEMD_UNIT={UNIT}"]
    for match in extra:
        matches += ["+", match]
    return matches


def message(entry: JournalEntry) -> str:
    """MESSAGE as text: byte arrays decoded, null (too long without --all) as ""."""
    value = entry.get("MESSAGE")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, int) for x in value):
        return bytes(x for x in value if isinstance(x, int)).decode("utf-8", "replace")
    return ""


# --- the scenarios -----------------------------------------------------------------------------


def unit_file(service: str, description: str = "SGLang server (gpuguard e2e sample)") -> str:
    """A unit file named sglang.service with the given [Service] body."""
    return f"[Unit]\nDescription={description}\n\n[Service]\n{service}"


def install_unit(rec: Recorder, service: str) -> None:
    """Write /etc/systemd/system/sglang.service and reload."""
    rec.write(UNIT_PATH, unit_file(service))
    rec.run(["systemctl", "daemon-reload"])


FAILING_START = (
    'ExecStart=/bin/sh -c \'echo "sglang: loading model"; '
    'echo "sglang: CUDA error: out of memory" >&2; exit 1\'\n'
    "Restart=always\nRestartSec=1\n"
)

# A stand-in for the gpuguard gate. Any ExecStartPre= gives the unit an "activating" phase, and
# only then does PID 1 log "Starting ..." (job.c job_perform_on_unit: a Type=simple unit without
# one goes straight from inactive to active, and its start job logs only "Started").
GATE = "ExecStartPre=/bin/true\n"


def scenario_restart_loop(rec: Recorder) -> list[str]:
    """(a) ExecStart exits 1; Restart=always RestartSec=1 until the start limit (5 in 10 s) hits.

    Type=simple without ExecStartPre=: no "Starting" lines.
    """
    install_unit(rec, FAILING_START)
    return drive_restart_loop(rec)


def scenario_restart_loop_gated(rec: Recorder) -> list[str]:
    """(a2) As (a), with `ExecStartPre=/bin/true` standing in for the gate: "Starting" lines."""
    install_unit(rec, GATE + FAILING_START)
    return drive_restart_loop(rec)


def drive_restart_loop(rec: Recorder) -> list[str]:
    """Start the failing unit and wait until the start limit has failed it."""
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"Start request repeated too quickly", timeout=40)
    rec.wait_for_message(r"^Failed to start ")
    rec.wait_until("the unit is failed", lambda: rec.unit_property("ActiveState") == "failed")
    return []


SIGTERM_IGNORER = (
    "ExecStart=/usr/bin/python3 -u -c 'import signal, time; "
    'signal.signal(signal.SIGTERM, signal.SIG_IGN); print("sglang: serving"); time.sleep(3600)\'\n'
    "TimeoutStopSec=2\n"
)


def scenario_stop_timeout(rec: Recorder) -> list[str]:
    """(b) The main process ignores SIGTERM; stop times out after 2 s and SIGKILLs it."""
    install_unit(rec, SIGTERM_IGNORER)
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"^sglang: serving$")
    rec.run(["systemctl", "stop", UNIT])
    rec.wait_for_message(r"^Stopped ")
    return []


FREEZER = Path("/sys/fs/cgroup/freezer")


def scenario_sigkill_survivor(rec: Recorder) -> list[str]:
    """(b2) The main process survives SIGKILL: frozen from the host with the cgroup v1 freezer.

    Frozen, it is in state D, like a process stuck in the GPU driver; it is thawed once systemd
    gave up on it.
    """
    install_unit(
        rec,
        'ExecStart=/usr/bin/python3 -u -c \'import time; print("sglang: serving"); '
        "time.sleep(3600)'\nTimeoutStopSec=2\n",
    )
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"^sglang: serving$")
    main_pid = rec.box.host_pid(int(rec.unit_property("MainPID")))
    group = FREEZER / f"{rec.box.name}-frozen"
    group.mkdir()
    try:
        rec.note(
            "mkdir /sys/fs/cgroup/freezer/<name>-frozen; echo <host pid of MainPID> > "
            "cgroup.procs; echo FROZEN > freezer.state"
        )
        (group / "cgroup.procs").write_text(f"{main_pid}\n")
        (group / "freezer.state").write_text("FROZEN\n")
        rec.run(["systemctl", "stop", "--no-block", UNIT])
        rec.wait_for_message(r"Processes still around after final SIGKILL", timeout=60)
        rec.note("echo THAWED > freezer.state (the process then dies of its pending SIGKILL)")
        (group / "freezer.state").write_text("THAWED\n")
        rec.wait_until(
            "the unit is failed and its process gone",
            lambda: (
                rec.unit_property("ActiveState") == "failed"
                and not (group / "cgroup.procs").read_text().strip()
            ),
        )
    finally:
        (group / "freezer.state").write_text("THAWED\n")
        rec.box.wait_for("frozen group empty", lambda: not (group / "cgroup.procs").read_text())
        group.rmdir()
    return []


FAKE_SERVER = """\
#!/usr/bin/python3
# A stand-in for an SGLang server: forks a worker (comm "sglang-worker") and serves.
import ctypes, os, time

pid = os.fork()
if pid == 0:
    ctypes.CDLL(None).prctl(15, b"sglang-worker", 0, 0, 0)  # PR_SET_NAME
    time.sleep(3600)
    os._exit(0)
print(f"sglang: worker {pid} started", flush=True)
time.sleep(3600)
"""


def scenario_left_over(rec: Recorder) -> list[str]:
    """(c) KillMode=process leaves the worker behind; the restart finds it.

    With ExecStartPre=, the left-over check runs before it and again before ExecStart=.
    """
    rec.write("/usr/local/bin/sglang-fake-server", FAKE_SERVER, mode=0o755)
    install_unit(rec, GATE + "ExecStart=/usr/local/bin/sglang-fake-server\nKillMode=process\n")
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"^sglang: worker \d+ started$")
    rec.run(["systemctl", "restart", UNIT])
    rec.wait_for_message(r"Found left-over process")
    rec.wait_for_message(r"^sglang: worker \d+ started$", count=2)
    rec.run(["systemctl", "stop", UNIT])
    rec.wait_for_message(r"^Stopped ", count=2)
    return []


def scenario_clean(rec: Recorder) -> list[str]:
    """(d) A clean start and stop (with `ExecStartPre=/bin/true`)."""
    install_unit(
        rec,
        GATE + 'ExecStart=/usr/bin/python3 -u -c \'import time; print("sglang: serving"); '
        "time.sleep(3600)'\n",
    )
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"^sglang: serving$")
    rec.run(["systemctl", "stop", UNIT])
    rec.wait_for_message(r"^Stopped ")
    return []


FORGED_RESTART = f"""\
MESSAGE_ID={RESTART_SCHEDULED}
UNIT={UNIT}
N_RESTARTS=7
INVOCATION_ID=0123456789abcdef0123456789abcdef
SYSLOG_IDENTIFIER=systemd
PRIORITY=6
MESSAGE={UNIT}: Scheduled restart job, restart counter is at 7.
"""

FORGED_START_LIMIT = f"""\
UNIT={UNIT}
SYSLOG_IDENTIFIER=systemd
PRIORITY=4
MESSAGE={UNIT}: Start request repeated too quickly.
"""

# Native journal protocol by hand; the "_PID=1"/"_UID=0"/"_SYSTEMD_CGROUP" lines try to forge
# trusted fields (journald drops client fields that start with "_").
SOCKET_FORGER = f"""\
import socket
fields = [
    "MESSAGE_ID={RESTART_SCHEDULED}",
    "UNIT={UNIT}",
    "N_RESTARTS=7",
    "SYSLOG_IDENTIFIER=systemd",
    "_PID=1",
    "_UID=0",
    "_SYSTEMD_CGROUP=/init.scope",
    "MESSAGE={UNIT}: Scheduled restart job, restart counter is at 7.",
]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto("\\n".join(fields).encode() + b"\\n", "/run/systemd/journal/socket")
"""

IN_UNIT_FORGER = f"""\
#!/usr/bin/python3
# Runs as the unit's main process (User={FORGER}) and forges PID-1 lifecycle entries.
import socket

def send(*fields):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto("\\n".join(fields).encode() + b"\\n", "/run/systemd/journal/socket")

send("MESSAGE_ID={FAILURE_RESULT}", "UNIT={UNIT}", "UNIT_RESULT=exit-code",
     "SYSLOG_IDENTIFIER=systemd", "MESSAGE={UNIT}: Failed with result 'exit-code'.")
send("MESSAGE_ID={RESTART_SCHEDULED}", "UNIT={UNIT}", "N_RESTARTS=7",
     "SYSLOG_IDENTIFIER=systemd", "MESSAGE={UNIT}: Scheduled restart job, restart counter is at 7.")
print("sglang: forged two lifecycle entries", flush=True)
"""


def scenario_forged(rec: Recorder) -> list[str]:
    """(e) Lifecycle entries forged by an unprivileged user (and one by root, not PID 1)."""
    rec.run(["useradd", "--create-home", FORGER])
    uid = rec.run(["id", "-u", FORGER]).stdout.strip()
    rec.run(["logger", "--journald"], user=FORGER, stdin=FORGED_RESTART)
    rec.run(["logger", "--journald"], user=FORGER, stdin=FORGED_START_LIMIT)
    rec.run(["python3", "-c", SOCKET_FORGER], user=FORGER)
    rec.run(
        ["systemd-cat", "-t", "systemd", "-p", "info"],
        user=FORGER,
        stdin=f"{UNIT}: Scheduled restart job, restart counter is at 7.\n",
    )
    as_root = FORGED_RESTART.replace("N_RESTARTS=7", "N_RESTARTS=8").replace("at 7.", "at 8.")
    rec.run(["logger", "--journald"], stdin=as_root)
    rec.write("/usr/local/bin/sglang-forger", IN_UNIT_FORGER, mode=0o755)
    install_unit(rec, f"ExecStart=/usr/local/bin/sglang-forger\nUser={FORGER}\n")
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"Deactivated successfully")
    rec.wait_for_message(r"Scheduled restart job", count=4)
    rec.wait_for_message(r"^sglang: forged two lifecycle entries$")
    rec.box.wait_journal([f"_UID={uid}"], lambda entries: len(entries) >= 6)
    return [f"_UID={uid}"]


STDOUT_SCRIPT = """\
#!/usr/bin/python3
# Writes what real servers write: colours (ANSI escapes) and very long lines.
print("\\x1b[32mINFO\\x1b[0m sglang: server is ready", flush=True)
print("sglang: long line " + "x" * 5000, flush=True)
print("sglang: plain line after", flush=True)
"""


def scenario_stdout(rec: Recorder) -> list[str]:
    """(f) The unit's stdout: an ANSI-coloured line and a line over 4096 bytes."""
    rec.write("/usr/local/bin/sglang-stdout", STDOUT_SCRIPT, mode=0o755)
    install_unit(rec, "ExecStart=/usr/local/bin/sglang-stdout\n")
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"Deactivated successfully")
    rec.wait_for_message(r"^sglang: plain line after$")
    return []


CLEAN_EXIT_LOOP = """\
[Unit]
Description=SGLang server (gpuguard e2e sample)
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sh -c 'echo "sglang: engine gone, exiting 0"; exit 0'
Restart=always
RestartSec=1
"""


def scenario_restart_counter(rec: Recorder) -> list[str]:
    """(g) The main process exits 0 at once; Restart=always restarts it, no start limit.

    Only systemd's restart counter ("restart counter is at N") tells the loop: every run ends
    "Deactivated successfully", none fails.
    """
    rec.write(UNIT_PATH, CLEAN_EXIT_LOOP)
    rec.run(["systemctl", "daemon-reload"])
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"restart counter is at 6\.", timeout=40)
    rec.run(["systemctl", "stop", UNIT])
    rec.wait_until("the unit is inactive", lambda: rec.unit_property("ActiveState") == "inactive")
    return []


SERVING = (
    "ExecStart=/usr/bin/python3 -u -c 'import time; print(\"sglang: serving\"); time.sleep(3600)'\n"
)


def scenario_operator_restart(rec: Recorder) -> list[str]:
    """(h) An operator's `systemctl restart` twice, then `stop` and `start`: no failure at all."""
    install_unit(rec, GATE + SERVING)
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"^sglang: serving$")
    for count in (2, 3):
        rec.run(["systemctl", "restart", UNIT])
        rec.wait_for_message(r"^sglang: serving$", count=count)
    rec.run(["systemctl", "stop", UNIT])
    rec.wait_until("the unit is inactive", lambda: rec.unit_property("ActiveState") == "inactive")
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"^sglang: serving$", count=4)
    return []


EXITING_SERVER = """\
#!/usr/bin/python3
# First run: forks a worker (comm "sglang-worker") and exits 0, leaving it (KillMode=process).
# Later runs fork a worker and serve.
import ctypes, os, sys, time

first = not os.path.exists("/run/sglang-first-run-done")
pid = os.fork()
if pid == 0:
    ctypes.CDLL(None).prctl(15, b"sglang-worker", 0, 0, 0)  # PR_SET_NAME
    time.sleep(3600)
    os._exit(0)
print(f"sglang: worker {pid} started", flush=True)
if first:
    open("/run/sglang-first-run-done", "w").close()
    print("sglang: main process exits 0, worker stays", flush=True)
    sys.exit(0)
time.sleep(3600)
"""


def scenario_left_over_at_start(rec: Recorder) -> list[str]:
    """(i) KillMode=process, no Restart=: the main process exits 0 and leaves its worker.

    The operator's next `systemctl start` finds it ("Found left-over process ... Ignoring.") and
    the run comes up: no failure, no scheduled restart.
    """
    rec.write("/usr/local/bin/sglang-exiting-server", EXITING_SERVER, mode=0o755)
    install_unit(rec, "ExecStart=/usr/local/bin/sglang-exiting-server\nKillMode=process\n")
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"Deactivated successfully")
    rec.wait_until("the unit is inactive", lambda: rec.unit_property("ActiveState") == "inactive")
    rec.run(["systemctl", "start", UNIT])
    rec.wait_for_message(r"Found left-over process")
    rec.wait_for_message(r"^sglang: worker \d+ started$", count=2)
    return []


@dataclass(frozen=True)
class Scenario:
    """One recorded sample."""

    name: str
    drive: Callable[[Recorder], list[str]]
    without_all: bool = False  # also dump without --all (long fields become null)


SCENARIOS = (
    Scenario("restart-loop-start-limit", scenario_restart_loop),
    Scenario("restart-loop-start-limit-gated", scenario_restart_loop_gated),
    Scenario("stop-sigterm-timeout", scenario_stop_timeout),
    Scenario("stop-sigkill-survivor", scenario_sigkill_survivor),
    Scenario("left-over-process", scenario_left_over),
    Scenario("clean-start-stop", scenario_clean),
    Scenario("forged-entries", scenario_forged),
    Scenario("stdout-ansi-long", scenario_stdout, without_all=True),
    Scenario("restart-counter-clean-exit", scenario_restart_counter),
    Scenario("operator-restart", scenario_operator_restart),
    Scenario("left-over-at-start", scenario_left_over_at_start),
)

# --- what a parser must make of each line ------------------------------------------------------

_EXIT = re.compile(r": Main process exited, code=(\w+), status=(-?\d+)/(\S+)$")
_LEFT_OVER = re.compile(r"Found left-over process (\d+) \((.*)\) in control group while starting")


def _text(entry: JournalEntry, name: str) -> str | None:
    value = entry.get(name)
    return value if isinstance(value, str) else None


def trusted(entry: JournalEntry) -> bool:
    """Whether the system manager wrote it: `_UID=0` and `_PID=1` or `_SYSTEMD_CGROUP=/init.scope`.

    The cgroup form covers 257's helpers forked off PID 1. Only journald sets `_` fields.
    """
    return _text(entry, "_UID") == "0" and (
        _text(entry, "_PID") == "1" or _text(entry, "_SYSTEMD_CGROUP") == "/init.scope"
    )


def expect(entry: JournalEntry, line: int) -> dict[str, object]:
    """The expectation for one entry (kind None: the parser must ignore it)."""
    text = message(entry)
    out: dict[str, object] = {"line": line, "cursor": entry["__CURSOR"]}
    kind, extra = classify(entry, text)
    out["kind"] = kind
    if kind is not None:
        out["unit"] = _text(entry, "UNIT")
        out["invocation_id"] = _text(entry, "INVOCATION_ID")
        out.update(extra)
    out["trusted"] = trusted(entry)
    raw = entry.get("MESSAGE")
    shown = text if isinstance(raw, str) else f"<{type(raw).__name__}> {text}"
    out["message"] = shown[:120] + ("…" if len(shown) > 120 else "")
    return out


def classify(entry: JournalEntry, text: str) -> tuple[str | None, dict[str, object]]:
    """The lifecycle event an entry claims to be, from MESSAGE_ID or else from its text.

    Text kinds (the lines PID 1 logs without a MESSAGE_ID) need the UNIT field, which PID 1
    always sets.
    """
    simple = {
        STARTING: "starting",
        STARTED: "started",
        STOPPING: "stopping",
        STOPPED: "stopped",
        SUCCESS: "deactivated-successfully",
    }
    message_id = _text(entry, "MESSAGE_ID")
    if message_id in simple:
        return simple[message_id], {}
    if message_id == PROCESS_EXIT:
        return classify_exit(text)
    if message_id == FAILURE_RESULT:
        return "failed-with-result", {"result": _text(entry, "UNIT_RESULT")}
    if message_id == RESTART_SCHEDULED:
        n_restarts = _text(entry, "N_RESTARTS")
        return "restart-scheduled", {"n_restarts": None if n_restarts is None else int(n_restarts)}
    if message_id is not None or _text(entry, "UNIT") is None:
        return None, {}
    return classify_text(text)


def classify_exit(text: str) -> tuple[str | None, dict[str, object]]:
    """A PROCESS_EXIT entry: the main process's exit (a control process's is not an event)."""
    match = _EXIT.search(text)
    if match is None:
        return None, {}
    code, status, name = match.groups()
    signal = name if code in {"killed", "dumped"} else None
    return "main-process-exited", {"code": code, "status": int(status), "signal": signal}


_TEXT_KINDS: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("State 'stop-sigterm' timed out. Killing.", "stop-sigterm-timed-out", {"final": False}),
    ("State 'final-sigterm' timed out. Killing.", "stop-sigterm-timed-out", {"final": True}),
    (
        "Processes still around after SIGKILL. Ignoring.",
        "processes-still-around-after-SIGKILL",
        {"final": False},
    ),
    (
        "Processes still around after final SIGKILL. Entering failed mode.",
        "processes-still-around-after-SIGKILL",
        {"final": True},
    ),
    ("Start request repeated too quickly.", "start-limit-hit", {}),
)


def classify_text(text: str) -> tuple[str | None, dict[str, object]]:
    """The kinds PID 1 logs without a MESSAGE_ID, from their (version-stable) text."""
    if (left := _LEFT_OVER.search(text)) is not None:
        return "left-over-process-found", {"pid": int(left.group(1)), "comm": left.group(2)}
    for ending, kind, extra in _TEXT_KINDS:
        if text.endswith(ending):
            return kind, dict(extra)
    return None, {}


# --- recording ---------------------------------------------------------------------------------


def record(release: str, scenario: Scenario, out: Path) -> list[str]:
    """Boot, drive, dump; returns what was done (for the README)."""
    with Container(ensure_rootfs(release)) as box:
        rec = Recorder(box)
        extra = scenario.drive(rec)
        rec.steps.append("# wait 1 s more, so journald has stored everything")
        time.sleep(1)
        args = ["journalctl", "--no-pager", "-o", "json"]
        dumps = [("--all", f"{scenario.name}.jsonl")]
        if scenario.without_all:
            dumps.append(("", f"{scenario.name}.no-all.jsonl"))
        for flag, filename in dumps:
            cmd = [*args, *([flag] if flag else []), *dump_filter(extra)]
            rec.steps.append(f"{shlex.join(cmd)} > {filename}")
            raw = box.run(cmd).stdout
            (out / filename).write_text(raw)
            write_expectation(out / filename, release, raw)
    return rec.steps


def write_expectation(sample: Path, release: str, raw: str) -> None:
    """Write `<sample>.expect.json` beside the sample."""
    entries = [json.loads(line) for line in raw.splitlines()]
    document = {
        "sample": sample.name,
        "release": release,
        "systemd": RELEASES[release],
        "entries": [expect(entry, n) for n, entry in enumerate(entries, start=1)],
    }
    target = sample.with_name(sample.name.removesuffix(".jsonl") + ".expect.json")
    target.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")


_COMMON_OBSERVED = """\
* A Type=simple unit without ExecStartPre= goes from inactive straight to active: PID 1 logs
  "Started" but no "Starting" (job.c `job_perform_on_unit`); any ExecStartPre= (the gate) brings
  "Starting" back (the `-gated` sample).
* At the start limit: "Start request repeated too quickly." (no MESSAGE_ID), then `Failed with
  result 'exit-code'` (the UNIT_RESULT of the previous run, not start-limit-hit), then "Failed to
  start …" (MESSAGE_ID be02cf68…, `JOB_RESULT=failed`).
* "Found left-over process N (comm) …" is followed by a separate entry "This usually indicates …";
  both are `_PID=1` entries with `UNIT=` and the INVOCATION_ID of the new run. With ExecStartPre=
  the pair is logged twice per start: before ExecStartPre= (even before "Starting") and before
  ExecStart=.
* A process that survives SIGKILL (frozen): stop-sigterm timeout, SIGKILL, "Processes still around
  after SIGKILL. Ignoring.", final-sigterm timeout, SIGKILL, "Processes still around after final
  SIGKILL. Entering failed mode.", `Failed with result 'timeout'`, "Unit process N (python3)
  remains running after unit stopped.", "Stopped"; no "Main process exited".
* No "Consumed …" resource lines: this container runs on a cgroup v1/hybrid host without resource
  accounting.
* Forged entries keep whatever MESSAGE_ID, UNIT, N_RESTARTS, INVOCATION_ID and
  SYSLOG_IDENTIFIER=systemd the sender chose; journald drops the `_PID=1`, `_UID=0` and
  `_SYSTEMD_CGROUP=` a client sends and sets its own. Processes entered with nsenter show
  `_SYSTEMD_CGROUP=/..` (outside the container's cgroup namespace).
"""

OBSERVED: dict[str, str] = {
    "bookworm": _COMMON_OBSERVED
    + """\
* Automatic restart: "Scheduled restart job" is followed by "Stopped" (`JOB_TYPE=restart`), then
  the next run's "Started".
* The second line of the left-over warning has no "sglang.service: " prefix.
""",
    "trixie": _COMMON_OBSERVED
    + """\
* Automatic restart: no "Stopped" between "Scheduled restart job" and the next run.
* The second line of the left-over warning is prefixed "sglang.service: ".
""",
}

README_HEAD = """\
# Journal samples: {release} (systemd {version})

Recorded from a real `{version_line}` booted with `systemd-nspawn` (host: Debian 12,
systemd-nspawn 252, cgroup v1/hybrid host) by `tests/e2e/record_samples.py`, one fresh container
per sample. Re-record with:

    .venv/bin/python tests/e2e/record_samples.py --release {release}

* `<name>.jsonl`: `journalctl -o json --all` output, byte for byte as journalctl printed it (one
  object per line, every field kept). `stdout-ansi-long.no-all.jsonl` is the same journal without
  `--all`, where the 5000-byte MESSAGE is `null`; with or without `--all`, a MESSAGE with ANSI
  escapes is an array of byte values.
* Dump filter: `UNIT=sglang.service + _SYSTEMD_UNIT=sglang.service` (PID 1 about the unit, the
  unit's own output), plus `_UID=<forger>` in `forged-entries`.
* `<name>.expect.json`: for each line (`line` is 1-based, `cursor` is its `__CURSOR`): `kind` (the
  lifecycle event the entry *claims*; `null` = not an event, a parser ignores it), `unit`,
  `invocation_id`, per-kind fields (`code`/`status`/`signal`, `result`, `n_restarts`,
  `pid`/`comm`, `final`: the final-sigterm/final-sigkill variant), and `trusted` (`_UID=0`
  and `_PID=1`, or `_SYSTEMD_CGROUP=/init.scope`). `message` is for the reader only.
  Kinds: starting, started, stopping, stopped, main-process-exited, failed-with-result,
  restart-scheduled, stop-sigterm-timed-out, processes-still-around-after-SIGKILL,
  left-over-process-found, start-limit-hit, deactivated-successfully. Other PID-1 lines ("Failed
  to start", "Killing process …", "Unit process … remains running", the second line of the
  left-over warning) are `null`, as is everything the unit's own processes write.
* The unit is `sglang.service`; the unprivileged user is `forger` (uid 1000).
"""


def write_readme(release: str, version_line: str, notes: list[tuple[str, list[str]]]) -> None:
    """The README of one release directory: version, observations, per sample what was done."""
    version = RELEASES[release]
    parts = [README_HEAD.format(release=release, version=version, version_line=version_line)]
    parts.append("\nObserved in these samples:\n\n")
    parts.append(OBSERVED[release])
    for name, steps in notes:
        parts.append(f"\n## {name}\n\n{scenario_doc(name)}\n")
        parts.append("\nWhat was done (inside the container unless marked, in order):\n\n")
        parts.extend(_indent(step) for step in steps)
    (SAMPLES / release / "README.md").write_text("".join(parts))


def update_readme(release: str, notes: list[tuple[str, list[str]]]) -> None:
    """Replace (or append) the sections of the scenarios just recorded in an existing README."""
    path = SAMPLES / release / "README.md"
    text = path.read_text()
    for name, steps in notes:
        section = f"## {name}\n\n{scenario_doc(name)}\n"
        section += "\nWhat was done (inside the container unless marked, in order):\n\n"
        section += "".join(_indent(step) for step in steps)
        pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
        found = pattern.search(text)
        if found is not None:
            start, end = found.span()
            text = (text[:start] + section + "\n" + text[end:]).rstrip("\n") + "\n"
        else:
            text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def scenario_doc(name: str) -> str:
    """The scenario's docstring, on one line."""
    for scenario in SCENARIOS:
        if scenario.name == name and scenario.drive.__doc__:
            return " ".join(scenario.drive.__doc__.split())
    return ""


def iter_selected(names: Sequence[str] | None) -> Iterator[Scenario]:
    """The scenarios chosen on the command line (all by default)."""
    for scenario in SCENARIOS:
        if not names or scenario.name in names:
            yield scenario


def main(argv: Sequence[str] | None = None) -> int:
    """Record the chosen scenarios for the chosen releases."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--release", nargs="+", choices=sorted(RELEASES), default=list(RELEASES))
    parser.add_argument("--scenario", nargs="+", choices=[s.name for s in SCENARIOS])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for release in args.release:
        out = SAMPLES / release
        out.mkdir(parents=True, exist_ok=True)
        notes = []
        version_line = ""
        for scenario in iter_selected(args.scenario):
            LOG.info("%s: recording %s", release, scenario.name)
            notes.append((scenario.name, record(release, scenario, out)))
        with Container(ensure_rootfs(release)) as box:
            version_line = box.run(["systemctl", "--version"]).stdout.splitlines()[0]
        if args.scenario:
            update_readme(release, notes)
            LOG.info("%s: README.md: only the recorded scenarios' sections rewritten", release)
        else:
            write_readme(release, version_line, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
