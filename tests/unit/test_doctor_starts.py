"""doctor's TimeoutStartSec= and gate-timeout proposals from the starts and waits gpuguard learned.

The starts are learned the way the daemon learns them: systemd's recorded "Starting" entry
(tests/journal_samples, systemd 252) and SGLang's ready line (tests/start_failure_samples) go
through ``core.liveness``, whose export is saved as the unit's state and read back by doctor's
adapter from a real file; the gate's waits are written by the gate's own recorder.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuguard.adapters import state
from gpuguard.adapters.doctorio import gate_waits, learned_starts
from gpuguard.core.doctor import (
    AuditedUnit,
    Finding,
    GateWaits,
    History,
    HostFacts,
    LearnedStarts,
    diagnose,
    render_fix,
    render_text,
)
from gpuguard.core.events import parse_entry
from gpuguard.core.levels import Level
from gpuguard.core.liveness import Liveness
from gpuguard.core.unitconfig import UnitConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

UNIT = "sglang.service"
SAMPLES = Path(__file__).parent.parent
GATED = ("/etc/systemd/system/sglang.service.d/gpuguard-gate.conf",)
HOST = HostFacts(gate_timeout_s=300.0, nvidia_devices=False, persistenced_running=False)


def _recorded_starting() -> dict[str, Any]:
    """The "Starting sglang.service" entry systemd 252 wrote, as journalctl printed it."""
    sample = SAMPLES / "journal_samples" / "bookworm" / "clean-start-stop.jsonl"
    first = json.loads(sample.read_text().splitlines()[0])
    assert str(first["MESSAGE"]).startswith("Starting ")
    return dict(first)


def _ready_line() -> str:
    """SGLang's ready line from the recorded start-up lines."""
    text = (SAMPLES / "start_failure_samples" / "sglang.txt").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("The server is fired up")]
    return line


def learn(ready_after_s: Sequence[float]) -> dict[str, Any]:
    """The unit's saved state after starts that came up after ``ready_after_s`` seconds each."""
    tracker = Liveness(UNIT, "sglang")
    starting = _recorded_starting()
    at_us = int(starting["__MONOTONIC_TIMESTAMP"])
    for n, ready_s in enumerate(ready_after_s):
        run = f"{n:032x}"
        begun = {**starting, "INVOCATION_ID": run, "__CURSOR": f"{run}-start"}
        begun["__MONOTONIC_TIMESTAMP"] = str(at_us)
        ready = {
            "__CURSOR": f"{run}-ready",
            "__MONOTONIC_TIMESTAMP": str(at_us + int(ready_s * 1e6)),
            "__REALTIME_TIMESTAMP": starting["__REALTIME_TIMESTAMP"],
            "_BOOT_ID": starting["_BOOT_ID"],
            "_SYSTEMD_UNIT": UNIT,
            "_SYSTEMD_INVOCATION_ID": run,
            "_TRANSPORT": "stdout",
            "_PID": str(4242 + n),  # each run's own main process, on the stream it opened
            "_STREAM_ID": f"{run}-stream",
            "_UID": "1000",
            "MESSAGE": _ready_line(),
        }
        for entry in (begun, ready):
            event = parse_entry(entry, UNIT)
            assert event is not None
            tracker.observe(event, live=True)
        at_us += int((ready_s + 3600) * 1e6)
    return {"schema_version": 1, "liveness": tracker.export()}


def saved_starts(tmp_path: Path, ready_after_s: Sequence[float]) -> LearnedStarts:
    """What doctor's adapter reads back from a real state file holding those starts."""
    state.write_json(state.unit_state_path(tmp_path, UNIT), learn(ready_after_s))
    return learned_starts(tmp_path, UNIT)


def unit(**overrides: object) -> UnitConfig:
    """A gated Type=notify unit that is otherwise healthy."""
    settings: dict[str, object] = {
        "unit": UNIT,
        "load_state": "loaded",
        "type": "notify",
        "kill_mode": "mixed",
        "timeout_stop_s": 120.0,
        "timeout_start_s": 600.0,
        "restart": "on-failure",
        "restart_s": 10.0,
        "start_limit_interval_s": 3600.0,
        "start_limit_burst": 5,
        "drop_in_paths": GATED,
    }
    settings.update(overrides)
    return UnitConfig(**settings)  # type: ignore[arg-type]


def judge(config: UnitConfig, **extra: Any) -> tuple[Finding, ...]:
    """What doctor finds about the unit with these learned facts."""
    facts = AuditedUnit(config, History(), {"CUDA_VISIBLE_DEVICES": "0"}, None, 0, **extra)
    return diagnose(facts, {}, HOST)


def by_code(findings: tuple[Finding, ...], code: str) -> Finding:
    """The one finding with ``code``."""
    (found,) = [f for f in findings if f.code == code]
    return found


def test_learned_starts_propose_timeout_start_sec_with_their_numbers_and_source(
    tmp_path: Path,
) -> None:
    """Three starts (5, 6, 7 min): the longest x 1.5 plus the gate's 5 min: 16 min; WARNING."""
    learned = saved_starts(tmp_path, [300.0, 360.0, 420.0])
    assert learned.ready_s == (300.0, 360.0, 420.0)
    found = by_code(judge(unit(), learned=learned), "start-timeout")
    assert found.severity is Level.WARNING
    assert found.title == (
        "TimeoutStartSec=10min can kill a healthy slow start: the learned starts need 16min"
    )
    assert found.evidence[0] == (
        "3 starts came up (systemd's Starting → the server's ready line), as gpuguard's daemon "
        f"saved them in {tmp_path}/units/sglang.service.json: median 6min, longest 7min"
    )
    assert found.fix[-1] == "TimeoutStartSec=16min"
    assert "plus the gate's timeout (5min)" in found.fix[0]


def test_too_few_learned_starts_say_so_and_propose_nothing(tmp_path: Path) -> None:
    """With two starts the number is a guess in the evidence, never a line of the drop-in."""
    findings = judge(unit(), learned=saved_starts(tmp_path, [300.0, 420.0]))
    found = by_code(findings, "start-timeout")
    assert found.severity is Level.OK
    assert found.title == "TimeoutStartSec=10min; too few learned starts to propose one (2 of 3)"
    assert found.fix == ()
    assert any(line.startswith("a guess from 2, not a proposal") for line in found.evidence)
    assert "TimeoutStartSec" not in render_fix(UNIT, findings)


def test_a_simple_unit_is_told_timeout_start_sec_does_not_bound_its_load(tmp_path: Path) -> None:
    """Type=simple ends its start at the fork, forking at an unknown point: nothing proposed."""
    learned = saved_starts(tmp_path, [300.0, 360.0, 420.0])
    found = by_code(judge(unit(type="simple"), learned=learned), "start-timeout")
    assert found.severity is Level.OK
    assert found.title.startswith("Type=simple: systemd's start ends before the server is ready")
    assert found.fix == ()
    forking = by_code(judge(unit(type="forking"), learned=learned), "start-timeout")
    assert forking.title.startswith("Type=forking: doctor cannot tell when systemd's start ends")
    assert forking.fix == ()


def test_no_saved_state_or_an_unwatched_unit(tmp_path: Path) -> None:
    """No file yet: says none is learned and where; a unit the daemon does not watch: nothing."""
    learned = learned_starts(tmp_path, UNIT)
    assert learned == LearnedStarts(f"{tmp_path}/units/sglang.service.json")
    found = by_code(judge(unit(), learned=learned), "start-timeout")
    assert found.title == "TimeoutStartSec=10min; no start that came up is learned yet"
    assert not [f for f in judge(unit()) if f.code == "start-timeout"]


def test_a_malformed_saved_start_is_named_and_left_out(tmp_path: Path) -> None:
    """One hand-edited start is left out and said to be; the others still count."""
    document = learn([300.0, 360.0, 420.0])
    document["liveness"]["starts"].append({"invocation_id": "x", "ready_s": -1, "phases": {}})
    state.write_json(state.unit_state_path(tmp_path, UNIT), document)
    learned = learned_starts(tmp_path, UNIT)
    assert learned.ready_s == (300.0, 360.0, 420.0)
    found = by_code(judge(unit(), learned=learned), "start-timeout")
    assert any(line.endswith(": a remembered start is malformed") for line in found.evidence)


def test_one_timeout_start_sec_line_when_the_gate_also_needs_a_longer_one(tmp_path: Path) -> None:
    """TimeoutStartSec=30s below the gate's timeout: the learned proposal covers both findings."""
    findings = judge(unit(timeout_start_s=30.0), learned=saved_starts(tmp_path, [60.0] * 3))
    gate = by_code(findings, "gate-timeout")
    assert gate.fix == ()
    assert gate.evidence == ("the start-timeout fix sets a TimeoutStartSec= that covers it",)
    lines = render_fix(UNIT, findings).splitlines()
    assert [line for line in lines if line.startswith("TimeoutStartSec=")] == [
        "TimeoutStartSec=7min"
    ]


def test_an_infinite_start_timeout_gets_a_proposal_and_a_sufficient_one_is_ok(
    tmp_path: Path,
) -> None:
    """infinity: OK with the proposed line; a timeout above the budget: OK, nothing to change."""
    learned = saved_starts(tmp_path, [300.0, 360.0, 420.0])
    endless = by_code(judge(unit(timeout_start_s=None), learned=learned), "start-timeout")
    assert endless.severity is Level.OK
    assert endless.fix[-1] == "TimeoutStartSec=16min"
    enough = by_code(judge(unit(timeout_start_s=1800.0), learned=learned), "start-timeout")
    assert enough.title == "TimeoutStartSec=30min covers every learned start"
    assert enough.fix == ()


def _decision(result: str, waited_s: float, *, fast: bool = False) -> dict[str, Any]:
    return {"unit": UNIT, "result": result, "fast_path": fast, "waited_s": waited_s}


def test_the_gates_recorded_waits_propose_its_timeout(tmp_path: Path) -> None:
    """Waits of 2-4 min against a 5 min gate timeout: WARNING proposing 6 min 30 s."""
    for decision in [
        _decision("passed", 0.0, fast=True),
        _decision("passed", 120.0),
        _decision("passed", 180.0),
        _decision("passed", 250.0),
        _decision("refused", 300.0),
    ]:
        state.record_gate_decision(tmp_path, UNIT, decision)
    waits = gate_waits(tmp_path, UNIT)
    assert waits == GateWaits(f"{tmp_path}/gate/sglang.service.json", (120.0, 180.0, 250.0), 1)
    found = by_code(judge(unit(), gate_waits=waits), "gate-wait")
    assert found.severity is Level.WARNING
    assert found.evidence[1] == "waits: median 3min, longest 4min 10s"
    assert found.advice is not None
    assert found.advice.startswith("a gate timeout of 390 s")
    few = by_code(judge(unit(), gate_waits=replace(waits, waited_s=(250.0,))), "gate-wait")
    assert few.severity is Level.OK
    assert "too few recorded waits" in few.title


def test_no_gate_decision_recorded_says_nothing_and_output_is_unchanged(tmp_path: Path) -> None:
    """Without learned starts or gate decisions doctor's text is what it was before."""
    assert gate_waits(tmp_path, UNIT) is None
    assert "gate-wait" not in render_text({UNIT: judge(unit())})
