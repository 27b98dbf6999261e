#!/usr/bin/env python3
"""Benchmark: the memory and tasks of the gate server with N requests in progress.

What sizes ``MemoryMax=`` and ``TasksMax=`` of gpuguard-gate.service: one ``gpuguard serve-gate``
in a cgroup of its own (as bench/gate.py starts it), then ``--requests`` gates of one unit that
all wait (NVML lists a PID no process has on every GPU) for ``--seconds``. Memory is the sum of
the PSS of every process in the server's cgroup (what the cgroup is charged for them, without
page tables and caches: the cgroup's own counters need the memory controller, absent where
cgroup v2 is only the "unified" half of a hybrid tree); tasks are their threads. Root.
Run: ``.venv/bin/python bench/unit_limits.py [--requests 16]``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))
sys.path.insert(0, str(TESTS / "support"))

from fakestate import add_alloc, fake_library, nvml_environ, write_state  # noqa: E402 - paths above
from socketactivate import activate, listen  # noqa: E402

CGROUP2 = Path("/sys/fs/cgroup/unified")


def in_cgroup(cgroup: Path, argv: list[str]) -> list[str]:
    """Argv that first moves itself into ``cgroup`` (like systemd does), then execs ``argv``."""
    return ["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {shlex.join(argv)}"]


def tree(cgroup: Path) -> tuple[float, int]:
    """MiB of PSS and the threads of every process in ``cgroup``."""
    pss = tasks = 0
    for pid in (cgroup / "cgroup.procs").read_text().split():
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # ended while we looked
        pss += int(rollup.split("Pss:")[1].split()[0])
        tasks += int(status.split("Threads:")[1].split()[0])
    return pss / 1024, tasks


def main() -> int:
    """Start the server, let the requests wait, print the idle and the peak figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="the server allows 16 per UID")
    parser.add_argument("--seconds", type=float, default=12.0, help="how long to watch them")
    args = parser.parse_args()
    unit = f"gpuguard-bench-{uuid.uuid4().hex[:8]}.service"
    cgroup = CGROUP2 / "system.slice" / unit
    cgroup.mkdir(parents=True)
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
            command = [sys.executable, "-m", "gpuguard", "--config", str(config)]
            gate = [*command, "gate", "--unit", unit]
            # One full run validates the configuration and caches it, as in bench/gate.py.
            subprocess.run(in_cgroup(cgroup, gate), env=env, check=True, capture_output=True)
            for minor in range(4):
                add_alloc(state, pid=999_999_999, minor=minor, mib=1000)
            server_cgroup = CGROUP2 / "system.slice" / f"gpuguard-limits-{unit[15:23]}.service"
            server_cgroup.mkdir()
            sock = Path(tmp) / "gate.sock"
            with listen(sock) as listener:
                server = activate(
                    listener,
                    in_cgroup(server_cgroup, [*command, "serve-gate"]),
                    env,
                    subprocess.DEVNULL,
                )
            try:
                time.sleep(1.5)  # let it settle: its imports are done before the first accept
                idle = tree(server_cgroup)
                waiting = [
                    subprocess.Popen(
                        in_cgroup(cgroup, [*gate, "--timeout", "60", "--socket", str(sock)]),
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for _ in range(args.requests)
                ]
                peak = (0.0, 0)
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    now = tree(server_cgroup)
                    peak = (max(peak[0], now[0]), max(peak[1], now[1]))
                    time.sleep(0.5)
                for client in waiting:
                    client.kill()
                    client.wait()
            finally:
                server.terminate()
                server.wait(timeout=30)
                server_cgroup.rmdir()
    finally:
        cgroup.rmdir()
    each = (peak[0] - idle[0]) / args.requests, (peak[1] - idle[1]) / args.requests
    print(
        f"gate server: idle {idle[0]:.1f} MiB PSS, {idle[1]} tasks; {args.requests} requests "
        f"waiting: {peak[0]:.1f} MiB, {peak[1]} tasks; each {each[0]:.1f} MiB, {each[1]:.1f} "
        f"tasks; at 64: {idle[0] + 64 * each[0]:.0f} MiB, {idle[1] + 64 * each[1]:.0f} tasks"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
