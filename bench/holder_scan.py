#!/usr/bin/env python3
"""Benchmark: finding GPU device holders on a busy host.

Builds a host-like load — 2,000 live processes with 20 open files each, 8 of them also holding
fake GPU device files — then times, in the same run and over the same device files:

- gpuguard's read of the PIDs NVML names (``procfs.read_listed``: their fds, maps and facts),
- gpuguard's full /proc walk (``procfs.scan_device_holders``),
- gpuguard's walk of their process trees (``runtree.descendants``, the provenance ledger's),
- ``fuser -v`` (psmisc, C) and ``lsof`` (C), the tools an operator reaches for today;
- psutil's public API for the same process facts and process tree (``oneshot()``,
  ``children(recursive=True)``), the baseline for reading them by hand in ``procfs``.

Targets (bench/README.md): NVML's PIDs ≥ 10x faster than fuser; full walk ≤ 1.5x fuser.
Run: ``make bench`` or ``.venv/bin/python bench/holder_scan.py [--processes N]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil  # noqa: TID251 - a baseline measured beside gpuguard, like fuser and lsof

from gpuguard.adapters import procfs, runtree

if TYPE_CHECKING:
    from collections.abc import Callable

GPUS = 4
HOLDERS = 8
FILES_PER_PROCESS = 20


def spawn_load(root: Path, processes: int) -> tuple[int, list[int]]:
    """Fork the load from one small parent; return its PID and the holders' PIDs.

    The parent forks every child itself (copy-on-write keeps 2,000 Python children cheap) and
    prints the holders' PIDs once all children have opened their files.
    """
    script = f"""
import os, signal, sys, time
root = {str(root)!r}
holders = []
for i in range({processes}):
    pid = os.fork()
    if pid == 0:
        files = [open(os.path.join(root, "files", f"{{i % 50}}-{{n}}"), "rb")
                 for n in range({FILES_PER_PROCESS})]
        if i < {HOLDERS}:
            devs = [open(os.path.join(root, "dev", name), "rb")
                    for name in ("nvidiactl", "nvidia-uvm", f"nvidia{{i % {GPUS}}}")]
        signal.pause()
        os._exit(0)
    if i < {HOLDERS}:
        holders.append(pid)
time.sleep(1.0)
print(" ".join(map(str, holders)), flush=True)
signal.signal(signal.SIGTERM, lambda *_: (os.killpg(0, signal.SIGKILL)))
signal.pause()
"""
    parent = subprocess.Popen(
        [sys.executable, "-S", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None  # noqa: S101 - Popen with stdout=PIPE guarantees it
    line = parent.stdout.readline()
    holders = [int(pid) for pid in line.split()]
    wait_until_opened(holders, root)
    return parent.pid, holders


def wait_until_opened(holders: list[int], root: Path) -> None:
    """Wait until every holder shows its device files in /proc (children open them async)."""
    glob = f"{root}/dev/nvidia*"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = {
            p.identity.pid for p in procfs.read_listed(holders, glob).processes if p.device_files
        }
        if found == set(holders):
            return
        time.sleep(0.2)
    raise SystemExit("the load did not come up in 60 s")


def psutil_facts(process: psutil.Process) -> object:
    """The facts procfs reads for a process, through psutil (device files aside: it has none)."""
    with process.oneshot():
        return (
            process.name(),
            process.ppid(),
            process.status(),
            process.cmdline(),
            process.uids(),
            process.create_time(),
        )


def psutil_descendants(pids: list[int]) -> list[object]:
    """The descendants' walk and their facts through psutil: a lower bound of its cost.

    ``children()`` builds its map of parents from every ``/proc/PID/stat`` on each call.
    """
    facts = []
    for pid in pids:
        process = psutil.Process(pid)
        facts += [psutil_facts(p) for p in (process, *process.children(recursive=True))]
    return facts


def timed(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` runs after one warm-up run."""
    run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> int:
    """Build the load, time each method on it, print times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for tool in ("fuser", "lsof"):
        if shutil.which(tool) is None:
            print(f"{tool} not found: install psmisc and lsof", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
        root = Path(tmp)
        (root / "files").mkdir()
        (root / "dev").mkdir()
        for i in range(50):
            for n in range(FILES_PER_PROCESS):
                (root / "files" / f"{i}-{n}").touch()
        devices = [root / "dev" / f"nvidia{g}" for g in range(GPUS)]
        devices += [root / "dev" / "nvidiactl", root / "dev" / "nvidia-uvm"]
        for device in devices:
            device.touch()
        glob = f"{root}/dev/nvidia*"
        parent, holders = spawn_load(root, args.processes)
        try:
            full = procfs.scan_device_holders(glob)
            listed = procfs.read_listed(holders, glob)
            assert {p.identity.pid for p in full.processes} >= set(holders)  # noqa: S101
            assert {p.identity.pid for p in listed.processes} == set(holders)  # noqa: S101
            device_args = [str(d) for d in devices]
            results = {
                "gpuguard NVML's PIDs": timed(
                    lambda: procfs.read_listed(holders, glob), args.repeats
                ),
                "gpuguard full walk": timed(lambda: procfs.scan_device_holders(glob), args.repeats),
                "gpuguard descendants": timed(lambda: runtree.descendants(holders), args.repeats),
                "psutil holders' facts": timed(
                    lambda: [psutil_facts(psutil.Process(pid)) for pid in holders], args.repeats
                ),
                "psutil descendants": timed(lambda: psutil_descendants(holders), args.repeats),
                "fuser -v": timed(
                    lambda: subprocess.run(
                        ["fuser", "-v", *device_args], capture_output=True, check=False
                    ),
                    args.repeats,
                ),
                "lsof": timed(
                    lambda: subprocess.run(
                        ["lsof", "-w", *device_args], capture_output=True, check=False
                    ),
                    args.repeats,
                ),
            }
        finally:
            os.kill(parent, signal.SIGTERM)
            os.waitpid(parent, 0)
    total = sum(1 for _ in Path("/proc").iterdir())
    print(
        f"holder scan: {args.processes} load processes x {FILES_PER_PROCESS} files, "
        f"{HOLDERS} holding fake GPU devices; ~{total} entries in /proc; median of {args.repeats}"
    )
    for name, seconds in results.items():
        print(f"  {name:<24} {seconds * 1000:9.1f} ms")
    fuser = results["fuser -v"]
    speedup = fuser / results["gpuguard NVML's PIDs"]
    walk = results["gpuguard full walk"] / fuser
    print(f"  NVML's PIDs are read {speedup:.1f}x faster than fuser (target >= 10x)")
    print(f"  full walk takes {walk:.2f}x fuser's time (target <= 1.5x)")
    print(f"  full walk takes {results['gpuguard full walk'] / results['lsof']:.2f}x lsof's time")
    facts = results["psutil holders' facts"] / results["gpuguard NVML's PIDs"]
    tree = results["psutil descendants"] / results["gpuguard descendants"]
    print(f"  psutil's facts take {facts:.2f}x gpuguard's (which also reads fds, maps, cgroup)")
    print(f"  psutil's children() walk takes {tree:.0f}x gpuguard's descendants walk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
