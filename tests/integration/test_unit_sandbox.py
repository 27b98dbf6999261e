"""Both units' files as shipped: bounded memory and tasks, and the exposure they record."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNITS = ("gpuguard.service", "gpuguard-gate.service")
_RECORDED = re.compile(r"systemd (\d+): (\d+\.\d)")
_EXPOSURE = re.compile(r"Overall exposure level for [\w.-]+: (\d+\.\d)")


def _settings(unit: str) -> dict[str, list[str]]:
    """The unit file's assignments (comments skipped), each key's values in order."""
    found: dict[str, list[str]] = {}
    for line in (SYSTEMD / unit).read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def _systemd_version() -> int | None:
    """The major version of this host's systemd-analyze; None without it."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return None
    done = subprocess.run([analyze, "--version"], capture_output=True, text=True, check=False)
    match = re.match(r"systemd (\d+)", done.stdout)
    return int(match[1]) if match else None


@pytest.mark.parametrize("unit", UNITS)
def test_each_unit_bounds_its_memory_and_tasks(unit: str) -> None:
    """MemoryMax= and TasksMax= are set (sized in docs/security.md): no load grows them freely."""
    settings = _settings(unit)
    assert re.fullmatch(r"\d+[MG]", settings["MemoryMax"][-1])
    assert settings["TasksMax"][-1].isdigit()


@pytest.mark.parametrize("unit", UNITS)
def test_the_file_rates_as_its_comment_records_and_at_most_2(unit: str) -> None:
    """`systemd-analyze security --offline=yes` rates the file as PID 1 rates the loaded unit."""
    version = _systemd_version()
    if version is None or version < 250:
        pytest.skip("needs systemd-analyze 250 or later (--offline=yes)")
    text = (SYSTEMD / unit).read_text()
    recorded = {int(v): float(score) for v, score in _RECORDED.findall(text)}
    if version not in recorded:
        pytest.skip(f"the unit records no score for systemd {version}")
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(SYSTEMD / unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    match = _EXPOSURE.search(done.stdout)
    assert match is not None, done.stdout[-2000:] + done.stderr[-2000:]
    assert float(match[1]) <= 2.0
    assert float(match[1]) == recorded[version], done.stdout
