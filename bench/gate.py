#!/usr/bin/env python3
"""Benchmark: the restart gate's fast path and its time to recover from stale holders.

1. Fast path on idle GPUs against the floor: a fresh ``python3 -c`` that imports pynvml and
   reads the same memory and process lists. Target: gate <= 1.5x the floor (bench/README.md).
   Measured side by side, interleaved, for both ways the gate runs: in-process (root, no
   socket) and as installed, the unprivileged client asking a gate server over a socket (a
   listener here hands each connection to a fresh ``gpuguard serve-gate``, as systemd's
   gpuguard-gate.socket with Accept=yes does); the client's own cost is shown too.
2. Time from "stale holders present" to gate exit 0 with a 2 s grace (the holders ignore
   SIGTERM) and a 1 s driver release delay, against grace + delay. Target: within 0.5 s.

Both run the real CLI inside a real cgroup named like the unit (as ExecStartPre= does), over
the fake libnvidia-ml.so.1 through the unmodified pynvml. Needs root (cgroups).
Run: ``make bench`` or ``.venv/bin/python bench/gate.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))

from fakeholder import HolderSpawner  # noqa: E402 - found through the path set just above
from fakestate import fake_library, nvml_environ, update_gpu, write_state  # noqa: E402

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
    the steadier measure there. A run that went through the server waits for that server
    instance to end and counts its CPU time too.
    """
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for attempt in range(repeats + 1):
        for name, argv in runs.items():
            served = len(server.cpu)
            wall, cpu = run_once(argv, env)
            cpu += server.wait_for(served + 1) if name == "client-server" else 0.0
            if attempt:  # the first round warms the page cache
                samples[name].append((wall, cpu))
    return {
        name: (statistics.median(w for w, _ in got), statistics.median(c for _, c in got))
        for name, got in samples.items()
    }


class GateServer:
    """A socket whose every connection is served by a fresh ``gpuguard serve-gate`` process.

    Stands in for gpuguard-gate.socket (Accept=yes, StandardInput=socket); ``cpu`` holds each
    instance's CPU seconds.
    """

    def __init__(self, path: Path, argv: list[str], env: dict[str, str]) -> None:
        """Listen on ``path``; serve each connection with ``argv serve-gate``."""
        self.path, self.argv, self.env = path, argv, env
        self.cpu: list[float] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                instance = subprocess.Popen(  # its one log line per request: the journal's
                    [*self.argv, "serve-gate"],
                    stdin=conn.fileno(),
                    stderr=subprocess.DEVNULL,
                    env=self.env,
                )
            _, _, usage = os.wait4(instance.pid, 0)
            instance.returncode = 0
            self.cpu.append(_cpu(usage))

    def wait_for(self, count: int) -> float:
        """The CPU seconds of instance number ``count`` (1-based), once it has ended."""
        deadline = time.monotonic() + 60
        while len(self.cpu) < count:
            if time.monotonic() > deadline:
                raise SystemExit("the gate server instance did not end")
            time.sleep(0.002)
        return self.cpu[count - 1]

    def close(self) -> None:
        """Stop listening."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=5)


def report(times: dict[str, tuple[float, float]], repeats: int) -> None:
    """Print each variant's wall and CPU time and its ratios to the floor."""
    floor_wall, floor_cpu = times["floor"]
    labels = {
        "floor": "floor: python3 -c, import pynvml, read memory, processes",
        "in-process": "gpuguard gate, in-process (root, no socket)",
        "client-server": "gpuguard gate, client -> socket -> serve-gate -> verdict",
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
            server = GateServer(sock, command, env)
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
            finally:
                server.close()
            report(times, args.repeats)
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
