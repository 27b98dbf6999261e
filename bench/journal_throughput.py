#!/usr/bin/env python3
"""Benchmark: journal throughput, and how much request-log noise reaches Python at all.

An inference server logs a line per batch and per request; the daemon must not pay for them.
This builds a stream shaped like recorded ``journalctl -o json --all`` output (the field sets of
tests/journal_samples): 99% SGLang request-log noise (``Decode batch.``/``Prefill batch.`` lines,
uvicorn request lines) from ``sglang.service`` on ``_TRANSPORT=stdout``, 1% PID-1 lifecycle
entries about the unit, and one CUDA out-of-memory line per 100,000 entries. Then, in one run:

1. Python parse rate on one core: ``json.loads`` + ``events.parse_entry`` per line, over the
   entries that reach Python (lifecycle + OOM lines), the same through the daemon's whole path
   (``JournalFollower`` fed by ``cat``, ``commit`` per batch), and over the whole stream (what
   an unfiltered reader would parse). Target (bench/README.md): >= 100,000 entries/s.
2. Filtering in journalctl: the same entries written into a real journal by
   ``systemd-journal-remote``, read by gpuguard's ``JournalFollower`` with its exact argv (the
   lifecycle matches, and the output stream with ``--grep`` on ``GPU_OOM_PATTERNS``) through
   ``journalctl --directory=``; what reaches Python is counted against the total, and each
   journalctl is timed alone. Baseline: the same journal read unfiltered (``journalctl -o json
   --all``, same window) and parsed in Python. Both must yield the same events. Then live:
   more entries appended while the follower's ``--follow`` runs are attached, against
   ``journalctl --follow -o json --all`` parsed in Python.

CPU seconds are user+system of this process (of the reading thread where a writer thread runs
beside it) and of its journalctl children (rusage once reaped, /proc/PID/schedstat while live).
Run: ``make bench`` or ``.venv/bin/python bench/journal_throughput.py [--entries N]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.adapters.journal import LIFECYCLE, JournalFollower
from gpuguard.core.events import FIELDS_READ, GPU_OOM_PATTERNS, EventKind, UnitEvent, parse_entry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from journalwait import poll

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

Entry = dict[str, object]

SAMPLES = Path(__file__).resolve().parent.parent / "tests" / "journal_samples"
JOURNAL_REMOTE = Path("/lib/systemd/systemd-journal-remote")
UNIT = "sglang.service"
BOOT = "5e1f0a7c9b2d4e6f8a1b3c5d7e9f0a2b"
SEQNUM_ID = "0c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f"
T0_US = 1_795_000_000_000_000  # 2026-11-18: the first entry's realtime, µs since the epoch
MONO0_US = 600_000_000  # ten minutes after boot
STEP_US = 1000  # one entry per millisecond: 1,000,000 entries span 16.7 minutes
EVERY = 100  # one entry in EVERY is not noise
OOM_EVERY = 1000  # of those, one in OOM_EVERY is a CUDA OOM line (10 in 1,000,000)
CHUNK = 10_000
PARSE_TARGET = 100_000
OOM_MESSAGE = (
    "[2026-11-18 13:40:12 TP0] Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of "
    "memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which "
    "1.06 GiB is free."
)
# Varying fields of a noise line, replaced in its serialised template.
_CURSOR_MARK = "@@CURSOR@@"
_REALTIME_MARK = "@@REALTIME@@"
_MONO_MARK = "@@MONO@@"
_MESSAGE_MARK = "@@MESSAGE@@"
_MARKS = (_CURSOR_MARK, _REALTIME_MARK, _MONO_MARK, _MESSAGE_MARK)


# --- the stream --------------------------------------------------------------------------------


def sample(release: str, name: str) -> list[Entry]:
    """The recorded entries of one sample."""
    path = SAMPLES / release / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def is_lifecycle(entry: Entry) -> bool:
    """What the follower's lifecycle matches select: PID 1 (or init.scope) about UNIT."""
    manager = entry.get("_PID") == "1" or entry.get("_SYSTEMD_CGROUP") == "/init.scope"
    return manager and entry.get("UNIT") == UNIT


def is_output(entry: Entry) -> bool:
    """An output line of the unit itself."""
    return entry.get("_SYSTEMD_UNIT") == UNIT and entry.get("_TRANSPORT") == "stdout"


def cursor(index: int, realtime: int, mono: int) -> str:
    """A cursor in journald's layout (the JSON stream's; a real journal makes its own)."""
    return f"s={SEQNUM_ID};i={index + 1:x};b={BOOT};m={mono:x};t={realtime:x};x={index * 7919:x}"


def export_entry(entry: Entry) -> bytes:
    """One entry in the journal export format (binary form for values with control bytes)."""
    out = bytearray()
    for name, value in entry.items():
        if name in {"__CURSOR", "__SEQNUM", "__SEQNUM_ID"} or value is None:
            continue
        data = bytes(value) if isinstance(value, list) else str(value).encode()
        if all(32 <= byte < 127 or byte >= 128 for byte in data):
            out += name.encode() + b"=" + data + b"\n"
        else:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return bytes(out + b"\n")


class Template:
    """A serialised noise entry with its four varying fields left as ``str.format`` slots."""

    def __init__(self, text: str) -> None:
        """``text`` holds each of ``_MARKS`` at most once (the export format has no cursor)."""
        text = text.replace("{", "{{").replace("}", "}}")
        for slot, mark in enumerate(_MARKS):
            if text.count(mark) > 1:
                raise ValueError(f"template holds {mark} more than once")
            text = text.replace(mark, f"{{{slot}}}")
        self._format = text.format

    def render(self, cursor: str, realtime: int, mono: int, message: str) -> str:
        """The entry with these values (already escaped for the format)."""
        return self._format(cursor, realtime, mono, message)


@dataclass(frozen=True)
class Stream:
    """Entries shaped like the recorded samples; ``lines``/``exports`` make them by index."""

    lifecycle: tuple[Entry, ...]
    output: Entry
    json_template: Template
    export_template: Template

    @classmethod
    def from_samples(cls, release: str) -> Stream:
        """Shapes from the restart-loop sample of ``release``, retargeted onto one boot."""
        recorded = sample(release, "restart-loop-start-limit")
        lifecycle = tuple({**e, "_BOOT_ID": BOOT} for e in recorded if is_lifecycle(e))
        output = next(e for e in recorded if is_output(e))
        # A Python server, not the sample's shell: SGLang under systemd.
        output = {
            **output,
            "_BOOT_ID": BOOT,
            "_COMM": "python3",
            "SYSLOG_IDENTIFIER": "python3",
            "_PID": "4242",
        }
        marked: Entry = {
            **output,
            "__CURSOR": _CURSOR_MARK,
            "__REALTIME_TIMESTAMP": _REALTIME_MARK,
            "__MONOTONIC_TIMESTAMP": _MONO_MARK,
            "MESSAGE": _MESSAGE_MARK,
        }
        return cls(
            lifecycle=lifecycle,
            output=output,
            json_template=Template(json.dumps(marked, separators=(",", ":")) + "\n"),
            export_template=Template(export_entry(marked).decode()),
        )

    @staticmethod
    def kind(index: int) -> str:
        """``noise``, ``lifecycle`` or ``oom``: the entry at ``index`` (1% not noise)."""
        if index % EVERY != EVERY // 2:
            return "noise"
        return "oom" if (index // EVERY) % OOM_EVERY == OOM_EVERY // 2 else "lifecycle"

    def special(self, index: int) -> Entry:
        """The lifecycle or OOM entry at ``index`` (not noise), timed and with a cursor."""
        realtime, mono = T0_US + index * STEP_US, MONO0_US + index * STEP_US
        if self.kind(index) == "oom":
            base: Entry = {**self.output, "MESSAGE": OOM_MESSAGE}
        else:
            base = self.lifecycle[(index // EVERY) % len(self.lifecycle)]
        return {
            **base,
            "__CURSOR": cursor(index, realtime, mono),
            "__REALTIME_TIMESTAMP": str(realtime),
            "__MONOTONIC_TIMESTAMP": str(mono),
        }

    def lines(self, start: int, stop: int) -> Iterator[tuple[str, bytes]]:
        """(kind, ``journalctl -o json`` line) for the entries ``start`` to ``stop``."""
        render = self.json_template.render
        for index in range(start, stop):
            kind = self.kind(index)
            if kind == "noise":
                realtime, mono = T0_US + index * STEP_US, MONO0_US + index * STEP_US
                message = json.dumps(noise_message(index, realtime))[1:-1]
                line = render(cursor(index, realtime, mono), realtime, mono, message)
                yield kind, line.encode()
            else:
                text = json.dumps(self.special(index), separators=(",", ":")) + "\n"
                yield kind, text.encode()

    def exports(self, start: int, stop: int) -> bytes:
        """The entries ``start`` to ``stop`` in the journal export format."""
        render = self.export_template.render
        out: list[bytes] = []
        for index in range(start, stop):
            if self.kind(index) == "noise":
                realtime, mono = T0_US + index * STEP_US, MONO0_US + index * STEP_US
                text = render("", realtime, mono, noise_message(index, realtime))
                out.append(text.encode())
            else:
                out.append(export_entry(self.special(index)))
        return b"".join(out)


_STAMPS: dict[int, str] = {}


def _stamp(realtime_us: int) -> str:
    second = realtime_us // 1_000_000
    stamp = _STAMPS.get(second)
    if stamp is None:
        if len(_STAMPS) > 4096:
            _STAMPS.clear()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(second))
        _STAMPS[second] = stamp
    return stamp


def noise_message(index: int, realtime_us: int) -> str:
    """One SGLang request-log line, as the server prints them under load."""
    stamp = _stamp(realtime_us)
    pick = index % 20
    running = 8 + index % 24
    if pick < 14:
        return (
            f"[{stamp} TP0] Decode batch. #running-req: {running}, #token: "
            f"{4000 + index * 37 % 9000}, token usage: 0.{index % 9:02d}, gen throughput "
            f"(token/s): {900 + index * 7 % 700}.{index % 10}, #queue-req: {index % 3}"
        )
    if pick < 16:
        return (
            f"[{stamp} TP0] Prefill batch. #new-seq: 1, #new-token: {64 + index % 900}, "
            f"#cached-token: {index % 512}, token usage: 0.{index % 9:02d}, #running-req: "
            f"{running}, #queue-req: {index % 3}"
        )
    if pick < 19:
        return (
            f'[{stamp}] INFO:     10.0.{index % 7}.{index % 250}:{30000 + index % 30000} - "POST '
            f'/v1/chat/completions HTTP/1.1" 200 OK'
        )
    return f'[{stamp}] INFO:     127.0.0.1:{40000 + index % 20000} - "GET /health HTTP/1.1" 200 OK'


# --- 1. parsing in Python ----------------------------------------------------------------------


@dataclass
class Tally:
    """Entries parsed, CPU seconds spent, events found."""

    entries: int = 0
    cpu_s: float = 0.0
    lifecycle: int = 0
    oom: int = 0
    rates: list[float] = field(default_factory=list)  # of each timed batch

    def add(self, events: Sequence[UnitEvent | None], cpu_s: float) -> None:
        """Count one timed batch."""
        self.entries += len(events)
        self.cpu_s += cpu_s
        if cpu_s > 0:
            self.rates.append(len(events) / cpu_s)
        for event in events:
            if event is None:
                continue
            if event.kind is EventKind.GPU_OOM_OUTPUT:
                self.oom += 1
            else:
                self.lifecycle += 1

    @property
    def rate(self) -> float:
        """Entries per CPU second, over all batches."""
        return self.entries / self.cpu_s if self.cpu_s else float("inf")

    @property
    def median_rate(self) -> float:
        """The median batch's entries per CPU second (robust to a neighbour's burst)."""
        return statistics.median(self.rates) if self.rates else self.rate


def parse_lines(lines: Sequence[bytes]) -> tuple[list[UnitEvent | None], float]:
    """``parse_entry(json.loads(line))`` for each line, as the daemon does; CPU seconds taken."""
    loads, parse, unit = json.loads, parse_entry, UNIT
    started = time.process_time()
    events = [parse(loads(line), unit) for line in lines]
    return events, time.process_time() - started


def measure_parsing(
    stream: Stream, entries: int, min_cpu_s: float
) -> tuple[Tally, Tally, list[bytes]]:
    """(entries that reach Python, every entry, the lines that reach Python): parse rates.

    Entries that reach Python carry only the fields the daemon asks journalctl for.

    The whole stream is parsed once, chunk by chunk (generating is not timed); the entries the
    journalctl filter lets through are parsed again, repeatedly, for at least ``min_cpu_s``.
    """
    everything = Tally()
    reaching: list[bytes] = []
    for start in range(0, entries, CHUNK):
        batch = list(stream.lines(start, min(entries, start + CHUNK)))
        reaching += [line for kind, line in batch if kind != "noise"]
        everything.add(*parse_lines([line for _, line in batch]))
    # What the daemon's journalctl prints: --output-fields=FIELDS_READ plus its own __ fields.
    keep = {*FIELDS_READ, "__CURSOR", "__REALTIME_TIMESTAMP", "__MONOTONIC_TIMESTAMP"}
    slim = [
        json.dumps({k: v for k, v in json.loads(line).items() if k in keep}).encode()
        for line in reaching
    ]
    through = Tally()
    while through.cpu_s < min_cpu_s and slim:
        through.add(*parse_lines(slim))
    return through, everything, reaching


# Stands in for journalctl: prints the file for the history run, then follows nothing.
_CAT_JOURNALCTL = 'case " $* " in *" --follow "*) exec sleep 600;; *) exec cat "$0";; esac'


def measure_follower_path(
    lines: Sequence[bytes], scratch: Path, records: int, rounds: int = 3
) -> Tally:
    """The daemon's whole Python path per record, fed by ``cat`` instead of journalctl.

    JournalFollower's framing, ``json.loads`` and cursor bookkeeping, ``parse_entry``, and
    ``commit`` per batch, as ``Daemon._handle`` does it; ``rounds`` followers of ``records``.
    """
    repeats = max(1, -(-records // max(1, len(lines))))
    feed = scratch / "reaching.jsonl"
    with feed.open("wb") as out:
        for _ in range(repeats):
            out.writelines(lines)
    tally = Tally()
    for attempt in range(rounds):
        follower = JournalFollower(
            [UNIT],
            scratch / f"cat-cursor-{attempt}.json",
            journalctl=("sh", "-c", _CAT_JOURNALCTL, str(feed)),
            replay_s=1e9,
            fields=FIELDS_READ,
        )
        this = Tally()
        started = time.process_time()
        follower.start()
        while follower.health().state != "attached":
            batch = poll(follower, 1.0)
            this.add([parse_entry(record.entry, UNIT) for record in batch], 0.0)
            if batch:
                follower.commit(*batch)
        cpu_s = time.process_time() - started
        follower.close()
        tally.entries += this.entries
        tally.cpu_s += cpu_s
        tally.rates.append(this.entries / cpu_s)
    return tally


# --- 2. filtering in journalctl ----------------------------------------------------------------


def children_cpu_s() -> float:
    """User+system seconds of every reaped child so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sched_s(pid: int | None) -> float:
    """On-CPU seconds of a live process (/proc/PID/schedstat, ns); 0 when there is none."""
    if pid is None:
        return 0.0
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def append_journal(directory: Path, data: bytes) -> float:
    """Write export-format ``data`` with systemd-journal-remote; seconds taken."""
    started = time.perf_counter()
    remote = subprocess.Popen(
        [str(JOURNAL_REMOTE), f"--output={directory}/remote.journal", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, errors = remote.communicate(data)
    if remote.returncode != 0:
        raise SystemExit(f"systemd-journal-remote failed: {errors.decode(errors='replace')}")
    return time.perf_counter() - started


def build_journal(stream: Stream, directory: Path, entries: int) -> float:
    """Write ``entries`` into real journal files with systemd-journal-remote; seconds taken."""
    started = time.perf_counter()
    remote = subprocess.Popen(
        [str(JOURNAL_REMOTE), f"--output={directory}/remote.journal", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert remote.stdin is not None  # noqa: S101 - stdin=PIPE
    assert remote.stderr is not None  # noqa: S101 - stderr=PIPE
    for start in range(0, entries, CHUNK):
        remote.stdin.write(stream.exports(start, min(entries, start + CHUNK)))
    remote.stdin.close()
    errors = remote.stderr.read().decode(errors="replace")
    if remote.wait() != 0:
        raise SystemExit(f"systemd-journal-remote failed: {errors}")
    return time.perf_counter() - started


@dataclass(frozen=True)
class Run:
    """One way of getting the events out of the journal: what reached Python, what it cost."""

    wall_s: float
    journalctl_cpu_s: float
    python_cpu_s: float
    reached_python: int
    noise_in_python: int
    events: frozenset[tuple[str, str]]  # (cursor, kind)

    @property
    def cpu_s(self) -> float:
        """CPU seconds of journalctl and Python together."""
        return self.journalctl_cpu_s + self.python_cpu_s


def is_noise(entry: Entry) -> bool:
    """A request-log line of the unit (what the --grep filter is there to drop)."""
    return is_output(entry) and entry.get("MESSAGE") != OOM_MESSAGE


@dataclass
class Daemonish:
    """gpuguard's follower, its records handled the way ``Daemon._handle`` does."""

    follower: JournalFollower
    records: int = 0
    noise: int = 0
    events: set[tuple[str, str]] = field(default_factory=set)

    def pump(self, timeout_s: float) -> None:
        """Wait for records, parse each, commit the batch."""
        batch = poll(self.follower, timeout_s)
        for record in batch:
            event = parse_entry(record.entry, UNIT)
            if event is not None:
                self.events.add((event.cursor, event.kind.value))
            self.noise += is_noise(record.entry)
        if batch:
            self.follower.commit(*batch)
        self.records += len(batch)

    def journalctl_pids(self) -> list[int | None]:
        """The running journalctl of each stream."""
        return [s.pid for s in self.follower.health().streams]

    def check(self) -> None:
        """Fail on anything the follower reported (a skipped line, a restart)."""
        problems = self.follower.take_problems()
        if problems or any(s.restarts for s in self.follower.health().streams):
            raise SystemExit(f"the follower reported problems: {problems}")


def follow_history(
    journal: Path, scratch: Path, wall_now: float, replay_s: float
) -> tuple[Daemonish, Run, dict[str, tuple[str, ...]]]:
    """The follower over the journal's history until it attaches; it is left running.

    Also returns the history run's argv of each stream, exactly as the follower built it.
    """
    daemonish = Daemonish(
        JournalFollower(
            [UNIT],
            scratch / "cursor.json",
            output_patterns=GPU_OOM_PATTERNS,
            replay_s=replay_s,
            journalctl=("journalctl", f"--directory={journal}"),
            fields=FIELDS_READ,
            wall_clock=lambda: wall_now,
        )
    )
    follower = daemonish.follower
    kids, cpu, started = children_cpu_s(), time.process_time(), time.perf_counter()
    deadline = started + 600
    follower.start()
    argvs = {s.stream: s.argv for s in follower.health().streams}
    while follower.health().state != "attached":
        if time.perf_counter() > deadline:
            raise SystemExit(f"the follower did not attach in 600 s: {follower.health()}")
        daemonish.pump(1.0)
    wall = time.perf_counter() - started
    python = time.process_time() - cpu
    # The history journalctls have exited and been reaped; the following ones have just begun.
    journalctl = children_cpu_s() - kids + sum(map(sched_s, daemonish.journalctl_pids()))
    daemonish.check()
    run = Run(
        wall_s=wall,
        journalctl_cpu_s=journalctl,
        python_cpu_s=python,
        reached_python=daemonish.records,
        noise_in_python=daemonish.noise,
        events=frozenset(daemonish.events),
    )
    return daemonish, run, argvs


def follow_live(daemonish: Daemonish, journal: Path, data: bytes, expected: int) -> Run:
    """Append ``data`` while the follower is attached; what its ``--follow`` runs cost for it."""
    records, noise, events = daemonish.records, daemonish.noise, set(daemonish.events)
    pids = daemonish.journalctl_pids()
    journalctl, cpu = sum(map(sched_s, pids)), time.thread_time()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its CPU is not the follower's
        writing = pool.submit(append_journal, journal, data)
        deadline = time.perf_counter() + 300
        while daemonish.records - records < expected:
            if time.perf_counter() > deadline:
                raise SystemExit(f"live: {daemonish.records - records} of {expected} records")
            daemonish.pump(1.0)
        writing.result()
    settle = time.perf_counter() + 0.5
    while time.perf_counter() < settle:  # nothing more may come
        daemonish.pump(0.1)
    python = time.thread_time() - cpu
    daemonish.check()
    if daemonish.journalctl_pids() != pids:
        raise SystemExit("a journalctl was restarted during the live phase")
    return Run(
        wall_s=0.0,
        journalctl_cpu_s=sum(map(sched_s, pids)) - journalctl,
        python_cpu_s=python,
        reached_python=daemonish.records - records,
        noise_in_python=daemonish.noise - noise,
        events=frozenset(daemonish.events - events),
    )


def journalctl_alone(argv: Sequence[str]) -> tuple[float, float, int]:
    """(wall s, journalctl CPU s, lines) of one journalctl run, its output counted and dropped."""
    kids, started = children_cpu_s(), time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None  # noqa: S101 - stdout=PIPE
    lines = 0
    while chunk := proc.stdout.read(1 << 20):
        lines += chunk.count(b"\n")
    proc.wait()
    return time.perf_counter() - started, children_cpu_s() - kids, lines


def read_unfiltered(argv: Sequence[str], *, expect: int | None = None) -> Run:
    """Baseline: every entry through ``json.loads`` + ``parse_entry`` in Python.

    With ``expect`` (a ``--follow`` argv), stops after that many lines and ends journalctl.
    """
    kids, cpu, started = children_cpu_s(), time.thread_time(), time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None  # noqa: S101 - stdout=PIPE
    loads, parse = json.loads, parse_entry
    reached = noise = 0
    events: set[tuple[str, str]] = set()
    for line in proc.stdout:
        entry = loads(line)
        event = parse(entry, UNIT)
        reached += 1
        if event is not None:
            events.add((event.cursor, event.kind.value))
        noise += is_noise(entry)
        if reached == expect:
            break
    python = time.thread_time() - cpu
    # A following journalctl is measured before it is ended (journal-remote may be a child too).
    journalctl = sched_s(proc.pid) if expect is not None else None
    proc.terminate()
    proc.wait()
    proc.stdout.close()
    wall = time.perf_counter() - started
    return Run(
        wall_s=wall,
        journalctl_cpu_s=children_cpu_s() - kids if journalctl is None else journalctl,
        python_cpu_s=python,
        reached_python=reached,
        noise_in_python=noise,
        events=frozenset(events),
    )


def unfiltered_argv(history_argv: Sequence[str]) -> list[str]:
    """The follower's history argv up to its time window: no matches, no --grep."""
    argv = list(history_argv)
    window = next(i for i, arg in enumerate(argv) if arg.startswith(("--since=", "--cursor=")))
    return argv[: window + 1]


def live_unfiltered(journal: Path, data: bytes, since_us: int, entries: int) -> Run:
    """Baseline, live: ``journalctl --follow -o json --all`` over the appended entries, parsed.

    ``--since`` the first appended entry, so it needs no head start on the append.
    """
    argv = ["journalctl", f"--directory={journal}", "--output=json", "--all", "--no-pager"]
    argv += ["--quiet", "--follow", "--lines=all", f"--since=@{since_us / 1e6:.6f}"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        writing = pool.submit(append_journal, journal, data)
        run = read_unfiltered(argv, expect=entries)
        writing.result()
    return run


# --- the report --------------------------------------------------------------------------------


def count_kinds(entries: int) -> dict[str, int]:
    """How many entries of each kind the first ``entries`` of the stream hold."""
    counts = {"noise": 0, "lifecycle": 0, "oom": 0}
    for index in range(entries):
        counts[Stream.kind(index)] += 1
    return counts


def du(directory: Path) -> tuple[int, int]:
    """(bytes, files) under ``directory``."""
    files = [p for p in directory.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def main() -> int:
    """Generate the stream, measure parsing, build the journal, measure both ways of reading it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000, help="stream for part 1")
    parser.add_argument(
        "--journal-entries",
        type=int,
        default=None,
        help="entries written into the real journal for part 2 (default: --entries)",
    )
    parser.add_argument("--release", choices=("bookworm", "trixie"), default="bookworm")
    parser.add_argument("--min-cpu", type=float, default=1.0, help="CPU s for the filtered rate")
    parser.add_argument(
        "--live-entries",
        type=int,
        default=100_000,
        help="entries appended while following, for the live comparison (0: none)",
    )
    args = parser.parse_args()
    journal_entries = args.journal_entries or args.entries
    if shutil.which("journalctl") is None or not JOURNAL_REMOTE.exists():
        print(
            "needs journalctl and systemd-journal-remote (apt-get install systemd-journal-remote)",
            file=sys.stderr,
        )
        return 2
    stream = Stream.from_samples(args.release)
    kinds = count_kinds(args.entries)
    print(
        f"journal throughput: {args.entries:,} entries shaped like tests/journal_samples/"
        f"{args.release}: {kinds['noise']:,} SGLang request-log lines (_TRANSPORT=stdout), "
        f"{kinds['lifecycle']:,} PID-1 lifecycle entries, {kinds['oom']:,} CUDA OOM lines; "
        f"one unit watched; {os.cpu_count()} CPUs"
    )

    through, everything, reaching = measure_parsing(stream, args.entries, args.min_cpu)
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        follower_path = measure_follower_path(reaching, Path(tmp), 50_000)
    if (everything.lifecycle, everything.oom) != (kinds["lifecycle"], kinds["oom"]):
        raise SystemExit(f"parse_entry found {everything}, expected {kinds}")
    print("1. Python: json.loads + parse_entry per line, one core (CPU time)")
    print(
        f"  entries that reach Python (lifecycle + OOM): {through.median_rate:,.0f} entries/s "
        f"= {through.median_rate / PARSE_TARGET:.2f}x the 100k target (median of "
        f"{len(through.rates)} passes over {len(reaching):,})"
    )
    print(
        f"  the same through JournalFollower + commit:   {follower_path.median_rate:,.0f} "
        f"entries/s = {follower_path.median_rate / PARSE_TARGET:.2f}x the 100k target (the "
        f"daemon's path, fed by cat; median of {len(follower_path.rates)} runs of "
        f"{follower_path.entries // max(1, len(follower_path.rates)):,})"
    )
    print(
        f"  whole stream, were nothing filtered:         {everything.rate:,.0f} entries/s "
        f"= {everything.rate / PARSE_TARGET:.2f}x the 100k target "
        f"({everything.cpu_s:.1f} CPU s for {everything.entries:,})"
    )

    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        scratch = Path(tmp)
        journal = scratch / "journal"
        journal.mkdir()
        built_s = build_journal(stream, journal, journal_entries)
        size, files = du(journal)
        wall_now = (T0_US + journal_entries * STEP_US) / 1e6 + 1
        replay_s = wall_now - T0_US / 1e6 + 60  # the whole journal is the replayed history
        daemonish, filtered, argvs = follow_history(journal, scratch, wall_now, replay_s)
        try:
            alone = {name: journalctl_alone(argv) for name, argv in argvs.items()}
            baseline = read_unfiltered(unfiltered_argv(argvs[LIFECYCLE]))
            live = args.live_entries
            first, second = journal_entries, journal_entries + live
            live_filtered = None
            if live:
                live_filtered = follow_live(
                    daemonish,
                    journal,
                    stream.exports(first, second),
                    sum(Stream.kind(i) != "noise" for i in range(first, second)),
                )
        finally:
            daemonish.follower.close()
        live_runs = None
        if live_filtered is not None:
            live_baseline = live_unfiltered(
                journal, stream.exports(second, second + live), T0_US + second * STEP_US, live
            )
            live_runs = (live, live_filtered, live_baseline)
    report_journal(
        journal_entries,
        built=(built_s, size, files),
        history=(filtered, baseline, alone),
        live=live_runs,
    )
    return 0


def report_journal(
    entries: int,
    *,
    built: tuple[float, int, int],
    history: tuple[Run, Run, dict[str, tuple[float, float, int]]],
    live: tuple[int, Run, Run] | None,
) -> None:
    """Check that both ways found the same events, and print part 2."""
    kinds = count_kinds(entries)
    filtered, baseline, alone = history
    expected = kinds["lifecycle"] + kinds["oom"]
    if baseline.reached_python != entries or len(baseline.events) != expected:
        raise SystemExit(
            f"unfiltered read: {baseline.reached_python} lines, {len(baseline.events)} events"
        )
    if filtered.events != baseline.events:
        raise SystemExit("the filtered follower and the unfiltered read found different events")
    built_s, size, files = built
    print(
        f"2. a real journal of {entries:,} entries ({kinds['noise']:,} noise), written by "
        f"systemd-journal-remote in {built_s:.1f} s ({size / 2**20:,.0f} MiB, {files} files), "
        "read through journalctl --directory="
    )
    print(f"  history (the follower's start-up replay; all {entries:,} entries in its window):")
    print(
        f"    gpuguard's follower, its exact argv (lifecycle matches; output --grep "
        f"GPU_OOM_PATTERNS): {filtered.reached_python:,} of {entries:,} entries reached Python"
    )
    print(f"    noise parsed in Python: {filtered.noise_in_python:,} of {kinds['noise']:,}")
    for name, (wall, cpu, lines) in alone.items():
        print(
            f"      journalctl {name:<9} stream alone: {wall:6.2f} s wall, {cpu:6.2f} s CPU, "
            f"{lines:,} lines"
        )
    print(
        f"      follower, both streams + parse_entry + commit: {filtered.wall_s:6.2f} s wall, "
        f"{filtered.cpu_s:6.2f} s CPU (journalctl {filtered.journalctl_cpu_s:.2f} + "
        f"Python {filtered.python_cpu_s:.2f})"
    )
    print(
        f"    baseline, journalctl -o json --all (same window, no matches) | json.loads + "
        f"parse_entry: {baseline.wall_s:6.2f} s wall, {baseline.cpu_s:6.2f} s CPU "
        f"(journalctl {baseline.journalctl_cpu_s:.2f} + Python {baseline.python_cpu_s:.2f}); "
        f"noise parsed in Python: {baseline.noise_in_python:,} of {kinds['noise']:,}"
    )
    print(
        f"    same {len(filtered.events):,} events both ways; filtered follow costs "
        f"{baseline.cpu_s / filtered.cpu_s:.1f}x less CPU than unfiltered "
        f"({baseline.wall_s / filtered.wall_s:.1f}x less wall time; Python CPU "
        f"{baseline.python_cpu_s / max(filtered.python_cpu_s, 1e-9):.0f}x less)"
    )
    if live is None:
        return
    count, live_filtered, live_baseline = live
    live_kinds = count_kinds(count)
    if len(live_filtered.events) != len(live_baseline.events):
        raise SystemExit("live: the follower and the unfiltered read found different counts")
    print(
        f"  live ({count:,} entries appended while following, the same mix; CPU only; "
        "journal-remote posts a change after every entry where journald coalesces them every "
        "250 ms, so each --follow journalctl wakes far more often here than on a host):"
    )
    print(
        f"    gpuguard's follower (its --follow runs): {live_filtered.reached_python:,} of "
        f"{count:,} reached Python; noise parsed in Python: {live_filtered.noise_in_python:,} "
        f"of {live_kinds['noise']:,}; {live_filtered.cpu_s:.2f} s CPU (journalctl "
        f"{live_filtered.journalctl_cpu_s:.2f} + Python {live_filtered.python_cpu_s:.2f})"
    )
    print(
        f"    baseline, journalctl --follow -o json --all | json.loads + parse_entry: "
        f"{live_baseline.reached_python:,} reached Python; noise parsed in Python: "
        f"{live_baseline.noise_in_python:,}; {live_baseline.cpu_s:.2f} s CPU (journalctl "
        f"{live_baseline.journalctl_cpu_s:.2f} + Python {live_baseline.python_cpu_s:.2f})"
    )
    print(
        f"    same {len(live_filtered.events):,} events both ways; filtered follow costs "
        f"{live_baseline.cpu_s / live_filtered.cpu_s:.1f}x less CPU than unfiltered (Python "
        f"CPU {live_baseline.python_cpu_s / max(live_filtered.python_cpu_s, 1e-9):.0f}x less)"
    )


if __name__ == "__main__":
    sys.exit(main())
