"""Configuration: defaults without a file, one clear message for every kind of bad file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.config import ConfigError, Settings, load_settings, parse_settings
from gpuguard.configfile import EX_CONFIG

HERE = Path("/etc/gpuguard/gpuguard.toml")


def test_no_file_means_documented_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without a configuration file runs on the defaults."""
    monkeypatch.delenv("GPUGUARD_CONFIG", raising=False)
    monkeypatch.setattr("gpuguard.configfile.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
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
device_glob = "/tmp/fake/dev/nvidia*"
protected_processes = ["nvidia-persistenced", "my-monitor"]
nvml_timeout_s = 2.5
state_dir = "/tmp/state"
runtime_dir = "/tmp/run"

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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"bogus = 1", "bogus: unknown key"),
        (b'[units."a.service"]\nfoo = 1', 'units."a.service".foo: unknown key'),
        (b'idle_threshold_mib = "16"', "idle_threshold_mib: Input should be a valid integer"),
        (b"idle_threshold_mib = -1", "idle_threshold_mib: Input should be greater than or equal"),
        (b'device_glob = "dev/nvidia*"', "device_glob: must be an absolute path pattern"),
        (b"[units.web]\n", "units: 'web' is not a service unit name"),
        (b"units = {}", "units: at least one watched unit is needed"),
        (b'[units."a.service"]\ngpus = [1, 1]', 'units."a.service".gpus: lists a GPU twice'),
        (b'[units."a.service"]\ngpus = ["x"]', "is neither an index nor a UUID"),
        (b"nvml_timeout_s = 0", "nvml_timeout_s: Input should be greater than 0"),
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
        [sys.executable, "-m", "gpuguard", "--config", str(path), "status"],
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
