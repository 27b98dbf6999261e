#!/usr/bin/env python3
"""Benchmark: the restart gate's fast path and its time to recover from stale holders.

1. Fast path on idle GPUs against the floor: a fresh ``python3 -c`` that imports pynvml and
   reads the same memory and process lists. Target: gate <= 1.5x the floor (bench/README.md).
   Measured side by side, interleaved, for both ways the gate runs: in-process (root, no
   socket) and as installed, the client asking the warm gate server over a socket (one
   ``gpuguard serve-gate`` given the listening socket as systemd's gpuguard-gate.socket does,
   forking a process per request). Then the cold figure: the first request to a server started
   at the same moment (the socket starts the server on its first connection), and the warm
   server's resident memory.
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
from typing import TYPE_CHECKING

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))
sys.path.insert(0, str(TESTS / "support"))

from fakeholder import HolderSpawner  # noqa: E402 - found through the paths set just above
from fakestate import fake_library, nvml_environ, update_gpu, write_state  # noqa: E402
from socketactivate import activate, listen  # noqa: E402

import gpuguard  # noqa: E402 - its package directory is compiled before the runs

if TYPE_CHECKING:
    import resource

CGROUP2 = Path("/sys/fs/cgroup/unified")
# The fake library is loaded by path first (a real host finds the driver's through ldconfig's
# cache); pynvml's own dlopen("libnvidia-ml.so.1") then finds it by soname.
FLOOR = """
import ctypes, os
ctypes.CDLL(os.environ["FAKENVML_LIBRARY"])
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


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run (CPU: the process and the children it waited for)."""
    with tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
        elapsed = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"{argv} failed: {errors.read().decode(errors='replace')}")
    return elapsed, _cpu(usage)


def medians(
    runs: dict[str, list[str]], env: dict[str, str], repeats: int, server: GateServer
) -> dict[str, tuple[float, float]]:
    """Median wall and median CPU time of each named argv, the runs interleaved.

    Interleaving makes load drifts on a shared machine hit every variant alike; CPU time is
    the steadier measure there. A run that went through the server counts the server's CPU
    time during it too (its parent and the request's process, from the server's cgroup).
    """
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for attempt in range(repeats + 1):
        for name, argv in runs.items():
            served = server.cpu_seconds() if name == "client-server" else 0.0
            wall, cpu = run_once(argv, env)
            if name == "client-server":
                server.idle()
                cpu += server.cpu_seconds() - served
            if attempt:  # the first round warms the page cache
                samples[name].append((wall, cpu))
    return {
        name: (statistics.median(w for w, _ in got), statistics.median(c for _, c in got))
        for name, got in samples.items()
    }


class GateServer:
    """One ``gpuguard serve-gate`` on a socket passed as gpuguard-gate.socket passes it.

    It runs in a cgroup of its own, so its CPU time (the parent's and every request process's)
    is read from the cgroup, as no wait4 of ours sees the processes it forks.
    """

    def __init__(self, path: Path, argv: list[str], env: dict[str, str], cgroup: Path) -> None:
        """Start it on a new socket at ``path``, in the new cgroup ``cgroup``."""
        self.cgroup = cgroup
        cgroup.mkdir()
        with listen(path) as listener:
            self.process = activate(
                listener, in_cgroup(cgroup, [*argv, "serve-gate"]), env, subprocess.DEVNULL
            )

    def cpu_seconds(self) -> float:
        """CPU time of everything that ran in the server's cgroup so far."""
        for line in (self.cgroup / "cpu.stat").read_text().splitlines():
            name, value = line.split()
            if name == "usage_usec":
                return int(value) / 1e6
        raise SystemExit(f"no usage_usec in {self.cgroup}/cpu.stat")

    def idle(self) -> None:
        """Wait until the request processes have ended and been reaped by the server."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children")
        deadline = time.monotonic() + 60
        while children.read_text().split():
            if time.monotonic() > deadline:
                raise SystemExit("the gate server's request process did not end")
            time.sleep(0.001)

    def rss_kib(self) -> int:
        """The server parent's resident memory."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0])

    def close(self) -> None:
        """Stop it (SIGTERM, as systemctl stop) and remove its cgroup."""
        self.process.terminate()
        self.process.wait(timeout=30)
        self.cgroup.rmdir()


def cold(
    gate: list[str], cgroup: Path, env: dict[str, str], command: list[str], tmp: Path
) -> tuple[float, float]:
    """Median wall and CPU time of a server's first request (of 5), the server started with it.

    The CPU time counts the client and everything in the server's cgroup: its start, imports
    and the request's process.
    """
    got = []
    for attempt in range(5):
        server = GateServer(
            tmp / f"cold-{attempt}.sock",
            command,
            env,
            CGROUP2 / "system.slice" / f"gpuguard-bench-cold-{uuid.uuid4().hex[:8]}.service",
        )
        try:
            client = [*gate, "--socket", str(tmp / f"cold-{attempt}.sock")]
            wall, cpu = run_once(in_cgroup(cgroup, client), env)
            server.idle()
            got.append((wall, cpu + server.cpu_seconds()))
        finally:
            server.close()
    return statistics.median(w for w, _ in got), statistics.median(c for _, c in got)


def report(times: dict[str, tuple[float, float]], repeats: int) -> None:
    """Print each variant's wall and CPU time and its ratios to the floor."""
    floor_wall, floor_cpu = times["floor"]
    labels = {
        "floor": "floor: python3 -c, import pynvml, read memory, processes",
        "in-process": "gpuguard gate, in-process (root, no socket)",
        "client-server": "gpuguard gate, client -> warm server -> verdict",
        "cold": "gpuguard gate, a server's first request (started with it)",
    }
    print(f"gate fast path on 4 idle GPUs: {repeats} runs of each, interleaved")
    print(f"  {'':58s} {'wall (median)':>18s} {'CPU (median)':>18s}")
    for name, (wall, cpu) in times.items():
        print(
            f"  {labels[name]:58s} {wall * 1e3:7.1f} ms {wall / floor_wall:5.2f}x"
            f" {cpu * 1e3:7.1f} ms {cpu / floor_cpu:5.2f}x"
        )
    print("  target <= 1.5x the floor")


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
                f'[units."{unit}"]\n'  # the server serves a watched unit's processes only
            )
            env = nvml_environ(state)
            # As installed (py3compile): gpuguard's byte code is compiled once, not per run.
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            package = str(Path(gpuguard.__file__).parent)
            subprocess.run([sys.executable, "-m", "compileall", "-q", package], env=env, check=True)
            command = [sys.executable, "-m", "gpuguard", "--config", str(config)]
            gate = [*command, "gate", "--unit", unit]
            # One full run validates the configuration and caches it for the fast path.
            subprocess.run(in_cgroup(cgroup, gate), env=env, check=True, capture_output=True)
            sock = Path(tmp) / "gate.sock"
            server_cgroup = CGROUP2 / "system.slice" / f"gpuguard-bench-gate-{unit[15:23]}.service"
            server = GateServer(sock, command, env, server_cgroup)
            try:
                times = medians(
                    {
                        "floor": in_cgroup(cgroup, [sys.executable, "-c", FLOOR]),
                        "in-process": in_cgroup(cgroup, [*gate, "--socket", f"{tmp}/none"]),
                        "client-server": in_cgroup(cgroup, [*gate, "--socket", str(sock)]),
                    },
                    env,
                    args.repeats,
                    server,
                )
                rss = server.rss_kib()
            finally:
                server.close()
            times["cold"] = cold(gate, cgroup, env, command, Path(tmp))
            report(times, args.repeats)
            print(
                f"  (cold: median of 5 fresh servers; the warm server's RSS: {rss / 1024:.1f} MiB)"
            )
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
