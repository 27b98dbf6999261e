"""The shipped alert rules pass `promtool test rules`, and every alert is tested both ways.

promtool comes with Debian's ``prometheus`` package (.ci/run installs it). Without it the test
skips with the install line in its reason (``-ra`` prints it); GPUGUARD_REQUIRE_PROMTOOL=1 (set
by .ci/run) makes a missing promtool a failure instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).resolve().parent.parent.parent / "packaging" / "prometheus"
RULES = RULES_DIR / "gpuguard-alerts.yml"
TESTS = RULES_DIR / "gpuguard-alerts.test.yml"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool not found: apt-get install --no-install-recommends prometheus"
        if os.environ.get("GPUGUARD_REQUIRE_PROMTOOL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def test_promtool_checks_and_tests_the_rules() -> None:
    """`promtool check rules` and `promtool test rules` both succeed."""
    promtool = _promtool()
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", TESTS.name],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_firing_and_a_silent_case_and_a_runbook() -> None:
    """For each alert: one test expecting it, one expecting nothing; a summary; a runbook link."""
    rules = RULES.read_text()
    tests = TESTS.read_text()
    alerts = re.findall(r"^\s+- alert: (\w+)$", rules, re.MULTILINE)
    assert len(alerts) == 11
    for alert in alerts:
        silent = rf"alertname: {alert}\n\s+exp_alerts: \[\]"
        firing = rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels:"
        assert re.search(silent, tests), f"{alert} has no test where it stays silent"
        assert re.search(firing, tests), f"{alert} has no test where it fires"
        assert f"metrics.md#{alert.lower()}" in rules
    assert rules.count("summary:") == len(alerts)
    assert rules.count("runbook_url:") == len(alerts)
