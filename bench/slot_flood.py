#!/usr/bin/env python3
"""Benchmark: a watched unit's gate through the server while other users hammer the socket.

The load is issue 23's slot flood: four ordinary users (two in login sessions, two in services
gpuguard does not watch), 16 requests each in flight at once, every one asking the longest gate
the protocol allows and asking again the moment it is answered (tests/support/slotflood.py).
Measured: the wall time of the watched unit's own ``gpuguard gate`` (the client in the unit's
cgroup, as ExecStartPre= runs it, asking one warm ``gpuguard serve-gate`` over its socket) on
idle fake GPUs, ``--repeats`` times quiet, then under the flood, then quiet again; the
baseline is the median of both quiet rounds, in the same run. Target: the flooded median
within 2x the baseline, and no answer "busy". Needs root (cgroups, other uids).
Run: ``.venv/bin/python bench/slot_flood.py`` or ``bench/hostile_inputs.py --slots``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from gate import CGROUP2, GateServer, in_cgroup, run_once

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS / "fakenvml"))
sys.path.insert(0, str(TESTS / "support"))

from fakestate import fake_library, nvml_environ, write_state  # noqa: E402 - the paths above
from slotflood import Hammer, hammer  # noqa: E402

NOBODY = 65534
USERS = 4
IN_FLIGHT = 16


def timed(argv: list[str], env: dict[str, str], repeats: int, server: GateServer) -> list[float]:
    """Wall seconds of ``repeats`` runs of ``argv``, each once the server is idle again."""
    times = []
    for _ in range(repeats):
        server.idle()
        times.append(run_once(argv, env)[0])
    return times


def strangers(cgroups: list[Path]) -> list[tuple[Path, int]]:
    """The flooding users' cgroups: two login sessions, two unwatched services, made here."""
    made = []
    for index in range(USERS):
        uid = NOBODY - 1 - index
        tag = uuid.uuid4().hex[:8]
        if index % 2:
            path = CGROUP2 / "system.slice" / f"bench-unwatched-{tag}.service"
        else:
            path = CGROUP2 / "user.slice" / f"user-{uid}.slice" / f"session-b{tag}.scope"
        path.mkdir(parents=True)
        cgroups.append(path)
        made.append((path, uid))
    return made


def main() -> int:
    """Quiet, flood, quiet; print the medians, the ratio and what the flood was told."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (cgroups, other uids)", file=sys.stderr)
        return 2
    unit = f"gpuguard-bench-{uuid.uuid4().hex[:8]}.service"
    cgroups = [CGROUP2 / "system.slice" / unit]
    cgroups[0].mkdir(parents=True)
    floods: list[Hammer] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gpuguard-bench-") as tmp:
            Path(tmp).chmod(0o755)  # the flooding users must reach the socket
            state = write_state(Path(tmp) / "state")
            config = Path(tmp) / "gpuguard.toml"
            config.write_text(
                "allow_plain_device_files = true\n"
                f'nvml_library = "{fake_library()}"\n'
                f'device_glob = "{state}/dev/nvidia*"\nruntime_dir = "{tmp}/run"\n'
                f'[units."{unit}"]\n'
            )
            env = nvml_environ(state)
            command = [sys.executable, "-m", "gpuguard", "--config", str(config)]
            sock = Path(tmp) / "gate.sock"
            gate = in_cgroup(cgroups[0], [*command, "gate", "--unit", unit, "--socket", str(sock)])
            home = CGROUP2 / "system.slice" / f"gpuguard-bench-gate-{unit[15:23]}.service"
            server = GateServer(sock, command, env, home)
            try:
                run_once(gate, env)  # validates and caches the configuration
                quiet = timed(gate, env, args.repeats, server)
                started = time.monotonic()
                floods.extend(
                    hammer(sock, path, uid, IN_FLIGHT, unit) for path, uid in strangers(cgroups)
                )
                flooded = timed(gate, env, args.repeats, server)
                tallies = [each.stop() for each in floods]
                lasted = time.monotonic() - started
                quiet += timed(gate, env, args.repeats, server)
            finally:
                server.close()
    finally:
        for each in floods:
            each.kill()
        for path in reversed(cgroups):
            for member in (path / "cgroup.procs").read_text().split():
                (CGROUP2 / "cgroup.procs").write_text(member)
            with contextlib.suppress(OSError):
                path.rmdir()
    base, under = statistics.median(quiet), statistics.median(flooded)
    answers = sum(int(t["answers"]) for t in tallies)
    busy = sum(int(t["busy"]) for t in tallies)
    errors = sum(int(t["errors"]) for t in tallies)
    print(
        f"slot flood: {USERS} users outside any watched unit, {IN_FLIGHT} requests each in flight"
    )
    print(f"  baseline, quiet (median of {len(quiet)}): {base * 1e3:7.1f} ms")
    print(
        f"  under the flood (median of {len(flooded)}): {under * 1e3:7.1f} ms "
        f"({under / base:.2f}x the baseline, max {max(flooded) * 1e3:.1f} ms; target <= 2x)"
    )
    print(
        f"  the flood was answered {answers} times in {lasted:.1f} s ({answers / lasted:.0f}/s), "
        f"busy {busy}, connection errors {errors}"
    )
    return 0 if under <= 2 * base and busy == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
