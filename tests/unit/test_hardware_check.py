"""The hardware check's verdicts: which disagreements fail it, and how the table says so."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from builders import gpu

from gpuguard.core.values import MIB, GpuMemory, MemoryApi, MigMode, NvmlHealth, NvmlReading

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from hardware_check import CheckError, RealBackend, Report, Row, static_rows, table


def test_a_decision_changing_disagreement_fails_the_check() -> None:
    """v1-only memory and an unknown MIG mode are decisive; a differing health call is not."""
    fake = replace(gpu(0), mig=MigMode(current=False, pending=False))
    real = replace(
        gpu(0),
        memory=GpuMemory(143771 * MIB, 600 * MIB, None, MemoryApi.V1),
        mig=None,
        persistence_mode=None,
    )
    reading = NvmlReading(NvmlHealth.OK, None, "535.129.03", (real,))
    rows = static_rows(reading, real, fake, 16 * MIB)
    report = Report("real", "2026-12-01T00:00:00+00:00", rows=rows)
    failed = {row.check for row in report.decisive_disagreements()}
    assert failed == {"memory API", "MIG mode", "idle v2 used"}
    assert next(r for r in rows if r.check == "persistence mode").agree is False


def test_table_marks_decisive_and_informational_differences() -> None:
    """A decisive disagreement reads NO, an informational one "differs (info)"."""
    text = table(
        [
            Row("a", "x", "1", "1", agree=True, decisive=True),
            Row("b", "x", "1", "2", agree=False, decisive=True),
            Row("c", "x", "1", "2", agree=False, decisive=False),
        ]
    )
    lines = text.splitlines()
    assert lines[2].endswith("| yes")
    assert lines[3].endswith("| NO")
    assert lines[4].endswith("| differs (info)")


def test_the_real_backend_says_why_cuda_refused() -> None:
    """Without libcuda.so.1 the real backend's holder reports why, and start raises that reason."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("libcuda.so.1 is present here: the holder would really allocate")
    holder = gpu(0)
    with pytest.raises(CheckError, match=r"cannot load libcuda\.so\.1"):
        RealBackend().start(holder, 1, "context")
