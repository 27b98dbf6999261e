#!/usr/bin/env python3
"""Benchmark: root's ``gpuguard status`` while one user floods the /proc walk, against quiet.

Two loads, each measured against a quiet host in the same run: a descriptor flood (``--fds``,
10 M descriptors: in one process where this host lets one hold them, else forked into as many
processes as the per-process limit needs, which the scan's budget then bounds) and a mapping
flood (``--mappings``, 64,000 single-page mappings of a file whose path is 4 KiB long, with
alternating protections so that none merge: a 262 MB ``maps``). ``status`` runs against the C
fake NVML (four idle GPUs); its wall time, CPU time (its own and its NVML worker's) and peak RSS
are the median of ``--repeats`` runs. Budgets (issue 23): the time ratio to quiet <= 2x, judged
on CPU time (wall time is printed too: on a shared host it moves with the neighbours' load more
than with gpuguard's work), peak RSS < 100 MB. Root, so every process's
files are read. Run: ``.venv/bin/python bench/proc_floods.py`` (``bench/hostile_inputs.py
--floods`` runs it after its parsers); ``PYTHONPATH=OTHER/src`` measures another checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

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


def status_once(config: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (its own and its children's) and peak RSS (MB) of one run."""
    argv = [sys.executable, "-m", "gpuguard", "--config", str(config), "status"]
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(process.pid, 0)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - started, cpu, usage.ru_maxrss / 1024


def measure(config: Path, env: dict[str, str], repeats: int) -> tuple[float, float, float]:
    """The medians of wall time, CPU time and peak RSS over ``repeats`` runs."""
    runs = [status_once(config, env) for _ in range(repeats)]
    return tuple(statistics.median(r[i] for r in runs) for i in range(3))  # type: ignore[return-value]


def long_path(root: Path) -> Path:
    """A file whose absolute path is just under PATH_MAX: each ``maps`` line then takes 4 KiB."""
    directory = root
    while len(str(directory)) + 256 < PATH_MAX - 16:
        directory /= "d" * min(250, PATH_MAX - 16 - len(str(directory)) - 2)
    directory.mkdir(parents=True)
    return directory / "f"


@contextlib.contextmanager
def fd_flood(total: int) -> Iterator[str]:
    """``total`` descriptors in as few processes as this host allows; yields how they were made."""
    per = min(total, fd_ceiling() - 128)
    processes = math.ceil(total / per)
    flood = Flood("fds", per, processes=processes)
    try:
        yield f"{processes} process(es) x {per:,} descriptors = {processes * per:,}"
    finally:
        flood.kill()


@contextlib.contextmanager
def maps_flood(mappings: int, root: Path) -> Iterator[str]:
    """One process with ``mappings`` mappings of a file with a 4 KiB path."""
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
        yield f"1 process, {mappings:,} mappings, maps {size / 1e6:.0f} MB"
    finally:
        flood.kill()
        backing.unlink()


def run(fds: int, mappings: int, repeats: int) -> int:
    """Measure quiet, then each flood; print the table; 1 when a budget is missed."""
    with tempfile.TemporaryDirectory() as temp:
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
            f"quiet, < {RSS_BUDGET_MB:g} MB peak RSS"
        )
        print(f"  {'load':52} {'wall':>7} {'CPU':>7} {'peak RSS':>9} {'CPU/quiet':>9}")
        quiet_s, quiet_cpu, quiet_mb = measure(config, env, repeats)
        print(f"  {'quiet':52} {quiet_s:5.2f} s {quiet_cpu:5.2f} s {quiet_mb:6.1f} MB")
        missed = 0
        for load in (fd_flood(fds), maps_flood(mappings, root / "long")):
            with load as what:
                seconds, cpu, mb = measure(config, env, repeats)
            ratio = cpu / quiet_cpu
            over = ratio > RATIO_BUDGET or mb >= RSS_BUDGET_MB
            missed += over
            note = "  OVER BUDGET" if over else ""
            print(f"  {what:52} {seconds:5.2f} s {cpu:5.2f} s {mb:6.1f} MB {ratio:8.2f}x{note}")
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
