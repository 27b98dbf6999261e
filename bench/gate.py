#!/usr/bin/env python3
"""Benchmark: the restart gate's fast path and its time to recover from stale holders.

1. Fast path on idle GPUs against the floor: a fresh ``python3 -c`` that imports pynvml and
   reads the same memory and process lists. Target: gate <= 1.5x the floor (bench/README.md).
2. Time from "stale holders present" to gate exit 0 with a 2 s grace (the holders ignore
   SIGTERM) and a 1 s driver release delay, against grace + delay. Target: within 0.5 s.

Both run the real CLI inside a real cgroup named like the unit (as ExecStartPre= does), over
the fake libnvidia-ml.so.1 through the unmodified pynvml. Needs root (cgroups).
Run: ``make bench`` or ``.venv/bin/python bench/gate.py``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))

from fakeholder import HolderSpawner  # noqa: E402 - found through the path set just above
from fakestate import fake_library, nvml_environ, update_gpu, write_state  # noqa: E402

CGROUP2 = Path("/sys/fs/cgroup/unified")
FLOOR = """
import pynvml
pynvml.nvmlInit()
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
pynvml.nvmlShutdown()
"""


def in_cgroup(cgroup: Path, argv: list[str]) -> list[str]:
    """Argv that first moves itself into ``cgroup`` (like systemd does), then execs ``argv``."""
    return ["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {shlex.join(argv)}"]


def median_run(argv: list[str], env: dict[str, str], repeats: int) -> float:
    """Median wall time of ``argv`` after one warm-up run; every run must exit 0."""
    samples = []
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, check=False)
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{argv} failed: {done.stderr.decode(errors='replace')}")
        if attempt:
            samples.append(elapsed)
    return statistics.median(samples)


def main() -> int:
    """Set up a fake host, run both measurements, print times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (it creates cgroups)", file=sys.stderr)
        return 2
    unit = f"gpuguard-bench-{uuid.uuid4().hex[:8]}.service"
    cgroup = CGROUP2 / "system.slice" / unit
    cgroup.mkdir(parents=True)
    spawner = HolderSpawner()
    try:
        with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
            state = write_state(Path(tmp) / "state")
            config = Path(tmp) / "gpuguard.toml"
            config.write_text(
                "allow_plain_device_files = true\n"
                f'nvml_library = "{fake_library()}"\n'
                f'device_glob = "{state}/dev/nvidia*"\nruntime_dir = "{tmp}/run"\n'
            )
            env = nvml_environ(state)
            gate = [sys.executable, "-m", "gpuguard", "--config", str(config), "gate"]
            gate += ["--unit", unit]
            # One full run validates the configuration and caches it for the fast path.
            subprocess.run(in_cgroup(cgroup, gate), env=env, check=True, capture_output=True)
            floor = median_run(in_cgroup(cgroup, [sys.executable, "-c", FLOOR]), env, args.repeats)
            fast = median_run(in_cgroup(cgroup, gate), env, args.repeats)
            print(f"gate fast path on 4 idle GPUs: median of {args.repeats}")
            print(
                f"  floor (python3 -c: import pynvml, read memory, processes) {floor * 1e3:6.1f} ms"
            )
            print(
                f"  gpuguard gate --unit U                                   {fast * 1e3:6.1f} ms"
            )
            print(f"  ratio {fast / floor:.2f}x the floor (target <= 1.5x)")

            grace, delay = 2.0, 1.0
            for gpu in range(4):
                update_gpu(state, gpu, release_delay_ms=int(delay * 1000))
            excess = []
            for _ in range(3):
                holder = spawner(
                    state, gpus=(0, 1, 2, 3), mib=20000, children=3, ignore_sigterm=True
                )
                for pid in (holder.pid, *holder.children):
                    (cgroup / "cgroup.procs").write_text(str(pid))
                started = time.perf_counter()
                subprocess.run(
                    in_cgroup(cgroup, [*gate, "--grace", str(grace), "--timeout", "30"]),
                    env=env,
                    check=True,
                    capture_output=True,
                )
                excess.append(time.perf_counter() - started - grace - delay)
            print(f"stale holders to gate exit 0, grace {grace:g} s + release delay {delay:g} s:")
            print(
                f"  took grace + delay + {statistics.median(excess):.2f} s (median of 3, "
                f"max {max(excess):.2f} s; target <= 0.5 s)"
            )
    finally:
        spawner.cleanup()
        for member in (cgroup / "cgroup.procs").read_text().split():
            (CGROUP2 / "cgroup.procs").write_text(member)
        cgroup.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
