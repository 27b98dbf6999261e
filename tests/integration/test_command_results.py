"""The gate's and reap's logic as typed results: real processes, the fake NVML, no captured output.

The commands run in this process (not through ``python -m gpuguard``), so what they decide is
read from the values they return and from what they handed their injected sinks; nothing here
captures stdout or stderr. The wording printed from these values is checked through the real
command line in test_gate_fake_nvml.py.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
from fakeholder import process_gone
from fakestate import fake_library

from gpuguard.adapters import state
from gpuguard.commands import gate, reap
from gpuguard.commands.arguments import GateArgs, ReapArgs
from gpuguard.commands.output import Said
from gpuguard.commands.reap import ReapReport
from gpuguard.config import Settings
from gpuguard.core.cgroup import Attribution
from gpuguard.core.gate.auth import Caller
from gpuguard.unitsettings import UnitSettings

if TYPE_CHECKING:
    from pathlib import Path

    from fakeholder import HolderSpawner

UNIT = "sglang.service"


@pytest.fixture
def settings(
    fake_nvml_dir: Path, fake_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """One watched unit over four fake idle H200s, read by this process's NVML workers."""
    del fake_nvml_dir  # requested so the build happens (and fails) once, up front
    monkeypatch.setenv("FAKENVML_STATE", str(fake_state))
    return Settings(
        units={UNIT: UnitSettings()},
        allow_plain_device_files=True,
        nvml_library=fake_library(),
        device_glob=f"{fake_state}/dev/nvidia*",
        runtime_dir=tmp_path / "run",
        state_dir=tmp_path / "lib",
        reap_grace_s=1.0,
    )


def _reap_args(*, yes: bool = False, as_json: bool = False) -> ReapArgs:
    # Scope all: systemd cannot be asked here, so no uid proves a holder is the unit's and
    # scope patterns would reap nothing; the GPUs are the fake ones, their holders this test's.
    return ReapArgs(
        unit=UNIT, scope="all", dry_run=False, yes=yes, json=as_json, grace=1.0, timeout=10.0
    )


def test_reap_shows_the_plan_then_asks_and_a_no_signals_nothing(
    settings: Settings, fake_state: Path, spawn_holder: HolderSpawner
) -> None:
    """The plan reaches the sink before the question; declined, the result says so, exit 1."""
    holder = spawn_holder(fake_state, gpus=(0,), mib=1000, name="sglang::scheduler_TP0")
    said: list[str] = []

    def decline(question: str) -> bool:
        said.append(f"asked: {question}")
        return False

    result = reap.run(settings, _reap_args(), None, show=said.append, ask=decline)
    assert isinstance(result, Said)
    assert result.exit_status == 1
    assert result.notices == ("gpuguard reap: nothing signalled (confirm on a terminal, or --yes)",)
    assert len(said) == 2, said
    assert f"reap  pid {holder.pid}" in said[0]
    assert said[1] == "asked: Signal 1 process(es)?"
    assert not process_gone(holder.pid)


def test_reap_answered_yes_returns_the_report_of_what_it_did(
    settings: Settings, fake_state: Path, spawn_holder: HolderSpawner
) -> None:
    """A yes signals the holder; the report names it, the GPUs are idle, exit 0; JSON agrees."""
    holder = spawn_holder(fake_state, gpus=(1,), mib=1000, name="sglang::scheduler_TP1")
    shown: list[str] = []
    result = reap.run(
        settings, _reap_args(as_json=True), None, show=shown.append, ask=lambda _q: True
    )
    assert isinstance(result, ReapReport)
    assert shown == []  # --json: no plan text before the document
    assert result.exit_status == 0
    assert [r.target.identity.pid for r in result.results] == [holder.pid]
    assert result.blockers == ()
    document = result.to_json()
    assert document["idle"] is True
    assert [g["used_mib"] for g in document["gpus"]] == [0, 0, 0, 0]
    assert process_gone(holder.pid)


def test_reap_asks_for_the_unit_when_several_are_watched(settings: Settings) -> None:
    """A usage error is a result too (exit 64), decided before anything is gathered."""
    several = settings.model_copy(
        update={"units": {UNIT: UnitSettings(), "b.service": UnitSettings()}}
    )
    args = replace(_reap_args(), unit=None)
    result = reap.run(several, args, None, show=pytest.fail, ask=pytest.fail)
    assert isinstance(result, Said)
    assert result.exit_status == 64
    several_named = "several units are watched; name one with --unit (sglang.service, b.service)"
    assert result.notices == (f"gpuguard reap: {several_named}",)


def test_gate_refusal_is_a_verdict_with_its_blockers_and_its_record(
    settings: Settings, fake_state: Path, spawn_holder: HolderSpawner
) -> None:
    """Someone else's job on the unit's GPUs: refused at the timeout, recorded, exit 1."""
    holder = spawn_holder(fake_state, gpus=(2,), mib=2048, name="python3 train.py")
    args = GateArgs(unit=UNIT, scope="unit", timeout=0.5, grace=1.0)
    progress: list[str] = []
    verdict = gate.run(settings, args, None, None, progress.append)
    assert isinstance(verdict, gate.GateVerdict)
    assert verdict.exit_status == 1
    assert not verdict.outcome.passed
    assert any(str(holder.pid) in blocker for blocker in verdict.outcome.blockers)
    assert verdict.problems == ()
    (line,) = verdict.notices
    assert line.startswith("gpuguard gate: ")
    assert line.endswith(f"[{verdict.gpu_set.describe()}]")
    assert verdict.to_text() == ""
    assert progress == []  # the first progress line is due after 10 s of waiting
    (recorded,) = state.gate_decisions(settings.runtime_dir, UNIT)
    assert recorded["result"] == "refused"
    assert not process_gone(holder.pid)


def test_gate_verdict_stands_when_it_cannot_be_recorded(settings: Settings, tmp_path: Path) -> None:
    """Idle GPUs pass; an unwritable runtime_dir gives a notice, the verdict stands.

    One notice for the record of the decision, and as root (only root records the ledger: the
    file is root's) one for the ledger before it.
    """
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = settings.model_copy(update={"runtime_dir": blocked / "run"})
    args = GateArgs(unit=UNIT, scope="unit", timeout=5.0, grace=1.0)
    verdict = gate.run(unwritable, args, None, None, pytest.fail)
    assert isinstance(verdict, gate.GateVerdict)
    assert verdict.exit_status == 0
    *no_ledger, unrecorded = verdict.problems
    assert len(no_ledger) == (1 if os.geteuid() == 0 else 0)
    assert all(
        line.startswith(f"gpuguard: cannot record {UNIT}'s processes in the provenance")
        for line in no_ledger
    )
    assert unrecorded.startswith(f"gpuguard gate: cannot record the decision in {blocked}")
    assert verdict.notices == (*no_ledger, unrecorded, verdict.notices[-1])
    assert verdict.notices[-1].startswith("gpuguard gate: ")


def test_a_units_own_reap_waits_at_most_gate_timeout_s(
    settings: Settings, fake_state: Path, spawn_holder: HolderSpawner
) -> None:
    """A unit's reap asking 3600 s waits gate_timeout_s, then exit 1 naming what still holds."""
    holder = spawn_holder(fake_state, gpus=(3,), mib=2048, name="python3 train.py")
    capped = settings.model_copy(update={"gate_timeout_s": 0.5})
    own = Caller(
        pid=os.getpid(),
        uid=os.geteuid(),
        attribution=Attribution(unit=UNIT, slice="system.slice"),
        environment=None,
        cgroup=f"/system.slice/{UNIT}",
    )
    args = replace(_reap_args(yes=True), scope="unit", timeout=3600.0)
    done: list[ReapReport | Said] = []
    worker = threading.Thread(
        target=lambda: done.append(reap.run(capped, args, own, show=len, ask=pytest.fail)),
        daemon=True,
    )
    worker.start()
    worker.join(60.0)  # on main it waits the whole hour
    assert done, "reap waited past gate_timeout_s"
    (result,) = done
    assert isinstance(result, ReapReport)
    assert result.exit_status == 1
    assert any(str(holder.pid) in blocker for blocker in result.blockers)
    assert not process_gone(holder.pid)
