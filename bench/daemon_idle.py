#!/usr/bin/env python3
"""Benchmark: what the daemon costs while the unit it watches is idle.

Runs the real daemon (``python -m gpuguard run``) over the fake NVML (tests/fakenvml) and a real
journal directory written by ``systemd-journal-remote`` from tests/journal_samples, next to the
baseline, ``journalctl --follow -u UNIT -o json`` alone over the same journal, for ``--seconds``
(default 600). While both run, an idle server's health-check request lines are appended now
and then (``--append-every``), so both journalctls wake the way they would on a live host.
Sampled from /proc: RSS (VmRSS; VmHWM for the peak) and CPU seconds (utime+stime, with the
children's: the daemon's journalctl processes, live ones and reaped ones).

There is no running journald here, and ``gpuguard run`` takes no journalctl prefix, so the daemon
finds ``journalctl`` through PATH, where a two-line wrapper execs ``/usr/bin/journalctl
--directory=<bench journal> "$@"``: a test double for the journal's location only.

The provenance ledger is on: the watched unit runs (a ``systemctl`` double bound over
/usr/bin/systemctl answers ``show`` with an active unit whose ``ControlGroup`` is a real cgroup
v2 directory of the bench), with a served tree in it: a server process and four TP workers of
8 threads each, every worker moved into its own ``tp-worker-N.scope`` cgroup (the escape shape
of issue 22). The daemon records that tree at start, 1, 2, 4, 8, 16 s later and then every
``daemon.ledger_every_s``; the report says what its ledger file holds at the end.

As under ``gpuguard.service`` (``WatchdogSec=30``), the daemon gets ``WATCHDOG_USEC`` and a
``NOTIFY_SOCKET`` (a datagram socket of the bench, read as systemd would): its watchdog pings
are its most frequent wakes, and the report counts them and their longest gap. Wakes are the
main thread's voluntary context switches (``/proc/PID/task/PID/status``): each sleep it woke
from, and each wait on a child (the NVML worker, a ``systemctl``).

``--health`` runs a second daemon of this checkout beside the first, the same but for a health
check of the unit (``health_url``, every 10 s) against a loopback HTTP server of the bench, and
prints its CPU per hour, the ratio and the difference to the first (target: < 1 s/hour more).
The journal then also holds the served run's start and ready line (liveness probes only a run
that is up). ``--health-first`` starts that daemon first.

Targets (bench/README.md): daemon idle < 60 MB RSS and < 1 s CPU per hour (with its journalctl
children); the exit status is 1 when either is missed, the watchdog went 30 s without a ping or
the daemon did not exit 0 on SIGTERM.
Run: ``make bench [IDLE_SECONDS=120]`` or ``.venv/bin/python bench/daemon_idle.py [--seconds N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import itertools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))

from fakestate import fake_library, nvml_environ, write_state  # noqa: E402 - found through the path set above

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

Entry = dict[str, object]

SAMPLES = TESTS / "journal_samples"
JOURNAL_REMOTE = Path("/lib/systemd/systemd-journal-remote")
JOURNALCTL = "/usr/bin/journalctl"
SYSTEMCTL = "/usr/bin/systemctl"
BENCH_SLICE = "gpuguard-bench{}-{}.slice"
"""Its served unit's cgroups: the daemon's suffix, and this run's own tag, so that two benches
at once (another checkout's) never share a cgroup and each daemon sees its own tree only."""
RUN_TAG = os.urandom(4).hex()
SERVING = "5e7f1a2b3c4d5e6f708192a3b4c5d6e7"
WORKERS = 4
# The served tree: a server whose four workers each run 8 threads, then sleep (no CPU).
TREE = """
import subprocess, sys, threading, time
if sys.argv[1:] == ["worker"]:
    for _ in range(7):
        threading.Thread(target=time.sleep, args=(10**6,), daemon=True).start()
    print("ready", flush=True)
    time.sleep(10**6)
workers = [subprocess.Popen([sys.executable, "-c", sys.argv[1], "worker"], stdout=subprocess.PIPE)
           for _ in range(4)]
for w in workers:
    w.stdout.readline()
print(" ".join(str(w.pid) for w in workers), flush=True)
time.sleep(10**6)
"""
UNIT = "sglang.service"
BOOT = "d4e1d1e0b3c74f6a9e2d5c8b7a6f5e4d"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = 1024
MB = 1_000_000
RSS_TARGET_MB = 60
CPU_TARGET_S_PER_HOUR = 1.0
WATCHDOG_USEC = 30_000_000  # gpuguard.service's WatchdogSec=30: a WATCHDOG=1 due every 15 s


# --- the journal ---------------------------------------------------------------------------------


def export_format(entries: Iterable[Entry]) -> bytes:
    """The journal export format of ``entries`` (binary form for values with control bytes)."""
    out = bytearray()
    for entry in entries:
        for name, value in entry.items():
            if name in {"__CURSOR", "__SEQNUM", "__SEQNUM_ID"} or value is None:
                continue
            data = bytes(value) if isinstance(value, list) else str(value).encode()
            if all(32 <= byte < 127 or byte >= 128 for byte in data):
                out += name.encode() + b"=" + data + b"\n"
            else:
                out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        out += b"\n"
    return bytes(out)


class BenchJournal:
    """Real journal files in a directory, on one boot that began an hour ago."""

    def __init__(self, directory: Path, release: str) -> None:
        """An empty journal directory; shapes from the ``release`` samples."""
        directory.mkdir()
        self.directory = directory
        self.boot_us = int((time.time() - 3600) * 1e6)
        lines = (SAMPLES / release / "clean-start-stop.jsonl").read_text().splitlines()
        self.history = [json.loads(line) for line in lines]
        self.output = next(
            e
            for e in self.history
            if e.get("_SYSTEMD_UNIT") == UNIT and e.get("_TRANSPORT") == "stdout"
        )
        self.appended = 0

    def _timed(self, entry: Entry, realtime_us: int) -> Entry:
        return {
            **entry,
            "_BOOT_ID": BOOT,
            "__REALTIME_TIMESTAMP": str(realtime_us),
            "__MONOTONIC_TIMESTAMP": str(realtime_us - self.boot_us),
        }

    def write(self, entries: Sequence[Entry]) -> None:
        """Append ``entries`` (through systemd-journal-remote, into the same file)."""
        subprocess.run(
            [str(JOURNAL_REMOTE), f"--output={self.directory}/remote.journal", "-"],
            input=export_format(entries),
            capture_output=True,
            check=True,
            timeout=60,
        )
        self.appended += len(entries)

    def seed(self) -> None:
        """The recorded clean start and stop of the unit, two minutes ago (in the replay window)."""
        first = int(str(self.history[0]["__REALTIME_TIMESTAMP"]))
        start = int((time.time() - 120) * 1e6)
        self.write(
            [
                self._timed(e, start + int(str(e["__REALTIME_TIMESTAMP"])) - first)
                for e in self.history
            ]
        )

    def came_up(self) -> None:
        """The served run's start and ready line, a minute ago: a run that is up (``--health``).

        Its invocation is the one the systemctl double answers; liveness replays it as up, so
        the daemon's health check probes it.
        """
        starting, started = self.history[0], self.history[1]
        ready = {**self.output, "MESSAGE": "The server is fired up and ready to roll!"}
        start = int((time.time() - 60) * 1e6)
        self.write(
            [
                self._timed({**e, "INVOCATION_ID": SERVING, "_SYSTEMD_INVOCATION_ID": SERVING}, t)
                for e, t in ((starting, start), (started, start + 1000), (ready, start + 2000))
            ]
        )

    def health_checks(self, count: int) -> None:
        """``count`` request-log lines of an idle server (a load balancer's health checks)."""
        now = int(time.time() * 1e6)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now / 1e6))
        self.write(
            [
                self._timed(
                    {
                        **self.output,
                        "_COMM": "python3",
                        "SYSLOG_IDENTIFIER": "python3",
                        "MESSAGE": f'[{stamp}] INFO:     10.0.0.{n}:{41000 + n} - "GET /health '
                        'HTTP/1.1" 200 OK',
                    },
                    now + n,
                )
                for n in range(count)
            ]
        )


# --- /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """One process and its live children at one moment; CPU in seconds, cumulative.

    ``*_ticks_s`` are utime+stime from /proc/PID/stat (10 ms ticks, as ``ps`` shows them);
    ``*_sched_s`` are on-CPU time from /proc/PID/schedstat (nanoseconds). Children reaped by the
    process (cutime+cstime, ticks only) are in both ``tree_*`` values.
    """

    rss_kib: int  # VmRSS of the process and its live children
    own_rss_kib: int  # VmRSS of the process alone
    own_hwm_kib: int  # VmHWM (peak RSS) of the process alone
    own_ticks_s: float
    own_sched_s: float
    tree_ticks_s: float
    tree_sched_s: float
    children: int
    wakes: int  # voluntary context switches of the main thread: each sleep it woke from


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def _status_field(pid: int, key: str, path: str | None = None) -> int:
    for line in Path(path or f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0  # a zombie has no VmRSS


def _ticks_s(fields: Sequence[str]) -> tuple[float, float]:
    """(utime+stime, cutime+cstime): fields 14-17 of /proc/PID/stat, in seconds."""
    return (
        (int(fields[11]) + int(fields[12])) / CLK_TCK,
        (int(fields[13]) + int(fields[14])) / CLK_TCK,
    )


def _sched_s(pid: int) -> float:
    """On-CPU time of ``pid`` (the first field of /proc/PID/schedstat, ns) in seconds."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def children_of(pid: int) -> list[int]:
    """Live children of ``pid`` (by their parent PID in /proc/N/stat)."""
    found = []
    for path in Path("/proc").iterdir():
        if not path.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(_stat_fields(int(path.name))[1]) == pid:
                found.append(int(path.name))
    return found


def usage(pid: int) -> Usage:
    """RSS and cumulative CPU of ``pid`` and its children (one level: journalctl has none)."""
    own_rss = _status_field(pid, "VmRSS")
    own_ticks, reaped = _ticks_s(_stat_fields(pid))
    own_sched = _sched_s(pid)
    rss, tree_ticks, tree_sched = own_rss, own_ticks + reaped, own_sched + reaped
    kids = children_of(pid)
    for child in kids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            ticks, its_reaped = _ticks_s(_stat_fields(child))
            sched = _sched_s(child)
            kib = _status_field(child, "VmRSS")
            tree_ticks += ticks + its_reaped
            tree_sched += sched + its_reaped
            rss += kib
    return Usage(
        wakes=_status_field(pid, "voluntary_ctxt_switches", f"/proc/{pid}/task/{pid}/status"),
        rss_kib=rss,
        own_rss_kib=own_rss,
        own_hwm_kib=_status_field(pid, "VmHWM"),
        own_ticks_s=own_ticks,
        own_sched_s=own_sched,
        tree_ticks_s=tree_ticks,
        tree_sched_s=tree_sched,
        children=len(kids),
    )


@dataclass
class Series:
    """Samples of one process tree."""

    samples: list[tuple[float, Usage]] = field(default_factory=list)

    def add(self, at: float, pid: int) -> None:
        """Take one sample."""
        self.samples.append((at, usage(pid)))

    @property
    def first(self) -> Usage:
        """The sample at ready."""
        return self.samples[0][1]

    @property
    def last(self) -> Usage:
        """The final sample."""
        return self.samples[-1][1]

    def span_s(self) -> float:
        """Seconds between the first and the last sample."""
        return self.samples[-1][0] - self.samples[0][0]

    def peak_kib(self, *, own: bool) -> int:
        """The highest RSS: VmHWM for the process alone, sampled VmRSS for the tree."""
        if own:
            return max(self.last.own_hwm_kib, *(u.own_rss_kib for _, u in self.samples))
        return max(u.rss_kib for _, u in self.samples)

    def final_kib(self, *, own: bool) -> int:
        """The last sampled RSS."""
        return self.last.own_rss_kib if own else self.last.rss_kib

    def idle_ticks_s(self, *, own: bool) -> float:
        """utime+stime spent between the first and the last sample."""
        if own:
            return self.last.own_ticks_s - self.first.own_ticks_s
        return self.last.tree_ticks_s - self.first.tree_ticks_s

    def idle_sched_s(self, *, own: bool) -> float:
        """On-CPU time spent between the first and the last sample."""
        if own:
            return self.last.own_sched_s - self.first.own_sched_s
        return self.last.tree_sched_s - self.first.tree_sched_s

    def wakes_per_minute(self) -> float:
        """How often the main thread woke from a sleep, per minute of the span."""
        span = self.span_s()
        return (self.last.wakes - self.first.wakes) / span * 60 if span > 0 else 0.0

    def per_hour(self, *, own: bool) -> float:
        """Idle on-CPU seconds extrapolated to an hour."""
        span = self.span_s()
        return self.idle_sched_s(own=own) / span * 3600 if span > 0 else 0.0


# --- sd_notify --------------------------------------------------------------------------------


class NotifyListener:
    """The daemon's ``NOTIFY_SOCKET``, as systemd's: counts its WATCHDOG=1 and STATUS= lines."""

    def __init__(self, path: Path) -> None:
        """Bind a datagram socket at ``path``."""
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.setblocking(False)  # noqa: FBT003 - socket's own API
        self.pings: list[float] = []
        self.statuses = 0

    def drain(self) -> None:
        """Take every message waiting, stamping each ping with the moment it was read."""
        while True:
            try:
                message = self._sock.recv(4096)
            except BlockingIOError:
                return
            now = time.monotonic()
            for line in message.split(b"\n"):
                if line == b"WATCHDOG=1":
                    self.pings.append(now)
                elif line.startswith(b"STATUS="):
                    self.statuses += 1

    def longest_gap_s(self, since: float, until: float) -> float:
        """The longest time without a ping between ``since`` and ``until`` (as often as read)."""
        times = [since, *(t for t in self.pings if since <= t <= until), until]
        return max(b - a for a, b in itertools.pairwise(times))

    def close(self) -> None:
        """Close the socket."""
        self._sock.close()


# --- running it ----------------------------------------------------------------------------------


def mb(kib: int) -> str:
    """KiB as MB (10^6 bytes), the unit of the target."""
    return f"{kib * 1024 / MB:6.1f} MB"


def write_config(root: Path, nvml_state: Path) -> Path:
    """A configuration for the daemon: the fake devices, state in ``root``, one watched unit.

    Metrics on: the textfile goes to a directory of ``root`` (as node_exporter's would).
    """
    config = root / "gpuguard.toml"
    (root / "node-exporter").mkdir(mode=0o755)
    config.write_text(
        "allow_plain_device_files = true\n"
        f'nvml_library = "{fake_library()}"\n'
        f'device_glob = "{nvml_state}/dev/nvidia*"\n'
        f'state_dir = "{root}/state"\n'
        f'runtime_dir = "{root}/run"\n'
        "[metrics]\n"
        f'textfile = "{root}/node-exporter/gpuguard.prom"\n'
        f'[units."{UNIT}"]\n'
    )
    return config


def cgroup2() -> Path:
    """The cgroup v2 mount: /sys/fs/cgroup, or a hybrid host's unified hierarchy."""
    unified = Path("/sys/fs/cgroup/unified")
    return unified if (unified / "cgroup.procs").exists() else Path("/sys/fs/cgroup")


@dataclass
class ServedUnit:
    """The watched unit's processes in real cgroups: the server in the unit's, workers out."""

    server: subprocess.Popen[bytes]
    workers: list[int]
    cgroups: list[Path]

    @classmethod
    def start(cls, bench_slice: str) -> ServedUnit:
        """Spawn the tree and move it: server into the unit's cgroup, each worker into a scope."""
        base = cgroup2() / bench_slice
        unit = base / UNIT
        scopes = [base / f"tp-worker-{rank}.scope" for rank in range(WORKERS)]
        for path in (base, unit, *scopes):
            path.mkdir(exist_ok=True)
        server = subprocess.Popen(
            [sys.executable, "-c", TREE, TREE], stdout=subprocess.PIPE, start_new_session=True
        )
        assert server.stdout is not None  # noqa: S101 - a PIPE
        workers = [int(pid) for pid in server.stdout.readline().split()]
        (unit / "cgroup.procs").write_text(f"{server.pid}\n")
        for pid, scope in zip(workers, scopes, strict=True):
            (scope / "cgroup.procs").write_text(f"{pid}\n")
        return cls(server, workers, [*scopes, unit, base])

    def stop(self) -> None:
        """Kill the tree, then remove the cgroups."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
        for path in self.cgroups:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    path.rmdir()
                    break
                time.sleep(0.1)


def systemctl_double(root: Path, bench_slice: str) -> Path:
    """A ``systemctl`` whose ``show`` says the unit is active in the bench's cgroup."""
    wrapper = root / "bin" / "systemctl"
    properties = "\n".join(
        [
            "LoadState=loaded",
            "ActiveState=active",
            "SubState=running",
            f"InvocationID={SERVING}",
            f"ControlGroup=/{bench_slice}/{UNIT}",
            "NRestarts=0",
        ]
    )
    wrapper.write_text(f"#!/bin/sh\n[ \"$1\" = show ] && printf '%s\\n' '{properties}'\nexit 0\n")
    wrapper.chmod(0o755)
    return wrapper


def ledger_line(path: Path, served: ServedUnit) -> str:
    """What the daemon's ledger file holds at the end, in one line."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return "no ledger file"
    runs = document.get("runs") or []
    pids = {p[0] for run in runs for p in run.get("processes", [])}
    moved = sum(pid in pids for pid in served.workers)
    return (
        f"{len(runs)} run(s), {len(pids)} processes recorded, {moved} of the {WORKERS} workers "
        "that sit in their own scopes"
    )


def journalctl_wrapper(root: Path, journal: Path) -> Path:
    """A ``journalctl`` that runs a copy of the real one, pointed at the bench journal.

    gpuguard runs /usr/bin/journalctl by absolute path, never through PATH, so the daemon runs
    in a private mount namespace with this wrapper bound over /usr/bin/journalctl (see main).
    """
    bin_dir = root / "bin"
    bin_dir.mkdir()
    real = bin_dir / "journalctl.real"
    shutil.copy2(JOURNALCTL, real)
    wrapper = bin_dir / "journalctl"
    wrapper.write_text(f'#!/bin/sh\nexec {real} --directory="{journal}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def following(pid: int) -> int:
    """How many of ``pid``'s children are a ``journalctl --follow`` (history replay done)."""
    count = 0
    for child in children_of(pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            count += b"--follow" in argv
    return count


def wait_ready(snapshot: Path, daemon: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the daemon has said ready and all its journal streams follow live.

    The snapshot's journal state is the worst of its streams' (lifecycle, output, kernel):
    "attached" once every one follows; and at least two journalctl follow.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"the daemon exited with status {daemon.returncode} before ready")
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            document = json.loads(snapshot.read_text())
            attached = document["journal"]["state"] == "attached"
            if document.get("ready") and attached and following(daemon.pid) >= 2:
                return
        time.sleep(0.05)
    raise SystemExit(f"the daemon was not ready with its journal attached within {timeout_s} s")


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL after 10 s; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def log_summary(log: Path) -> tuple[int, list[str]]:
    """(lines, the warning and error events) of the daemon's JSON log."""
    lines = log.read_text(errors="replace").splitlines()
    worse = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("level") in {"warning", "error"}:
                worse.append(f"{record.get('level')}: {record.get('event')}")
    return len(lines), worse


def report(  # noqa: PLR0913 - the pieces of one report, passed once
    out: TextIO,
    *,
    args: argparse.Namespace,
    daemon: Series,
    baseline: Series,
    startup: tuple[float, float],
    appended: int,
) -> None:
    """Print the table and the ratios."""
    startup_s, startup_cpu = startup
    print(
        f"daemon idle: gpuguard run watching {UNIT} (serving, idle; ledger on) next to "
        "journalctl --follow alone, "
        f"{daemon.span_s():.0f} s after ready, sampled every {args.sample_every:g} s; "
        f"{appended} health-check lines appended (every {args.append_every:g} s); "
        f"{os.cpu_count()} CPUs",
        file=out,
    )
    print(
        "  journal: real files written by systemd-journal-remote; the daemon's journalctl is "
        "/usr/bin/journalctl behind a PATH wrapper adding --directory= (a test double for the "
        "journal's location only)",
        file=out,
    )
    print(
        f"  daemon start-up to ready with both journal streams following: {startup_s:.2f} s, "
        f"{startup_cpu:.2f} CPU s (imports, NVML, history replay; not in the idle figures)",
        file=out,
    )
    print(
        f"  {'':34} {'RSS peak':>9} {'RSS final':>9} {'CPU idle':>9} {'(ticks)':>8}"
        f" {'CPU/hour':>9}",
        file=out,
    )
    rows = [
        ("gpuguard run (the Python process)", daemon, True),
        (f"gpuguard run + its {daemon.last.children} journalctl", daemon, False),
        ("journalctl --follow alone", baseline, False),
    ]
    for name, series, own in rows:
        print(
            f"  {name:<34} {mb(series.peak_kib(own=own))} {mb(series.final_kib(own=own))} "
            f"{series.idle_sched_s(own=own):7.3f} s {series.idle_ticks_s(own=own):6.2f} s "
            f"{series.per_hour(own=own):7.3f} s",
            file=out,
        )
    print(
        "  (CPU idle: on-CPU time from /proc/PID/schedstat; ticks: utime+stime from "
        f"/proc/PID/stat, {1 / CLK_TCK:g} s resolution; CPU/hour: CPU idle extrapolated)",
        file=out,
    )
    base_hour = max(baseline.per_hour(own=False), 1e-6)
    print(
        f"  daemon + journalctl RSS = {daemon.last.rss_kib / max(1, baseline.last.rss_kib):.1f}x"
        f" journalctl alone; CPU per hour = {daemon.per_hour(own=False) / base_hour:,.0f}x "
        f"journalctl alone ({daemon.per_hour(own=False):.3f} s vs "
        f"{baseline.per_hour(own=False):.3f} s)",
        file=out,
    )
    rss = daemon.peak_kib(own=True) * 1024
    hour = daemon.per_hour(own=False)
    print(
        f"  wakes: the daemon's main thread woke {daemon.wakes_per_minute():.1f} times a minute",
        file=out,
    )
    print(
        f"  targets: daemon RSS peak {rss / MB:.1f} MB < {RSS_TARGET_MB} MB: "
        f"{'met' if rss < RSS_TARGET_MB * MB else 'MISSED'}; CPU {hour:.2f} s/hour (with its "
        f"journalctl) < {CPU_TARGET_S_PER_HOUR:g} s: "
        f"{'met' if hour < CPU_TARGET_S_PER_HOUR else 'MISSED'}",
        file=out,
    )
    print(
        f"  over the whole run (start-up included): daemon + journalctl "
        f"{daemon.last.tree_sched_s:.2f} CPU s, journalctl alone "
        f"{baseline.last.tree_sched_s:.2f} CPU s",
        file=out,
    )


@dataclass
class Launched:
    """One daemon of the bench: its directory, served unit, notify socket, process, samples."""

    root: Path
    argv: list[str]
    env: dict[str, str]
    served: ServedUnit
    notify: NotifyListener
    log: Path
    series: Series = field(default_factory=Series)
    daemon: subprocess.Popen[bytes] = field(init=False)
    health: HealthServer | None = None
    """The loopback server its health check asks (``--health``); stopped with it."""

    @classmethod
    def start(  # noqa: PLR0913 - the pieces of one daemon's world, passed once
        cls,
        root: Path,
        journal: BenchJournal,
        env: dict[str, str],
        nvml_state: Path,
        *,
        suffix: str,
        pythonpath: str | None = None,
        unit_lines: str = "",
    ) -> Launched:
        """Its directory, served unit and notify socket, ready to spawn."""
        root.mkdir(exist_ok=True)
        bench_slice = BENCH_SLICE.format(suffix, RUN_TAG)
        notify = NotifyListener(root / "notify.sock")
        env = env | {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        wrapper = journalctl_wrapper(root, journal.directory)
        binds = f"mount --bind {wrapper} {JOURNALCTL} && "
        binds += f"mount --bind {systemctl_double(root, bench_slice)} {SYSTEMCTL} && "
        # unshare without --fork execs in place: the daemon keeps the PID the bench watches.
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c"]
        argv += [f'{binds}exec "$@"', "sh"]
        config = write_config(root, nvml_state)
        config.write_text(config.read_text() + unit_lines)  # the [units."UNIT"] section is last
        argv += [sys.executable, "-m", "gpuguard", "--config", str(config)]
        return cls(root, [*argv, "run"], env, ServedUnit.start(bench_slice), notify, root / "log")

    def spawn(self) -> None:
        """Start the daemon, its log to a file."""
        with self.log.open("wb") as out:
            self.daemon = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )

    def sample(self, now: float) -> None:
        """One sample, and what it said to systemd meanwhile."""
        self.series.add(now, self.daemon.pid)
        self.notify.drain()
        if self.daemon.poll() is not None:
            raise SystemExit(f"the daemon in {self.root} exited early")

    def stop(self) -> int | None:
        """SIGTERM it, remove its unit; its exit status (None: never started)."""
        status = stop(self.daemon) if hasattr(self, "daemon") else None
        self.served.stop()
        self.notify.close()
        if self.health is not None:
            self.health.close()
        return status


def measure(
    args: argparse.Namespace,
    journal: BenchJournal,
    daemons: Sequence[Launched],
    baseline: tuple[subprocess.Popen[bytes], Series],
) -> None:
    """Sample every daemon and the baseline for ``args.seconds``, appending to the journal."""
    process, series = baseline
    began = time.monotonic()
    next_append = began + args.append_every if args.append_every > 0 else None
    while True:
        now = time.monotonic()
        for launched in daemons:
            launched.sample(now)
        series.add(now, process.pid)
        if process.poll() is not None:
            raise SystemExit("the baseline journalctl exited early")
        if now - began >= args.seconds:
            return
        if next_append is not None and now >= next_append:
            journal.health_checks(args.append_lines)
            next_append += args.append_every
        time.sleep(min(args.sample_every, max(0.0, began + args.seconds - now)))


def met(daemon: Series) -> bool:
    """Whether both targets are met: the daemon's peak RSS and its CPU per hour (children too)."""
    rss_ok = daemon.peak_kib(own=True) * 1024 < RSS_TARGET_MB * MB
    return rss_ok and daemon.per_hour(own=False) < CPU_TARGET_S_PER_HOUR


def main() -> int:  # noqa: PLR0915 - set up, run, tear down, in order
    """Set up the fake host and the journal, run both, sample, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600, help="idle time measured")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument(
        "--append-every", type=float, default=60.0, help="seconds between appends (0: never)"
    )
    parser.add_argument("--append-lines", type=int, default=10)
    parser.add_argument("--release", choices=("bookworm", "trixie"), default="bookworm")
    parser.add_argument("--keep-log", type=Path, help="copy the daemon's log here")
    parser.add_argument(
        "--against",
        metavar="SRC",
        help="also run, side by side, the daemon of another checkout's src/ (e.g. main's)",
    )
    parser.add_argument(
        "--health",
        action="store_true",
        help="also run, side by side, this checkout's daemon with a health check every "
        f"{HEALTH_EVERY_S:g} s of the unit against a loopback HTTP server of the bench",
    )
    parser.add_argument(
        "--health-first",
        action="store_true",
        help="with --health: start the daemon with the health check first (the first one "
        "started costs more on a loaded host: swap to read the difference both ways)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (the daemon runs in a private mount namespace)", file=sys.stderr)
        return 2
    if not JOURNAL_REMOTE.exists() or not Path(JOURNALCTL).exists():
        print(
            "needs journalctl and systemd-journal-remote (apt-get install systemd-journal-remote)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        root = Path(tmp)
        nvml_state = write_state(root / "nvml")
        journal = BenchJournal(root / "journal", args.release)
        journal.seed()
        if args.health:
            journal.came_up()
        env = nvml_environ(nvml_state)
        env.pop("WATCHDOG_PID", None)
        ours = Launched.start(root, journal, env, nvml_state, suffix="")
        other = (
            Launched.start(
                root / "against", journal, env, nvml_state, suffix="-a", pythonpath=args.against
            )
            if args.against
            else None
        )
        checked = start_checked(root / "health", journal, env, nvml_state) if args.health else None
        baseline_argv = [JOURNALCTL, f"--directory={journal.directory}", "--follow"]
        baseline_argv += ["--output=json", "--all", f"--unit={UNIT}"]
        daemons = spawn_order(ours, other, checked, health_first=args.health_first)
        try:
            started = time.monotonic()
            for launched in daemons:
                launched.spawn()
            baseline = subprocess.Popen(
                baseline_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                for launched in daemons:
                    wait_ready(launched.root / "run" / "daemon.json", launched.daemon, 60)
                startup = (time.monotonic() - started, usage(ours.daemon.pid).tree_sched_s)
                baseline_series = Series()
                began = time.monotonic()
                measure(args, journal, daemons, (baseline, baseline_series))
                ended = time.monotonic()
                for launched in daemons:
                    launched.notify.drain()
                snapshot = json.loads((root / "run" / "daemon.json").read_text())
                metrics = (root / "node-exporter" / "gpuguard.prom").read_text()
                ledger = ledger_line(root / "run" / "ledger.json", ours.served)
            finally:
                stop(baseline)
        finally:
            statuses = {id(launched): launched.stop() for launched in daemons}
        status = statuses[id(ours)]
        lines, worse = log_summary(ours.log)
        if args.keep_log:
            shutil.copy(ours.log, args.keep_log)
    daemon_series, notify = ours.series, ours.notify
    report(
        sys.stdout,
        args=args,
        daemon=daemon_series,
        baseline=baseline_series,
        startup=startup,
        appended=journal.appended - len(journal.history),
    )
    pings = [t for t in notify.pings if t >= began]
    gap = notify.longest_gap_s(began, ended)
    print(
        f"  sd_notify (WATCHDOG_USEC={WATCHDOG_USEC}, as gpuguard.service): {len(pings)} "
        f"WATCHDOG=1 in {daemon_series.span_s():.0f} s, longest gap "
        f"{gap:.0f} s (read every {args.sample_every:g} s; systemd's "
        f"limit {WATCHDOG_USEC / 1e6:g} s); {notify.statuses} STATUS= lines in all"
    )
    print(
        f"  daemon: journal {snapshot['journal']['state']} at the end, exit status {status} on "
        f"SIGTERM, {lines} log lines, warnings/errors: {worse or 'none'}"
    )
    print(f"  ledger on: {ledger}")
    print(
        f"  metrics on: textfile of {len(metrics.splitlines())} lines, "
        f"{sum(line.startswith('gpuguard_') for line in metrics.splitlines())} samples"
    )
    if other is not None:
        side_by_side(args.against, other, began, statuses[id(other)], daemon_series)
    if checked is not None:
        with_health(checked, statuses[id(checked)], daemon_series)
    missed = not met(daemon_series) or gap >= WATCHDOG_USEC / 1e6
    return 1 if missed or status != 0 else 0


def side_by_side(
    against: str, other: Launched, began: float, status: int | None, ours: Series
) -> None:
    """The other checkout's row, and the ratio of this one's CPU to it."""
    theirs = other.series
    print(
        f"  side by side, same journal, same load: {against}: "
        f"{mb(theirs.peak_kib(own=True))} peak, {theirs.per_hour(own=False):.3f} CPU s/hour, "
        f"{theirs.wakes_per_minute():.1f} wakes a minute, "
        f"{len([t for t in other.notify.pings if t >= began])} WATCHDOG=1, exit status "
        f"{status}; this checkout's CPU = "
        f"{ours.per_hour(own=False) / max(theirs.per_hour(own=False), 1e-6):.2f}x that"
    )


HEALTH_EVERY_S = 10.0


class HealthServer:
    """The bench's loopback HTTP server: 200 to every ``GET /health``, counted (``--health``)."""

    def __init__(self, server: http.server.HTTPServer) -> None:
        """Serve ``server`` from a thread until ``close``."""
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()

    @classmethod
    def start(cls) -> HealthServer:
        """Listen on 127.0.0.1, a free port."""
        answered = [0]

        class Healthy(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answered[0] += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                """Quiet: the bench prints the count."""

        made = cls(http.server.HTTPServer(("127.0.0.1", 0), Healthy))
        made.answered = answered
        return made

    answered: list[int]

    def unit_lines(self) -> str:
        """The unit's health keys, for the checked daemon's configuration."""
        port = self.server.server_address[1]
        return f'health_url = "http://127.0.0.1:{port}/health"\nhealth_every_s = {HEALTH_EVERY_S}\n'

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def spawn_order(
    ours: Launched, other: Launched | None, checked: Launched | None, *, health_first: bool
) -> list[Launched]:
    """The daemons in the order they start: this checkout's first, unless ``health_first``."""
    daemons = [ours, *([other] if other else [])]
    if checked is None:
        return daemons
    return [checked, *daemons] if health_first else [*daemons, checked]


def start_checked(
    root: Path, journal: BenchJournal, env: dict[str, str], nvml_state: Path
) -> Launched:
    """The checkout's daemon again, with a health check of the unit against the bench's server."""
    health = HealthServer.start()
    checked = Launched.start(
        root, journal, env, nvml_state, suffix="-h", unit_lines=health.unit_lines()
    )
    checked.health = health
    return checked


def with_health(checked: Launched, status: int | None, ours: Series) -> None:
    """The daemon with a health check, against the same daemon without it, side by side."""
    theirs, health = checked.series, checked.health
    assert health is not None  # noqa: S101 - start_checked gave it one
    without, with_check = ours.per_hour(own=False), theirs.per_hour(own=False)
    print(
        f"  side by side, same journal, same load: with a health check every "
        f"{HEALTH_EVERY_S:g} s ({health.answered[0]} probes answered): "
        f"{mb(theirs.peak_kib(own=True))} peak, {with_check:.3f} CPU s/hour, "
        f"{theirs.wakes_per_minute():.1f} wakes a minute, exit status {status}; without: "
        f"{without:.3f} CPU s/hour; ratio {with_check / max(without, 1e-6):.2f}x, difference "
        f"{with_check - without:+.3f} CPU s/hour (target < +{CPU_TARGET_S_PER_HOUR:g}: "
        f"{'met' if with_check - without < CPU_TARGET_S_PER_HOUR else 'MISSED'})"
    )


if __name__ == "__main__":
    sys.exit(main())
