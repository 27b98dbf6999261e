"""A real vLLM (its CPU build) for the e2e tree, installed and cached once (issue 34).

`ensure_engine(rootfs, release)` gives an `Engine`: a venv made *inside* the test tree (the
variant "vllm" of Debian 12's: the plain tree plus libnuma1; its python3.11), kept on the host in
`$GPUGUARD_E2E_CACHE/engine/vllm-<release>-<key>/` and bound read-only at `/opt/vllm` in each
container, and a tiny Llama generated in the tree by `realvllm/make_tiny_llama.py`, kept in
`engine/model-<key>/` and bound at `/opt/tiny-llama`. Both are made once, in a temporary
directory renamed into place under a lock (gpubox._cached_dir): a second run costs nothing. What
decides them (the key): `realvllm/requirements.txt`, `realvllm/lock.txt`, the build script
below, the tree's recipe; and for the model the generator. Older entries are pruned after an hour.

Building: the host's pip downloads every wheel for CPython 3.11 on glibc 2.36 into
`engine/wheels-<key>/`, with the host's configuration (find-links, indexes, certificates: the
tree has none of them); torch's +cpu wheel is taken where that pip finds it
(`GPUGUARD_E2E_TORCH_INDEX` adds an index, e.g. https://download.pytorch.org/whl/cpu). Then
`systemd-nspawn` runs a shell in the tree, not booted (`--volatile=overlay`: the tree stays
pristine), with the venv's directory bound writable at /opt/vllm and the wheels at
/engine-wheels, and installs offline. With a lock file the venv is installed `--no-deps` from it
(every package pinned); without one, resolved from requirements.txt, and the freeze is left in
the venv (`freeze.txt`) to be committed as the lock. PyPI's torchvision, torchaudio and
torchcodec are uninstalled: torchvision fails to import beside torch 2.13.0+cpu ("operator
torchvision::nms does not exist") and a text model needs none. Then `import vllm`, `vllm._C`
and the API server's module are checked in the tree.

In a booted container (`install_engine`): the gpuguard-fakegpu plugin (`realvllm/fakegpu_plugin`)
and `realvllm/vllm.service`; helpers read the unit's journal lines and vLLM's engine processes.

A failure raises `EngineError` with the log's tail. Whether tests skip or fail without the engine
is `engine_required()`: `GPUGUARD_REQUIRE_REAL_ENGINE=1` (set by `make e2e-real` and CI) turns
every reason to skip into a failure.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from e2e.container import CLEAN_ENV, Bind, Container, cache_dir, recipe_hash
from e2e.gpubox import CONFIG, _cached_dir, _platform_args
from e2e.measure import SESSION_NOTES, results_dir

if TYPE_CHECKING:
    from e2e.gpubox import GpuBox

HERE = Path(__file__).resolve().parent / "realvllm"
REQUIREMENTS = HERE / "requirements.txt"
LOCK = HERE / "lock.txt"
MODEL_SCRIPT = HERE / "make_tiny_llama.py"
REQUIRE_ENV = "GPUGUARD_REQUIRE_REAL_ENGINE"
VENV = "/opt/vllm"
MODEL = "/opt/tiny-llama"
#: An index to take torch's +cpu wheel from where the host's pip has none
#: (e.g. https://download.pytorch.org/whl/cpu); by default only the host's pip configuration.
TORCH_INDEX_ENV = "GPUGUARD_E2E_TORCH_INDEX"
#: Uninstalled after the install (see the module's docstring).
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
UNIT = "vllm.service"
#: gpuguard's test configuration (gpubox.CONFIG: short grace and backoff) watching vllm.service.
VLLM_CONFIG = CONFIG.replace('"sglang.service"', f'"{UNIT}"') + 'server = "vllm"\n'
#: The variant of the e2e tree (container.VARIANTS) the venv is built in and the tests boot.
TREE = "vllm"
PLUGINS = "/opt/vllm-plugins"
#: The line vLLM's API server (uvicorn) logs once it serves.
READY = "Application startup complete."
#: The fake H200 (fakestate.FakeGpu): 143771 MiB; vLLM's default gpu_memory_utilization 0.9.
TOTAL_MIB = 143771
REQUESTED_MIB = math.ceil(TOTAL_MIB * (1 << 20) * 0.9 / (1 << 20))
#: On a fresh two-core machine with other work beside it: 35-50 s (issue 34), margin for more.
START_TIMEOUT_S = 300.0
FREE_MEMORY = re.compile(
    r"ValueError: Free memory on device cuda:0 \((?P<free>[0-9.]+)/140\.4 GiB\) on startup is "
    r"less than desired GPU memory utilization \(0\.9, 126\.36 GiB\)\. Decrease GPU memory "
    r"utilization or reduce GPU memory used by other processes\."
)


BUILD_SCRIPT = f"""\
set -eu
python3 -m venv --without-pip {VENV}
pip_whl=$(ls /engine-wheels/pip-*.whl | head -n 1)
{VENV}/bin/python "$pip_whl/pip" install --quiet --no-index --no-deps "$pip_whl"
pip() {{ {VENV}/bin/python -m pip --disable-pip-version-check "$@"; }}
if [ -s /realvllm/lock.txt ]; then
    pip install --progress-bar off --no-index --no-deps --find-links /engine-wheels \\
        -r /realvllm/lock.txt
else
    pip install --progress-bar off --no-index --find-links /engine-wheels \\
        -r /realvllm/requirements.txt
fi
pip uninstall --quiet --yes {" ".join(UNWANTED)} || true
pip freeze --all --exclude pip >{VENV}/freeze.txt
cd /
{VENV}/bin/python -c 'import vllm, vllm.entrypoints.openai.api_server, vllm._C, torch
print("vllm", vllm.__version__, "torch", torch.__version__)'
"""


class EngineError(RuntimeError):
    """The real engine could not be installed; the message says why and where the log is."""


@dataclass(frozen=True)
class Engine:
    """The cached venv and model, and what making them cost this time."""

    venv: Path
    model: Path
    timings: dict[str, float]

    def binds(self) -> list[Bind]:
        """Read-only binds of the venv, the model and the plugin's source."""
        return [
            Bind(self.venv, VENV),
            Bind(self.model, MODEL),
            Bind(HERE, "/e2e/realvllm"),
        ]


def engine_required() -> bool:
    """True where a missing or broken real engine must fail the run (CI, `make e2e-real`)."""
    return os.environ.get(REQUIRE_ENV) == "1"


def engine_root() -> Path:
    """`$GPUGUARD_E2E_CACHE/engine`."""
    return cache_dir() / "engine"


def _digest(*parts: bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()[:12]


def _wheels_key() -> str:
    """What decides the downloaded wheels: requirements and lock."""
    lock = LOCK.read_bytes() if LOCK.is_file() else b""
    return _digest(REQUIREMENTS.read_bytes(), lock)


def venv_key(release: str) -> str:
    """What decides the venv: requirements, lock, build script, the tree's recipe."""
    lock = LOCK.read_bytes() if LOCK.is_file() else b""
    return _digest(
        REQUIREMENTS.read_bytes(), lock, BUILD_SCRIPT.encode(), recipe_hash(release, TREE).encode()
    )


def _download_wheels(out: Path) -> None:
    """Every wheel of the venv, for CPython 3.11 on glibc 2.36, by the host's pip.

    The host's pip, with its configuration (find-links, mirrors, certificates): the tree has none
    of it, so the install inside runs offline from these. torch's +cpu wheel may also come from
    `$GPUGUARD_E2E_TORCH_INDEX`.
    """
    target = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    target += [*_platform_args("bookworm"), "--only-binary=:all:"]
    if os.environ.get(TORCH_INDEX_ENV):
        target += ["--extra-index-url", os.environ[TORCH_INDEX_ENV]]
    wanted = ["--no-deps", "-r", str(LOCK)] if LOCK.is_file() else ["-r", str(REQUIREMENTS)]
    for what in (wanted, ["--no-deps", "pip"]):
        argv = [sys.executable, "-m", "pip", "download", "--quiet", *target, "--dest", str(out)]
        done = subprocess.run([*argv, *what], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise EngineError(
                f"the host's pip could not download {' '.join(what)} for the tree "
                f"(CPython 3.11, glibc 2.36; {sys.executable} -m pip download):\n"
                f"{done.stderr[-3000:]}"
            )


def _in_tree(rootfs: Path, binds: list[Bind], script: str, log: Path, timeout: float) -> None:
    """Run `script` in a throw-away overlay of the tree (not booted), logging to `log`."""
    argv = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "-D", str(rootfs)]
    argv += ["-M", f"gpuguard-engine-{secrets.token_hex(4)}"]
    argv += ["--volatile=overlay", "--setenv=PIP_NO_CACHE_DIR=1", "--setenv=HOME=/root"]
    argv += [bind.option() for bind in binds]
    argv += ["/bin/sh", "-c", script]
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        try:
            done = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=CLEAN_ENV, timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"{script.splitlines()[1]} ...: timed out; log {log}") from exc
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise EngineError(
            f"building the real engine failed (exit {done.returncode}); log {log}:\n{tail}"
        )


def _build_venv(rootfs: Path, out: Path) -> None:
    wheels, _ = _cached_dir(engine_root() / f"wheels-{_wheels_key()}", _download_wheels)
    binds = [
        Bind(out, VENV, read_only=False),
        Bind(wheels, "/engine-wheels"),
        Bind(HERE, "/realvllm"),
    ]
    _in_tree(rootfs, binds, BUILD_SCRIPT, engine_root() / "build.log", timeout=1800)


def _build_model(rootfs: Path, venv: Path, out: Path) -> None:
    binds = [Bind(venv, VENV), Bind(HERE, "/realvllm"), Bind(out, MODEL, read_only=False)]
    script = f"set -eu\ncd /\n{VENV}/bin/python /realvllm/make_tiny_llama.py {MODEL}\n"
    _in_tree(rootfs, binds, script, engine_root() / "model.log", timeout=600)


def _prune(keep: Path, pattern: str) -> None:
    """Remove the cache entries matching `pattern` but `keep`, unless made within the hour.

    3.5 GB each; an entry of the last hour stays (another checkout's run may be using it).
    """
    recent = time.time() - 3600
    for old in engine_root().glob(pattern):
        if old != keep and old.is_dir() and old.stat().st_mtime < recent:
            shutil.rmtree(old, ignore_errors=True)


def ensure_engine(rootfs: Path, release: str) -> Engine:
    """The venv and the tiny model for `release`'s tree at `rootfs`, built on first use."""
    if shutil.which("systemd-nspawn") is None:
        raise EngineError("installing the real engine needs systemd-nspawn (systemd-container)")
    root = engine_root()
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    began = time.monotonic()
    key = venv_key(release)
    venv, cached = _cached_dir(root / f"vllm-{release}-{key}", lambda out: _build_venv(rootfs, out))
    timings["venv_cached_s" if cached else "venv_s"] = time.monotonic() - began
    began = time.monotonic()
    model_key = _digest(key.encode(), MODEL_SCRIPT.read_bytes())
    model, cached = _cached_dir(
        root / f"model-{model_key}", lambda out: _build_model(rootfs, venv, out)
    )
    timings["model_cached_s" if cached else "model_s"] = time.monotonic() - began
    for keep, pattern in ((venv, f"vllm-{release}-*"), (model, "model-*")):
        _prune(keep, pattern)
    _prune(engine_root() / f"wheels-{_wheels_key()}", "wheels-*")
    return Engine(venv=venv, model=model, timings=timings)


#: In a booted container with `Engine.binds()` (after gpubox.install: the fake NVML, its state
#: and the fake GPU driver): the plugin into /opt/vllm-plugins (the unit's PYTHONPATH; the venv
#: stays read-only, so its source is built from a copy) and vllm.service.
INSTALL_SCRIPT = f"""\
set -eu
rm -rf /tmp/realvllm-plugin
cp -r /e2e/realvllm/fakegpu_plugin /tmp/realvllm-plugin
{VENV}/bin/python -m pip install --quiet --no-index --no-deps --no-build-isolation \\
    --disable-pip-version-check --target {PLUGINS} /tmp/realvllm-plugin
rm -rf /tmp/realvllm-plugin
install -m 0644 /e2e/realvllm/{UNIT} /etc/systemd/system/{UNIT}
systemctl daemon-reload
"""


def install_engine(box: Container) -> float:
    """Install the plugin and vllm.service in `box`; return the seconds it took."""
    began = time.monotonic()
    box.run(["sh", "-c", INSTALL_SCRIPT], timeout=180)
    return time.monotonic() - began


def unit_entries(
    box: Container, *, after_s: float, unit: str = UNIT
) -> list[tuple[float, str, str]]:
    """(time, invocation, message) of what `unit`'s processes wrote since `after_s`."""
    entries = box.journal([f"_SYSTEMD_UNIT={unit}", f"--since=@{int(after_s)}"])
    out = []
    for entry in entries:
        stamp = int(str(entry.get("__REALTIME_TIMESTAMP"))) / 1e6
        if stamp >= after_s:
            out.append((stamp, str(entry.get("_SYSTEMD_INVOCATION_ID")), str(entry.get("MESSAGE"))))
    return out


def unit_messages(box: Container, *, after_s: float, unit: str = UNIT) -> list[str]:
    """The messages of `unit`'s processes since `after_s`."""
    return [message for _, _, message in unit_entries(box, after_s=after_s, unit=unit)]


def wait_unit_line(
    box: Container, text: str, *, after_s: float, timeout: float, unit: str = UNIT
) -> tuple[float, str]:
    """When `unit` first said `text` since `after_s`, and the invocation that said it."""
    found: list[tuple[float, str]] = []

    def said() -> bool:
        entries = unit_entries(box, after_s=after_s, unit=unit)
        found.extend((stamp, invocation) for stamp, invocation, m in entries if text in m)
        return bool(found)

    box.wait_for(f"{unit}: {text!r}", said, timeout=timeout)
    return found[0]


def vllm_pids(box: Container) -> dict[str, list[int]]:
    """PIDs (inside) of vLLM's engine processes by their comm: VLLM::EngineCor, VLLM::Worker."""
    out: dict[str, list[int]] = {}
    for comm in ("VLLM::EngineCor", "VLLM::Worker"):
        done = box.run(["pgrep", "-x", comm], check=False)
        out[comm] = [int(pid) for pid in done.stdout.split()]
    return out


@dataclass
class Readings:
    """What `gpuguard status`, `explain` and `doctor` said, text and --json."""

    status: str
    status_rc: int
    status_doc: dict[str, Any]
    explain: str
    explain_doc: dict[str, Any]
    doctor: str
    doctor_doc: dict[str, Any]
    metrics: dict[str, float]
    """`gpuguard status --prometheus`: NAME,label=value,... → value (empty without samples)."""


def read_the_tools(vllm_box: GpuBox, label: str) -> Readings:
    """Run status, explain and doctor on vllm.service; keep their text; note their verdicts."""
    status = vllm_box.gpuguard("status")
    status_doc = json.loads(vllm_box.gpuguard("status", "--json").stdout)
    explain = vllm_box.gpuguard("explain", "--unit", UNIT)
    explain_doc = json.loads(vllm_box.gpuguard("explain", "--unit", UNIT, "--json").stdout)
    doctor = vllm_box.gpuguard("doctor", "--unit", UNIT)
    doctor_doc = json.loads(vllm_box.gpuguard("doctor", "--unit", UNIT, "--json").stdout)
    prometheus = vllm_box.gpuguard("status", "--prometheus").stdout
    metrics = {
        sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(prometheus)
        for sample in family.samples
    }
    daemon = vllm_box.box.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", "gpuguard.service"], check=False
    ).stdout
    saved = results_dir() / f"real-vllm-{label.replace(' ', '-')}.txt"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(
        f"$ gpuguard status\n{status.stdout}{status.stderr}(exit {status.returncode})\n"
        f"$ gpuguard explain --unit {UNIT}\n{explain.stdout}{explain.stderr}"
        f"$ gpuguard doctor --unit {UNIT}\n{doctor.stdout}{doctor.stderr}"
        f"(exit {doctor.returncode})\n$ journalctl -u gpuguard.service -o cat\n{daemon}"
    )
    headline = status.stdout.strip().splitlines()[:1]
    codes = [f"{f['severity']} {f['code']}" for u in doctor_doc["units"] for f in u["findings"]]
    shown = {
        key.split(",unit=")[0].removeprefix("gpuguard_"): value
        for key, value in metrics.items()
        if key.split(",")[0]
        in {
            "gpuguard_unit_restart_loop",
            "gpuguard_unit_engine_dead",
            "gpuguard_unit_engine_deaths_total",
            "gpuguard_recoveries_total",
            "gpuguard_reaped_processes_total",
            "gpuguard_unit_start_ready_seconds",
        }
    }
    SESSION_NOTES.append(
        f"  {label}: metrics {shown or 'none (no daemon)'}; status exit {status.returncode} "
        f"{headline}; explain verdict "
        f"{explain_doc['story']['verdict']!r}, {len(explain_doc['story']['failed_starts'])} "
        f"failed starts; doctor exit {doctor.returncode} {codes}; text in {saved}"
    )
    return Readings(
        status=status.stdout + status.stderr,
        status_rc=status.returncode,
        status_doc=status_doc,
        explain=explain.stdout + explain.stderr,
        explain_doc=explain_doc,
        doctor=doctor.stdout + doctor.stderr,
        doctor_doc=doctor_doc,
        metrics=metrics,
    )


def main() -> int:
    """`make real-engine`: build (or find) the venv and the model; say where, how big, how long."""
    from e2e.container import ensure_rootfs  # noqa: PLC0415 - only the command needs it

    release = os.environ.get("GPUGUARD_E2E_RELEASES", "bookworm").split(",")[0].strip()
    began = time.monotonic()
    try:
        engine = ensure_engine(ensure_rootfs(release, variant=TREE), release)
    except EngineError as exc:
        sys.stderr.write(f"make real-engine: {exc}\n")
        return 1
    for what, path in (("venv", engine.venv), ("model", engine.model)):
        done = subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True, check=False)
        sys.stdout.write(f"real vLLM {what}: {done.stdout.split()[0]} in {path}\n")
    timings = ", ".join(f"{name} {seconds:.1f}" for name, seconds in engine.timings.items())
    sys.stdout.write(f"real vLLM ready in {time.monotonic() - began:.1f} s ({timings})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
