"""A TCP health check and gpuguard.service's sandbox, as shipped and with the drop-in.

The shipped unit keeps no network, the shipped drop-in opens loopback only, and doctor says
when a TCP check cannot be made.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.core.doctor import AuditedUnit, History, HostFacts, diagnose
from gpuguard.core.doctor.hostchecks import HEALTH_FIX
from gpuguard.core.levels import Level
from gpuguard.core.unitconfig import UnitConfig

HOST = HostFacts(gate_timeout_s=300.0, nvidia_devices=False, persistenced_running=False)
SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
SHIPPED = {"LoadState": "loaded", "PrivateNetwork": "yes", "RestrictAddressFamilies": "AF_UNIX"}
OPENED = {
    "LoadState": "loaded",
    "PrivateNetwork": "no",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
}


def facts(health_url: str | None) -> AuditedUnit:
    """A loaded unit with ``health_url``; nothing else about it matters here."""
    unit = UnitConfig("sglang.service", load_state="loaded")
    return AuditedUnit(unit, History(), {}, None, 0, health_url=health_url)


def service_section(path: Path) -> configparser.SectionProxy:
    """The [Service] section of a unit file or drop-in."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser["Service"]


def test_the_shipped_unit_keeps_no_network() -> None:
    """gpuguard.service's default is unchanged: no network, UNIX sockets only."""
    service = service_section(SYSTEMD / "gpuguard.service")
    assert (service["PrivateNetwork"], service["RestrictAddressFamilies"]) == ("yes", "AF_UNIX")
    assert service["IPAddressDeny"] == "any"


def test_the_drop_in_opens_loopback_only() -> None:
    """health-loopback.conf: the host's network, IP sockets, and packets to loopback only."""
    dropin = service_section(SYSTEMD / "health-loopback.conf")
    assert dict(dropin) == {
        "PrivateNetwork": "no",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "IPAddressDeny": "any",
        "IPAddressAllow": "localhost",
    }
    installed = (SYSTEMD.parent / "packaging" / "debian" / "gpuguard.install").read_text()
    assert "systemd/health-loopback.conf usr/share/gpuguard/" in installed


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_reads_the_drop_in_without_a_complaint(tmp_path: Path) -> None:
    """systemd-analyze loads the unit with the drop-in and rates it, warning about nothing."""
    units = tmp_path / "etc" / "systemd" / "system"
    (units / "gpuguard.service.d").mkdir(parents=True)
    shutil.copy(SYSTEMD / "gpuguard.service", units)
    shutil.copy(SYSTEMD / "health-loopback.conf", units / "gpuguard.service.d")
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={tmp_path}", "gpuguard.service"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert "Overall exposure level for gpuguard.service" in done.stdout, done.stderr
    assert "PrivateNetwork=" in done.stdout
    assert "Unknown" not in done.stderr


def test_doctor_says_a_tcp_check_cannot_be_made_under_the_shipped_sandbox() -> None:
    """A TCP health_url while gpuguard.service has PrivateNetwork=yes: a warning with the fix."""
    host = replace(HOST, daemon_sandbox=SHIPPED)
    unit = facts("http://127.0.0.1:30000/health")
    [found] = [f for f in diagnose(unit, {}, host) if f.code == "health-sandbox"]
    assert found.severity is Level.WARNING
    assert "PrivateNetwork=yes and RestrictAddressFamilies=AF_UNIX" in found.title
    assert found.advice == f"install the loopback drop-in: {HEALTH_FIX}"
    assert "/usr/share/gpuguard/health-loopback.conf" in HEALTH_FIX


@pytest.mark.parametrize(
    ("url", "sandbox"),
    [
        ("http://127.0.0.1:30000/health", OPENED),
        (None, SHIPPED),
        ("http://127.0.0.1:30000/health", {"LoadState": "not-found"}),
    ],
    ids=["drop-in-installed", "no-check", "no-daemon-unit"],
)
def test_doctor_is_quiet_when_the_check_can_be_made(
    url: str | None, sandbox: dict[str, str]
) -> None:
    """With the drop-in, no check, or no daemon unit: nothing to say."""
    host = replace(HOST, daemon_sandbox=sandbox)
    unit = facts(url)
    assert [f for f in diagnose(unit, {}, host) if f.code == "health-sandbox"] == []
