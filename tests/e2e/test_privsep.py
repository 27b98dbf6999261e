"""Privilege separation on a real systemd: the watched unit runs as its own user and attacks.

One booted container (tests/e2e/gpubox.py; the gate socket units are installed and enabled
there, as the package does) serves every check, to keep the suite short:

* the fake SGLang unit runs with `User=tenant`, `PrivateNetwork=yes` and an `EnvironmentFile=`
  its user owns, which sets `CUDA_VISIBLE_DEVICES=2,3` (only there), and puts a directory of the
  tenant's first on `PATH` and `LD_LIBRARY_PATH`, holding a planted `systemctl` and a planted
  `libnvidia-ml.so.1` (tests/e2e/plant/planted_nvml.c): both say, on stderr and with a marker
  file, which uid ran them. Before the gate socket, the root `reap` ran that `systemctl` and the
  root gate loaded that library as uid 0;
* the gate passes through the socket with the unit's real GPU set (2,3, from the
  EnvironmentFile=), its story is in the unit's journal, and the daemon's record of the set
  says 2,3 too; the stop-reap goes through the socket as well;
* nothing planted ever ran as uid 0 (no marker, no journal line), while a shell of the tenant's
  with the unit's environment does run both (the plants work: the positive control);
* a process of one unit asking for another is refused in one line, root inside a service too;
* `install-gate` explains a unit whose sandbox keeps its gate from the socket.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e.gpubox import UNIT

if TYPE_CHECKING:
    from e2e.gpubox import GpuBox

pytestmark = pytest.mark.slow

PLANT_SOURCE = Path(__file__).resolve().parent / "plant" / "planted_nvml.c"
TENANT_HOME = "/home/tenant"
ENV_FILE = "/etc/sglang/tenant.env"
MARKERS = "/srv/markers"

PLANTED_SYSTEMCTL = f"""\
#!/bin/sh
# Planted by the service user: says who ran it, then does what systemctl would.
echo "PLANTED-SYSTEMCTL uid=$(id -u)" >&2
echo "$$" >>{MARKERS}/systemctl-uid$(id -u)
exec /bin/systemctl "$@"
"""

TENANT_DROPIN = f"""\
[Service]
User=tenant
EnvironmentFile={ENV_FILE}
# One start per test step: a crash of the server (it loads the planted library) is not retried.
Restart=no
# Its own network namespace: the gate socket, a file-system socket, is still reached.
PrivateNetwork=yes
"""

TENANT_ENV = f"""\
CUDA_VISIBLE_DEVICES=2,3
PATH={TENANT_HOME}/bin:/usr/local/bin:/usr/bin:/bin
LD_LIBRARY_PATH={TENANT_HOME}/lib
"""


def _build_plant(out: Path) -> Path:
    """The planted libnvidia-ml.so.1, compiled on the host (both are glibc Debian)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the planted libnvidia-ml.so.1")
    library = out / "libnvidia-ml.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(PLANT_SOURCE)], check=True
    )
    return library


def _plant(gpubox: GpuBox, tmp_path: Path) -> None:
    """The tenant, its writable bin/ and lib/ with the plants, its EnvironmentFile=."""
    box = gpubox.box
    box.run(["useradd", "--create-home", "--home-dir", TENANT_HOME, "tenant"])
    box.run(["install", "-d", "-m", "1777", MARKERS])
    box.run(["install", "-d", "-o", "tenant", "-m", "0755", f"{TENANT_HOME}/bin"])
    box.run(["install", "-d", "-o", "tenant", "-m", "0755", f"{TENANT_HOME}/lib"])
    box.write_file(f"{TENANT_HOME}/bin/systemctl", PLANTED_SYSTEMCTL, mode=0o755)
    library = _build_plant(tmp_path)
    shutil.copyfile(library, f"/proc/{box.init_pid}/root{TENANT_HOME}/lib/libnvidia-ml.so.1")
    box.write_file(ENV_FILE, TENANT_ENV)
    box.run(["chown", "-R", "tenant:", f"{TENANT_HOME}/bin", f"{TENANT_HOME}/lib", ENV_FILE])


def _journal(gpubox: GpuBox, since_s: float, *matches: str) -> list[str]:
    entries = gpubox.box.journal([*matches, f"--since=@{int(since_s)}"])
    return [str(e.get("MESSAGE")) for e in entries]


def test_an_unprivileged_unit_is_gated_through_the_socket_and_cannot_reach_root(
    gpubox: GpuBox, tmp_path: Path
) -> None:
    """Gate, stop-reap, GPU set and refusals through the socket; no plant ever runs as uid 0."""
    _install_gate_refuses_a_boxed_unit(gpubox)
    _plant(gpubox, tmp_path)
    gpubox.install_gate(extra=TENANT_DROPIN)
    uid = gpubox.box.run(["id", "-u", "tenant"]).stdout.strip()
    t0 = time.time()
    gpubox.systemctl("start", UNIT, check=False)
    gpubox.box.wait_for(
        "the gate's decision",
        lambda: bool(_gate_decisions(gpubox)),
        timeout=30,
    )
    last = _gate_decisions(gpubox)[-1]
    assert last["result"] == "passed", last
    assert last["gpu_set"] == "GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3)", last
    told = _journal(gpubox, t0 - 1, f"_SYSTEMD_UNIT={UNIT}")
    assert any(line.startswith("gpuguard gate: ") for line in told), told
    server = _journal(gpubox, t0 - 1, "--unit=gpuguard-gate.service")
    assert any(
        f"gate for {UNIT} from PID" in line
        and f"(uid {uid}, a process of {UNIT}): accepted" in line
        for line in server
    ), server
    recorded = json.loads(gpubox.box.read_file(f"/run/gpuguard/unit-env/{UNIT}.json"))
    assert recorded["environment"] == {"CUDA_VISIBLE_DEVICES": "2,3"}, recorded

    gpubox.systemctl("stop", UNIT, check=False)
    gpubox.box.wait_for(
        "the stop-reap's request",
        lambda: any(
            f"reap for {UNIT} from PID" in line
            for line in _journal(gpubox, t0 - 1, "--unit=gpuguard-gate.service")
        ),
        timeout=30,
    )
    # One resident server answered both: the socket started it once, it forked per request.
    shown = gpubox.systemctl("show", "-p", "ActiveState,NRestarts", "gpuguard-gate.service")
    properties = dict(line.split("=", 1) for line in shown.stdout.split())
    assert properties == {"ActiveState": "active", "NRestarts": "0"}, shown.stdout

    # A process of an unwatched unit asks for another: refused in one line before a process is
    # forked for it (gpuguard serves only watched units); root inside a service too.
    for name, user in (("sglang-a", ["--uid=tenant"]), ("root-job", [])):
        done = gpubox.box.run(
            ["systemd-run", f"--unit={name}", *user, "--quiet", "--pipe", "--wait", "--collect",
             "/usr/bin/gpuguard", "gate", "--unit", "sglang-b.service"],
            check=False,
        )  # fmt: skip
        assert done.returncode == 1, done
        assert (
            f"request from a process of {name}.service: refused ({name}.service is not watched"
            in done.stdout + done.stderr
        ), done

    # Positive control: in the tenant's environment the plants do run (as the tenant).
    control = (
        f"set -a; . {ENV_FILE}; systemctl --version >/dev/null; "
        "exec python3 -c 'import ctypes; ctypes.CDLL(\"libnvidia-ml.so.1\")'"
    )
    gpubox.box.run_as("tenant", ["sh", "-c", control])
    # Nothing planted ran as root.
    everything = _journal(gpubox, t0 - 1)
    assert not [line for line in everything if "PLANTED-" in line and "uid=0" in line]
    markers = gpubox.box.run(["ls", MARKERS]).stdout.split()
    assert not [m for m in markers if m.endswith("-uid0")], markers
    assert f"nvml-uid{uid}" in markers, markers
    assert f"systemctl-uid{uid}" in markers, markers


def _install_gate_refuses_a_boxed_unit(gpubox: GpuBox) -> None:
    """RestrictAddressFamilies= without AF_UNIX and InaccessiblePaths=/run: not installed."""
    gpubox.box.write_file(
        "/etc/systemd/system/boxed.service",
        "[Service]\nExecStart=/bin/sleep infinity\nRestrictAddressFamilies=AF_INET\n"
        "InaccessiblePaths=-/run\n",
    )
    gpubox.systemctl("daemon-reload")
    done = gpubox.gpuguard("install-gate", "--unit", "boxed.service")
    assert done.returncode == 1, done
    assert "RestrictAddressFamilies=AF_INET forbids AF_UNIX sockets" in done.stderr, done.stderr
    assert "InaccessiblePaths=-/run hides /run/gpuguard/gate.sock" in done.stderr, done.stderr
    gone = gpubox.box.run(["test", "-e", "/etc/systemd/system/boxed.service.d"], check=False)
    assert gone.returncode == 1


def _gate_decisions(gpubox: GpuBox) -> list[dict[str, object]]:
    done = gpubox.box.run(["cat", f"/run/gpuguard/gate/{UNIT}.json"], check=False)
    if done.returncode != 0:
        return []
    decisions: list[dict[str, object]] = json.loads(done.stdout)
    return decisions
