"""`gpuguard doctor` on the incident's unit on a real systemd (issue 13, item 3).

The fake SGLang unit (tests/e2e/fakesglang/sglang.service) drains for 30 s after SIGTERM but has
`TimeoutStopSec=3`: its stop ends in SIGKILL. doctor, reading only the unit's settings and
systemd's journal, must find that stop, and the drop-in it prints (`--fix`), installed as the
operator would, must make the next stop drain to its end: no SIGKILL in the journal.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import pytest

from e2e.gpubox import UNIT
from e2e.measure import SESSION_NOTES, results_dir
from e2e.scenario import pid1_messages

if TYPE_CHECKING:
    from e2e.gpubox import GpuBox

pytestmark = pytest.mark.slow


def _stop(gpubox: GpuBox) -> float:
    """`systemctl stop` (waits for the drain or the kill); when it was asked for."""
    asked = time.time()
    gpubox.box.run(["systemctl", "stop", UNIT], timeout=120)
    return asked


def _stop_finding(gpubox: GpuBox) -> dict[str, object]:
    document = json.loads(gpubox.gpuguard("doctor", "--unit", UNIT, "--json").stdout)
    [unit] = document["units"]
    [finding] = [f for f in unit["findings"] if f["code"] == "stop-timeout"]
    return dict(finding)


def test_doctor_fix_makes_the_next_stop_drain_cleanly(gpubox: GpuBox) -> None:
    """Before: CRITICAL, 1 of 1 stops SIGKILLed at 3 s. After the printed drop-in: a clean drain."""
    gpubox.start_server()
    first = _stop(gpubox)
    assert any("State 'stop-sigterm' timed out" in m for m in pid1_messages(gpubox, first))

    before = gpubox.gpuguard("doctor", "--unit", UNIT)
    proof = [f"--- gpuguard doctor before the fix (exit {before.returncode}):", before.stdout]
    assert before.returncode == 2, before.stderr
    assert "CRITICAL TimeoutStopSec=3s cut 1 of 1 stops short (SIGKILL)" in before.stdout
    fix = gpubox.gpuguard("doctor", "--unit", UNIT, "--fix").stdout
    proof += ["--- gpuguard doctor --fix, installed as zz-gpuguard-doctor.conf:", fix]
    assert "TimeoutStopSec=2min" in fix.splitlines()

    gpubox.drop_in(UNIT, "zz-gpuguard-doctor.conf", fix)
    assert gpubox.show(UNIT, "TimeoutStopUSec") == "2min"
    gpubox.start_server()
    second = _stop(gpubox)
    messages = pid1_messages(gpubox, second)
    assert not [m for m in messages if "timed out" in m or "SIGKILL" in m], messages
    assert any("Deactivated successfully" in m for m in messages), messages

    after = gpubox.gpuguard("doctor", "--unit", UNIT)
    proof += [f"--- gpuguard doctor after the fix (exit {after.returncode}):", after.stdout]
    saved = results_dir() / "doctor.txt"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text("\n".join(proof))
    SESSION_NOTES.append(f"doctor before/after the fix: {saved}")
    finding = _stop_finding(gpubox)
    assert finding["severity"] == "OK", finding
    evidence = finding["evidence"]
    assert isinstance(evidence, list)
    assert "2 stops observed, 1 ended in SIGKILL" in evidence
