#!/usr/bin/env python3
"""Benchmark: root's ``gpuguard status`` while one user floods the /proc walk, against quiet.

Two loads, each measured against a quiet host in the same run: a descriptor flood (``--fds``,
10 M descriptors: in one process where this host lets one hold them, else forked into as many
processes as the per-process limit needs, which the scan's budget then bounds) and a mapping
flood (``--mappings``, 64,000 single-page mappings of a file whose path is 4 KiB long, with
alternating protections so that none merge: a 262 MB ``maps``). ``status`` runs against the C
fake NVML (four idle GPUs); its wall time, the part of it spent waiting for a core (the
``cpu.pressure`` of a cgroup of its own), CPU time (its own and its NVML worker's) and peak RSS
are the median of ``--repeats`` runs, next to a probe that reads no /proc. Budgets (issue 23):
the ratio to quiet <= 2x, judged on own time (wall less the wait for a core: on a shared host
that wait moves with the neighbours' load, not with gpuguard's work) and on CPU time; peak RSS
< 100 MB. Root, so every process's files are read. Run: ``.venv/bin/python
bench/proc_floods.py`` (``bench/hostile_inputs.py --floods`` runs it after its parsers);
``PYTHONPATH=OTHER/src`` measures another checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))
sys.path.insert(0, str(TESTS / "support"))

from fakestate import fake_library, nvml_environ, write_state  # noqa: E402 - the paths above
from floods import Flood, fd_ceiling  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator

RATIO_BUDGET = 2.0
RSS_BUDGET_MB = 100.0
PATH_MAX = 4096


UNIFIED = Path("/sys/fs/cgroup/unified")
"""cgroup v2 where the host is hybrid; ``/sys/fs/cgroup`` itself where it is unified."""


class Run(NamedTuple):
    """One ``status`` run: seconds of wall time, of it waiting for a core, of CPU; peak MB."""

    wall: float
    waiting: float | None  # None where no cgroup v2 with pressure accounting is at hand
    cpu: float
    rss_mb: float
    others: float  # cores the rest of the host kept busy meanwhile

    @property
    def own(self) -> float:
        """Wall time less the time it was runnable but given no core: what a free core takes."""
        return self.wall - (self.waiting or 0.0)


def _busy() -> tuple[float, float]:
    """CPU seconds the whole host has spent busy (not idle, not iowait), and the wall clock."""
    with open("/proc/stat") as stat:  # noqa: PTH123
        fields = [int(value) for value in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), time.perf_counter()


def _stalled(cgroup: Path | None) -> float | None:
    """Seconds some task of ``cgroup`` was runnable and waiting for a core (PSI ``some``)."""
    if cgroup is None:
        return None
    for line in (cgroup / "cpu.pressure").read_text().splitlines():
        if line.startswith("some "):
            return int(line.rpartition("total=")[2]) / 1e6
    return None


@contextlib.contextmanager
def run_cgroup() -> Iterator[Path | None]:
    """A cgroup v2 of the benchmark's own, whose ``cpu.pressure`` times a run's wait for cores.

    On two cores shared with other work, ``status`` waits for a core for much of its wall time
    (under the descriptor flood this host's own PID 1 takes one whole core, see bench/README.md):
    that wait is the neighbours', so the ratio is judged on wall time less it. None (and only
    raw wall time) where no cgroup v2 with pressure files can be made.
    """
    parent = UNIFIED if UNIFIED.is_dir() else Path("/sys/fs/cgroup")
    cgroup = parent / f"gpuguard-proc-floods-{os.getpid()}"
    try:
        cgroup.mkdir()
    except OSError:
        yield None
        return
    try:
        yield cgroup if (cgroup / "cpu.pressure").exists() else None
    finally:
        cgroup.rmdir()


PROBE = (sys.executable, "-c", "import gpuguard.cli")
"""The host's own slowdown: a Python start and gpuguard's imports, which read no /proc."""


def run_once(argv: list[str], env: dict[str, str], cgroup: Path | None) -> Run:
    """One run of ``argv``, in ``cgroup`` when there is one (a shell moves itself, then execs).

    CPU time is its own and its children's (status's NVML worker); peak RSS the largest of them.
    """
    if cgroup is not None:
        argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]
    stalled = _stalled(cgroup)
    busy, started = _busy()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(process.pid, 0)
    busy_after, ended = _busy()
    wall = ended - started
    cpu = usage.ru_utime + usage.ru_stime
    after = _stalled(cgroup)
    waiting = None if after is None or stalled is None else min(wall, after - stalled)
    others = max(0.0, busy_after - busy - cpu) / wall
    return Run(wall, waiting, cpu, usage.ru_maxrss / 1024, others)


class Load(NamedTuple):
    """The runs of ``status`` and of the probe under one load."""

    status: list[Run]
    probe: list[Run]


def measure(config: Path, env: dict[str, str], repeats: int, cgroup: Path | None) -> Load:
    """``repeats`` runs of ``status``, each followed by one of the probe."""
    status = [sys.executable, "-m", "gpuguard", "--config", str(config), "status"]
    runs = [
        (run_once(status, env, cgroup), run_once(list(PROBE), env, cgroup)) for _ in range(repeats)
    ]
    return Load([run for run, _ in runs], [probe for _, probe in runs])


def median(runs: list[Run]) -> Run:
    """The median of each figure over ``runs``."""
    waiting = [r.waiting for r in runs if r.waiting is not None]
    return Run(
        statistics.median(r.wall for r in runs),
        statistics.median(r.wall - r.own for r in runs) if waiting else None,
        statistics.median(r.cpu for r in runs),
        statistics.median(r.rss_mb for r in runs),
        statistics.median(r.others for r in runs),
    )


def own_median(runs: list[Run]) -> float:
    """The median of wall time less waiting for a core (wall time where it was not measured)."""
    return statistics.median(r.own for r in runs)


def members(session: int) -> set[int]:
    """The processes of ``session`` now."""
    return {
        int(entry.name)
        for entry in os.scandir("/proc")
        if entry.name.isdecimal() and _session(entry.name) == session
    }


def wait_gone(session: int) -> None:
    """Wait until no process of ``session`` is left (at most 2 minutes).

    A killed flood's 10 M descriptors are closed, and its processes reaped, seconds after the
    kill: the next load must not pay for them.
    """
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and members(session):
        time.sleep(0.2)


def inspected(config: Path, env: dict[str, str], session: int) -> tuple[int, int, list[str]]:
    """From one ``status --json``: the flood's processes, those named not fully inspected, and why.

    ``scan.partial`` names them: the budget took effect, and never read as clean.
    """
    pids = members(session)
    argv = [sys.executable, "-m", "gpuguard", "--config", str(config), "status", "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    partial = json.loads(done.stdout)["scan"]["partial"]
    named = [entry for entry in partial if entry["pid"] in pids]
    return len(pids), len(named), sorted({entry["reason"] for entry in named})


def _session(pid: str) -> int | None:
    """The session of process ``pid``; None when it has gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:  # noqa: PTH123
            return int(stat.read().rpartition(b")")[2].split()[3])
    except OSError:
        return None


def long_path(root: Path) -> Path:
    """A file whose absolute path is just under PATH_MAX: each ``maps`` line then takes 4 KiB."""
    directory = root
    while len(str(directory)) + 256 < PATH_MAX - 16:
        directory /= "d" * min(250, PATH_MAX - 16 - len(str(directory)) - 2)
    directory.mkdir(parents=True)
    return directory / "f"


@contextlib.contextmanager
def fd_flood(total: int) -> Iterator[tuple[str, int]]:
    """``total`` descriptors in as few processes as this host allows.

    Yields how they were made and the session they are in.
    """
    per = min(total, fd_ceiling() - 128)
    processes = math.ceil(total / per)
    flood = Flood("fds", per, processes=processes)
    try:
        yield (
            f"{processes} process(es) x {per:,} descriptors = {processes * per:,}",
            flood.popen.pid,
        )
    finally:
        flood.kill()
        wait_gone(flood.popen.pid)


@contextlib.contextmanager
def maps_flood(mappings: int, root: Path) -> Iterator[tuple[str, int]]:
    """One process with ``mappings`` mappings of a file with a 4 KiB path, and its session."""
    backing = long_path(root)
    with backing.open("wb") as file:
        file.truncate(mappings * 4096)
    flood = Flood("maps", mappings, path=backing)
    try:
        # Counted in chunks: a 262 MB read here would be inherited by the children's peak RSS
        # (vfork shares this process's memory until exec, whose high-water mark then counts).
        size = 0
        with Path(f"/proc/{flood.pid}/maps").open("rb", buffering=0) as maps:
            while chunk := maps.read(1 << 16):
                size += len(chunk)
        yield f"1 process, {mappings:,} mappings, maps {size / 1e6:.0f} MB", flood.popen.pid
    finally:
        flood.kill()
        wait_gone(flood.popen.pid)
        backing.unlink()


def _row(what: str, load: Load, quiet: Load | None) -> bool:
    """Print one load's line; whether it is over a budget (``quiet`` None: it is the baseline)."""
    m = median(load.status)
    own = own_median(load.status)
    probe = median(load.probe).wall
    waiting = f"{m.waiting:5.2f} s" if m.waiting is not None else "     - "
    line = f"  {what:48} {m.wall:5.2f} s {waiting} {own:5.2f} s {m.cpu:5.2f} s {m.rss_mb:6.1f} MB"
    line += f" {m.others:5.2f} {probe * 1000:5.0f} ms"
    if quiet is None:
        print(line)
        return False
    calm = median(quiet.status)
    ratios = (
        m.wall / calm.wall,
        own / own_median(quiet.status),
        m.cpu / calm.cpu,
        probe / median(quiet.probe).wall,
    )
    over = ratios[1] > RATIO_BUDGET or ratios[2] > RATIO_BUDGET or m.rss_mb >= RSS_BUDGET_MB
    line += "  " + " ".join(f"{ratio:5.2f}x" for ratio in ratios)
    print(line + ("  OVER BUDGET" if over else ""))
    return over


def run(fds: int, mappings: int, repeats: int) -> int:
    """Measure quiet, each flood, and quiet again; print the table; 1 when a budget is missed."""
    with tempfile.TemporaryDirectory() as temp, run_cgroup() as cgroup:
        root = Path(temp)
        state = write_state(root / "nvml")
        config = root / "gpuguard.toml"
        config.write_text(
            "allow_plain_device_files = true\n"
            f'nvml_library = "{fake_library()}"\n'
            f'device_glob = "{state}/dev/nvidia*"\n'
            f'runtime_dir = "{root}/run"\n'
            f'state_dir = "{root}/lib"\n'
        )
        env = nvml_environ(state)
        print(
            f"proc floods: gpuguard status, median of {repeats}; budgets: <= {RATIO_BUDGET:g}x "
            f"quiet (own time and CPU), < {RSS_BUDGET_MB:g} MB peak RSS; own = wall less waiting "
            f"for a core{'' if cgroup else ' (not measured here: no cgroup v2)'}; others: cores "
            "the rest of the host kept busy meanwhile; probe: wall time of a process that reads "
            "no /proc (import gpuguard.cli); ratios to quiet: wall, own, CPU, probe"
        )
        print(
            f"  {'load':48} {'wall':>7} {'waiting':>7} {'own':>7} {'CPU':>7} {'peak RSS':>9}"
            f" {'others':>5} {'probe':>8}  {'wall':>6} {'own':>6} {'CPU':>6} {'probe':>6}"
        )
        quiet = measure(config, env, repeats, cgroup)
        _row("quiet", quiet, None)
        loads = []
        seen: list[tuple[str, int, int, list[str]]] = []
        for load in (fd_flood(fds), maps_flood(mappings, root / "long")):
            with load as (what, session):
                loads.append((what, measure(config, env, repeats, cgroup)))
                seen.append((what, *inspected(config, env, session)))
        again = measure(config, env, repeats, cgroup)
        _row("quiet again", again, None)
        baseline = Load(quiet.status + again.status, quiet.probe + again.probe)
        _row(f"quiet, both ({2 * repeats} runs): the baseline", baseline, None)
        missed = sum(_row(what, runs, baseline) for what, runs in loads)
        for what, processes, named, reasons in seen:
            cut = "; ".join(reasons) or "none: the budget did not take effect"
            print(f"  {what}: {named} of its {processes} process(es) not fully inspected ({cut})")
            missed += named == 0
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    """Parse the knobs (``argv``, default the command line's) and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fds", type=int, default=10_000_000, help="descriptors of the flood")
    parser.add_argument("--mappings", type=int, default=64_000, help="mappings of the flood")
    parser.add_argument("--repeats", type=int, default=3, help="status runs per load")
    args = parser.parse_args(argv)
    return run(args.fds, args.mappings, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
