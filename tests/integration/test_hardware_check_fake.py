"""`make hardware-check` over the fake NVML and a fake libcuda: the GPU host's check cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "hardware_check.py"


@pytest.fixture(scope="module", params=["fake", "fake-cuda"])
def report(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, str, dict[str, Any]]:
    """One run of the check per backend: exit status, printed table, JSON report.

    ``fake`` holds memory with the fake's own holders; ``fake-cuda`` runs the real backend's
    ctypes holders (what a GPU host runs) over the fake libcuda.so.1 (tests/fakenvml/fakecuda.c).
    """
    backend = request.param
    path = tmp_path_factory.mktemp("hwcheck") / "report.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", backend, "--report", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr, json.loads(path.read_text())


@pytest.mark.skipif(os.geteuid() != 0, reason="the check runs the gate and reap as root do")
def test_the_check_agrees_with_the_fake_in_under_a_minute(
    report: tuple[int, str, dict[str, Any]],
) -> None:
    """Against the fake every row agrees, the run exits 0 and takes less than a minute."""
    code, output, document = report
    assert code == 0, output
    assert document["backend"] in {"fake", "fake-cuda"}
    assert document["error"] is None
    assert document["disagreements"] == []
    assert all(row["agree"] for row in document["rows"]), output
    assert document["elapsed_s"] < 60
    header = [cell.strip() for cell in output.splitlines()[0].split(" | ")]
    assert header == ["check", "assumption", "fake", "real", "agree?"]


def test_every_nvml_field_and_holder_kind_is_checked(
    report: tuple[int, str, dict[str, Any]],
) -> None:
    """Each adapter field, each holder kind in status, gate and reap, and each size's timings."""
    _, output, document = report
    checks = {row["check"] for row in document["rows"]}
    for field in ("UUID", "PCI bus id", "minor number", "idle v2 used", "v2 reserved",
                  "persistence mode", "MIG mode", "health: remapped rows pending",
                  "health: recovery action field", "v1 used - v2 used - reserved"):  # fmt: skip
        assert field in checks
    kinds = ["context", "device-file"]
    if document["namespace"] == "unshare --pid works":
        kinds.append("namespace")
    for kind in kinds:
        assert f"status: {kind} holder" in checks
        assert f"reap --dry-run: {kind} holder" in checks
    assert "gate: context holder" in checks
    assert "gate: device-file holder alone" in checks
    assert sorted(int(mib) for mib in document["release"]) == [256, 4096]
    for runs in document["release"].values():
        assert len(runs) == 3
        assert all(r["listed_before"] and r["released_s"] is not None for r in runs)
    assert f"({document['backend']}; 3 runs < 10)" in output
    assert document["gate"]["exit"] == 1
    assert document["status_json"]["schema_version"] == 3
