"""Configuration: defaults without a file, one clear message for every kind of bad file."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from clirunner import gpuguard_argv

from gpuguard.config import (
    DEFAULT_PROTECTED,
    ConfigError,
    Settings,
    load_settings,
    parse_settings,
    warnings,
)
from gpuguard.core.exits import EX_CONFIG
from gpuguard.daemonsettings import listen_address

if TYPE_CHECKING:
    from collections.abc import Iterator

HERE = Path("/etc/gpuguard/gpuguard.toml")


def test_no_file_means_documented_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without a configuration file runs on the defaults."""
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    monkeypatch.setattr(
        "gpuguard.adapters.configfile.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml"
    )
    settings = load_settings()
    assert settings == Settings()
    assert list(settings.units) == ["sglang.service"]
    assert settings.device_glob == "/dev/nvidia*"
    assert "nvidia-persistenced" in settings.protected_processes
    assert "gpuguard" in settings.protected_processes


def test_full_file_is_read() -> None:
    """Every documented key is accepted with its TOML type."""
    settings = parse_settings(
        b"""
idle_threshold_mib = 64
allow_plain_device_files = true
device_glob = "/tmp/fake/dev/nvidia*"
protected_processes = ["nvidia-persistenced", "my-monitor"]
nvml_timeout_s = 2.5
state_dir = "/tmp/state"
runtime_dir = "/tmp/run"

[daemon]
reap_stopped_survivors = true

[units."sglang-a.service"]
gpus = [0, 1, 2, 3]

[units."sglang-b.service"]
gpus = ["GPU-0b7c3f2e-1111-2222-3333-444455556666"]
patterns = ["vllm"]
""",
        HERE,
    )
    assert settings.idle_threshold_mib == 64
    assert settings.units["sglang-a.service"].gpus == (0, 1, 2, 3)
    assert settings.units["sglang-b.service"].patterns == ("vllm",)
    assert settings.state_dir == Path("/tmp/state")
    assert settings.nvml_timeout_s == 2.5
    assert settings.daemon.reap_stopped_survivors
    assert not Settings().daemon.reap_stopped_survivors  # reported only, unless configured


def test_a_vllm_unit_needs_one_key() -> None:
    """``server = "vllm"`` gives vLLM's process names as patterns; explicit patterns still win."""
    settings = parse_settings(
        b"""
[units."vllm.service"]
server = "vllm"

[units."vllm-b.service"]
server = "vllm"
patterns = ["my-engine"]

[units."sglang.service"]
""",
        HERE,
    )
    assert settings.units["vllm.service"].patterns == ("vllm", "VLLM::EngineCore", "VLLM::Worker")
    assert settings.units["vllm-b.service"].patterns == ("my-engine",)
    assert settings.units["sglang.service"].patterns == (
        "sglang",
        "sglang::scheduler",
        "sglang::detokenizer",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"bogus = 1", "bogus: unknown key"),
        (b'[units."a.service"]\nserver = "tgi"', 'units."a.service".server: Input should be'),
        (b'[units."a.service"]\nfoo = 1', 'units."a.service".foo: unknown key'),
        (b'idle_threshold_mib = "16"', "idle_threshold_mib: Input should be a valid integer"),
        (b"idle_threshold_mib = -1", "idle_threshold_mib: Input should be greater than or equal"),
        (b'device_glob = "dev/nvidia*"', "device_glob: must be an absolute path pattern"),
        (b"[units.web]\n", "units: 'web' is not a service unit name"),
        (b"units = {}", "units: at least one watched unit is needed"),
        (b'[units."a.service"]\ngpus = [1, 1]', 'units."a.service".gpus: lists a GPU twice'),
        (b'[units."a.service"]\ngpus = ["x"]', "is neither an index nor a UUID"),
        (b"nvml_timeout_s = 0", "nvml_timeout_s: Input should be greater than 0"),
        (b'device_glob = "/*"', "device_glob: must start its file name with literal characters"),
        (b'device_glob = "/dev/*"', "device_glob: must start its file name with literal"),
        (b'device_glob = "/tmp/x/nvidia*"', "device_glob: must name character devices under /dev/"),
        (b'device_glob = "/dev/../tmp/nv*"', "device_glob: must be a plain absolute path pattern"),
        (b'[units."a.service"]\npatterns = [" "]', "' ' is too short: a pattern needs at least 3"),
        (b'[units."a.service"]\npatterns = [""]', "'' is too short"),
        (b'[units."a.service"]\npatterns = ["sglang", " p y "]', "' p y ' is too short"),
        (b"gate_timeout_s = inf", "gate_timeout_s: Input should be a finite number"),
        (b"reap_grace_s = nan", "reap_grace_s: Input should be a finite number"),
        (b"[daemon]\nloop_window_s = -inf", "daemon.loop_window_s: Input should be a finite"),
        (b"[daemon]\nstable_s = 1e300", "daemon.stable_s: Input should be less than or equal"),
        (b"[daemon]\nrecovery_backoff_s = 1e9", "daemon.recovery_backoff_s: Input should be less"),
        (b"gate_timeout_s = 86400.0", "gate_timeout_s: Input should be less than or equal to 3600"),
        (b"idle_threshold_mib = 200000", "idle_threshold_mib: Input should be less than or equal"),
        (b"protected_processes = [' ']", "protected_processes: a protected process name is empty"),
        (b'[daemon]\nreap_stopped_survivors = "yes"', "daemon.reap_stopped_survivors: Input"),
        (b"[daemon]\nreap_stopped_survivors = 1", "daemon.reap_stopped_survivors: Input"),
        (b'[metrics]\ntextfile = "gpuguard.prom"', "metrics.textfile: must be an absolute path"),
        (b'[metrics]\ntextfile = "/var/lib/x.txt"', "metrics.textfile: must be an absolute path"),
        (b'[metrics]\ntextfile = "/x.prom"', "metrics.textfile: must be an absolute path"),
        (b'[metrics]\ntextfile = "/var/../etc/x.prom"', "metrics.textfile: must be a plain"),
        (
            b'[metrics]\nlisten = "localhost:9835"',
            "metrics.listen: 'localhost:9835' is not IP:PORT",
        ),
        (b'[metrics]\nlisten = "127.0.0.1"', "metrics.listen: '127.0.0.1' is not IP:PORT"),
        (b'[metrics]\nlisten = "127.0.0.1:0"', "has no port between 1 and 65535"),
        (b'[metrics]\nlisten = "127.0.0.1:99999"', "has no port between 1 and 65535"),
        (b"[[broken", "invalid TOML"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_bad_file_names_file_key_and_reason(text: bytes, expected: str) -> None:
    """Unknown keys and invalid values are refused with the file, the key and the reason."""
    with pytest.raises(ConfigError) as caught:
        parse_settings(text, HERE)
    message = str(caught.value)
    assert message.startswith(f"{HERE}: ")
    assert expected in message
    assert "\n" not in message
    assert caught.value.exit_code == EX_CONFIG


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    """A file named with --config must exist; silently using defaults would hide a typo."""
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(tmp_path / "missing.toml")


def test_environment_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUGUARD_CONFIG selects the file when --config is not given."""
    path = tmp_path / "g.toml"
    path.write_text("idle_threshold_mib = 3\n")
    monkeypatch.setenv("GPUGUARD_CONFIG", str(path))
    assert load_settings().idle_threshold_mib == 3


def test_cli_exits_78_with_one_message(tmp_path: Path) -> None:
    """`gpuguard status` with an invalid file prints one line on stderr and exits EX_CONFIG."""
    path = tmp_path / "g.toml"
    path.write_text("idle_threshold_mib = 'lots'\n")
    result = subprocess.run(
        [*gpuguard_argv(), "--config", str(path), "status"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 78
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(path) in lines[0]
    assert "idle_threshold_mib" in lines[0]


@pytest.fixture
def dev_dir() -> Iterator[Path]:
    """A directory under /dev holding a plain file (root only, like the tests' CI)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file under /dev")
    path = Path("/dev") / f"gpuguard-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    (path / "nvidia0").write_text("")
    yield path
    (path / "nvidia0").unlink()
    path.rmdir()


def test_device_glob_must_name_character_devices(dev_dir: Path) -> None:
    """A glob matching a plain file is refused unless the test setting allows plain files."""
    text = f'device_glob = "{dev_dir}/nvidia*"'.encode()
    with pytest.raises(ConfigError, match=r"nvidia0', which is not a character device"):
        parse_settings(text, HERE)
    allowed = parse_settings(b"allow_plain_device_files = true\n" + text, HERE)
    assert allowed.device_glob == f"{dev_dir}/nvidia*"
    assert parse_settings(b'device_glob = "/dev/nul*"', HERE).device_glob == "/dev/nul*"


def test_protected_processes_only_extend_the_built_in_list() -> None:
    """`protected_processes = []` does not unprotect nvidia-persistenced; replacing is explicit."""
    assert parse_settings(b"protected_processes = []", HERE).protected_processes == (
        DEFAULT_PROTECTED
    )
    extended = parse_settings(b'protected_processes = ["my-monitor", "Xorg"]', HERE)
    assert extended.protected_processes == (*DEFAULT_PROTECTED, "my-monitor")
    replaced = parse_settings(
        b'replace_protected_processes = true\nprotected_processes = ["my-monitor"]', HERE
    )
    assert replaced.protected_processes == ("my-monitor",)
    for settings in (extended, replaced):  # the gate's cache stores the dump and reloads it
        assert Settings.model_validate(settings.model_dump(mode="json")) == settings


def test_overlapping_gpu_sets_are_warned_about() -> None:
    """Two units listing one GPU get a warning; one without gpus is judged by status instead.

    A unit without ``gpus`` may set CUDA_VISIBLE_DEVICES, which the configuration cannot see.
    """
    overlap = parse_settings(
        b'[units."a.service"]\ngpus = [0, 1]\n[units."b.service"]\ngpus = [1, 2]\n', HERE
    )
    assert warnings(overlap) == ("units: a.service and b.service both list GPU 1",)
    unset = parse_settings(b'[units."a.service"]\ngpus = [0]\n[units."b.service"]\n', HERE)
    assert warnings(unset) == ()
    disjoint = parse_settings(
        b'[units."a.service"]\ngpus = [0]\n[units."b.service"]\ngpus = [1]\n', HERE
    )
    assert warnings(disjoint) == ()
    assert warnings(Settings()) == ()


def test_cli_warns_in_one_line_and_runs(tmp_path: Path) -> None:
    """A warning does not stop the command: one line on stderr naming the file."""
    path = tmp_path / "g.toml"
    path.write_text(
        f'runtime_dir = "{tmp_path}/run"\n[units."a.service"]\ngpus = [0]\n'
        '[units."b.service"]\ngpus = [0]\n'
    )
    result = subprocess.run(
        [*gpuguard_argv(), "--config", str(path), "status", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode != 78
    warned = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warned == [f"gpuguard: warning: {path}: units: a.service and b.service both list GPU 0"]


@pytest.mark.parametrize(
    ("listen", "address"),
    [("127.0.0.1:9835", ("127.0.0.1", 9835)), ("[::1]:9835", ("::1", 9835))],
)
def test_metrics_listen_takes_ipv4_and_bracketed_ipv6(
    listen: str, address: tuple[str, int]
) -> None:
    """An IP literal and a port; no host names (no resolver in a root daemon's config)."""
    settings = parse_settings(f'[metrics]\nlisten = "{listen}"\ntextfile = ""'.encode(), HERE)
    assert listen_address(settings.metrics.listen) == address
    assert settings.metrics.textfile == ""
