"""The start-failure corpus (tests/start_failure_samples): each sample recognised as said.

Every line goes through the journal parser as the unit's own output, as the daemon and
`explain` read it; the grep pre-filter journalctl applies (GPU_OOM_REGEX) must let it through.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuguard.core.events import GPU_OOM_REGEX, EventKind, parse_entry
from gpuguard.core.startfailure import FailureClass, judge

SAMPLES = Path(__file__).resolve().parent.parent / "start_failure_samples"
UNIT = "sglang.service"
GRAVEST = (
    FailureClass.HARDWARE,
    FailureClass.DOES_NOT_FIT,
    FailureClass.HELD_BY_OTHERS,
    FailureClass.MEMORY,
)


@dataclass(frozen=True)
class Sample:
    """One sample: where it is from, what is expected, its lines."""

    where: str
    source: str
    expect: str
    knob: str | None
    lines: tuple[str, ...]


def load() -> list[Sample]:
    """Every sample of every file, blocks separated by blank lines."""
    samples = []
    for path in sorted(SAMPLES.glob("*.txt")):
        for number, block in enumerate(path.read_text().split("\n\n")):
            rows = [row for row in block.splitlines() if row]
            source = rows[0].removeprefix("# source: ")
            expect, _, knob = rows[1].removeprefix("# expect: ").partition(" ")
            samples.append(
                Sample(f"{path.name}#{number}", source, expect, knob or None, tuple(rows[2:]))
            )
    return samples


def entry(line: str) -> dict[str, object]:
    """The line as the unit's process printed it on stdout."""
    return {
        "__CURSOR": "s=1;i=2",
        "__REALTIME_TIMESTAMP": "1795973481486594",
        "__MONOTONIC_TIMESTAMP": "81486594",
        "_PID": "57",
        "_UID": "0",
        "_SYSTEMD_CGROUP": f"/system.slice/{UNIT}",
        "_SYSTEMD_UNIT": UNIT,
        "_SYSTEMD_INVOCATION_ID": "c" * 32,
        "_TRANSPORT": "stdout",
        "MESSAGE": line,
    }


ALL = load()


def test_the_corpus_covers_every_server_and_class() -> None:
    """SGLang, vLLM, PyTorch and CUDA texts, each class, negatives, and wrapped forms."""
    assert {s.where.split("#")[0] for s in ALL} >= {"sglang.txt", "vllm.txt", "cuda.txt"}
    assert {s.expect for s in ALL} == {*(c.value for c in FailureClass), "none"}
    assert sum("wrapped" in s.source for s in ALL) >= 4
    assert all(s.source and s.lines for s in ALL)


@pytest.mark.parametrize("sample", ALL, ids=[s.where for s in ALL])
def test_each_sample_is_recognised_as_its_source_says(sample: Sample) -> None:
    """Some line of the sample is a start failure of the expected class and knob (or none is)."""
    events = [parse_entry(entry(line), UNIT) for line in sample.lines]
    found = [e for e in events if e is not None and e.kind is EventKind.GPU_OOM_OUTPUT]
    passed = [line for line in sample.lines if re.search(GPU_OOM_REGEX, line)]
    if sample.expect == "none":
        assert found == []
        assert passed == []
        return
    assert found, f"not recognised: {sample.lines}"
    assert len(passed) == len(found)
    gravest = min((e.failure for e in found if e.failure), key=GRAVEST.index)
    assert gravest.value == sample.expect
    knobs = {e.knob for e in found if e.failure is gravest}
    assert knobs == {sample.knob}


@pytest.mark.parametrize(
    ("failure", "foreign", "final"),
    [
        (FailureClass.MEMORY, True, FailureClass.HELD_BY_OTHERS),
        (FailureClass.MEMORY, False, FailureClass.DOES_NOT_FIT),
        (FailureClass.DOES_NOT_FIT, True, FailureClass.HELD_BY_OTHERS),
        (FailureClass.DOES_NOT_FIT, False, FailureClass.DOES_NOT_FIT),
        (FailureClass.HELD_BY_OTHERS, False, FailureClass.HELD_BY_OTHERS),
        (FailureClass.HARDWARE, True, FailureClass.HARDWARE),
    ],
)
def test_the_inventory_decides_memory_between_held_and_does_not_fit(
    failure: FailureClass, foreign: bool, final: FailureClass
) -> None:
    """Out of memory (or a failed sizing) is held by others only while something holds the GPU."""
    judged = judge(failure, "--mem-fraction-static", foreign_holders=foreign)
    assert judged.failure is final
    if final is FailureClass.DOES_NOT_FIT:
        assert "change --mem-fraction-static" in judged.advice
