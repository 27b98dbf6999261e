#!/usr/bin/env python3
"""Benchmark: finding GPU device holders on a busy host.

Builds a host-like load — 2,000 live processes with 20 open files each, 8 of them also holding
fake GPU device files — then times, in the same run and over the same device files:

- gpuguard's NVML-first path (``procfs.scan_pids``: only the PIDs NVML names and their trees),
- gpuguard's full /proc walk (``procfs.scan_device_holders``),
- ``fuser -v`` (psmisc, C) and ``lsof`` (C), the tools an operator reaches for today.

Targets (bench/README.md): NVML-first ≥ 10x faster than fuser; full walk ≤ 1.5x fuser.
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

from gpuguard.adapters import procfs

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
            p.identity.pid for p in procfs.scan_pids(holders, glob).processes if p.device_files
        }
        if found == set(holders):
            return
        time.sleep(0.2)
    raise SystemExit("the load did not come up in 60 s")


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
    """Build the load, time the four methods, print times and ratios."""
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
            nvml_first = procfs.scan_pids(holders, glob)
            assert {p.identity.pid for p in full.processes} >= set(holders)  # noqa: S101
            assert {p.identity.pid for p in nvml_first.processes} == set(holders)  # noqa: S101
            device_args = [str(d) for d in devices]
            results = {
                "gpuguard NVML-first": timed(lambda: procfs.scan_pids(holders, glob), args.repeats),
                "gpuguard full walk": timed(lambda: procfs.scan_device_holders(glob), args.repeats),
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
        print(f"  {name:<22} {seconds * 1000:9.1f} ms")
    fuser = results["fuser -v"]
    speedup = fuser / results["gpuguard NVML-first"]
    walk = results["gpuguard full walk"] / fuser
    print(f"  NVML-first is {speedup:.1f}x faster than fuser (target >= 10x)")
    print(f"  full walk takes {walk:.2f}x fuser's time (target <= 1.5x)")
    print(f"  full walk takes {results['gpuguard full walk'] / results['lsof']:.2f}x lsof's time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
