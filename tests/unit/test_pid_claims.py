"""NVML's PID is a claim, /proc is the proof; inside a PID namespace memory is judged as a whole.

Pure core: hand-made NVML readings and /proc facts through build_inventory, status, the gate's
blockers and the reap plan.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from builders import STATUS_CONTEXT, gpu, nvml, plan_request, process
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.core.containment import HOST, Containment
from gpuguard.core.gate.run import GateSettings, set_blockers
from gpuguard.core.inventory import build_inventory
from gpuguard.core.levels import Level
from gpuguard.core.policy import Scope, plan
from gpuguard.core.status.document import to_json
from gpuguard.core.status.judge import assess
from gpuguard.core.status.text import render_text
from gpuguard.core.values import MIB, NvmlReading, ProcScan, UnitProvenance

NOW = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)
LXC = Containment(container="lxc", foreign_pids=True, evidence=("/run/systemd/container: lxc",))
UNIT = "/system.slice/sglang.service"
OTHER = "/system.slice/cron.service"


EVERY_GPU = plan_request(gpu_set=None)
"""Unit scope over every GPU, systemd's view known."""


def test_a_listed_pid_is_credited_only_to_a_process_holding_that_gpus_device_file() -> None:
    """PID 300 holds /dev/nvidia0 only: NVML's claim for GPU 1 is not credited to it."""
    inventory = build_inventory(
        nvml(gpu(0, (300, 1000)), gpu(1, (300, 500))), ProcScan((process(300, 0),)), 0
    )
    [holder] = inventory.holders
    assert [(u.gpu_index, u.listed_by_nvml) for u in holder.gpus] == [(0, True)]
    assert [(f.pid, f.gpu_index) for f in inventory.foreign] == [(300, 1)]
    assert inventory.gpus[1].holder_pids == ()


def test_a_colliding_pid_is_named_as_foreign_not_as_missing_from_proc() -> None:
    """On a host, a listed PID /proc has as an unrelated process: critical, with the right words."""
    inventory = build_inventory(nvml(gpu(0, (77, 1000))), ProcScan((process(77),)), 16 * MIB)
    assert inventory.holders == ()
    assert inventory.vanished == ()
    report = assess(inventory, STATUS_CONTEXT, NOW)
    text = render_text(report)
    assert report.level is Level.CRITICAL
    assert "no such process" not in text
    assert (
        "GPU 0: NVML lists PID 77 (1000 MiB), a PID from another PID namespace or a reused one: "
        "PID 77 here is an unrelated process that holds no device file of GPU 0" in text
    )
    assert to_json(report)["foreign"] == [{"pid": 77, "gpu": 0, "used_mib": 1000}]


def test_in_a_container_the_servers_memory_is_its_own_and_not_critical() -> None:
    """Host PIDs in NVML, the server's processes hold the device files: OK, credited as a whole."""
    inventory = build_inventory(
        nvml(gpu(0, (41234, 69492), (41240, 512))),
        ProcScan((process(120, 0, comm="sglang"), process(130, 0, comm="sglang::sched"))),
        16 * MIB,
        LXC,
    )
    report = assess(inventory, STATUS_CONTEXT, NOW)
    text = render_text(report)
    assert report.level is Level.OK, text
    assert inventory.gpus[0].container_bytes == 70004 * MIB
    assert inventory.gpus[0].unattributed_bytes == 0
    assert (
        "GPU 0: 70004 MiB held by processes of this container (per-process amounts not "
        "available: the driver reports host PIDs)" in text
    )
    assert "no visible process explains" not in text
    assert "Host PIDs: GPU 0: NVML lists 41234, 41240" in text
    assert (
        "OK: GPU 0: NVML lists host PIDs 41234 (69492 MiB), 41240 (512 MiB), of another PID "
        "namespace (the driver reports host PIDs)" in text
    )
    assert "Runs: inside a container (lxc), in its own PID namespace" in text
    document = to_json(report)
    assert document["containment"] == {
        "container": "lxc",
        "foreign_pids": True,
        "evidence": ["/run/systemd/container: lxc"],
    }
    assert document["gpus"][0]["container_mib"] == 70004
    assert [v["pid"] for v in document["vanished"]] == [41234, 41240]


def test_in_a_container_memory_nobody_here_holds_is_from_outside_and_blocks_the_gate() -> None:
    """Nothing here holds GPU 1: reported as outside use (a warning), never reaped, gate waits."""
    inventory = build_inventory(nvml(gpu(0), gpu(1, (52000, 30000))), ProcScan(()), 16 * MIB, LXC)
    report = assess(inventory, STATUS_CONTEXT, NOW)
    assert report.level is Level.WARNING
    assert report.headline.startswith("GPU 1: 30000 MiB used from outside this container")
    assert inventory.gpus[1].outside_bytes == 30000 * MIB
    assert plan(inventory.holders, EVERY_GPU).to_reap == ()
    blockers = set_blockers(inventory, GateSettings(EVERY_GPU, 16 * MIB, 1.0))
    assert blockers == (
        "GPU 1: 30000 MiB used",
        (
            "GPU 1: 30000 MiB used from outside this container (another container or the "
            "host), which gpuguard cannot reap"
        ),
    )


def test_in_a_container_a_stale_holder_is_found_by_its_device_file_and_reaped() -> None:
    """An old run's worker moved out of the cgroup: NVML names only host PIDs, /proc finds it."""
    old = process(140, 3, cgroup="/system.slice/operator-shell.scope", comm="sglang::TP3")
    old = replace(old, invocation_id="old-run", uids=(0, 0, 0, 0))
    scan = ProcScan((old,))
    inventory = build_inventory(nvml(gpu(3, (60140, 122205))), scan, 16 * MIB, LXC)
    stale = plan_request(
        gpu_set=None,
        provenance=UnitProvenance(None, frozenset({"old-run"}), 0),
        live_invocation="new-run",
    )
    assert [d.holder.pid for d in plan(inventory.holders, stale).to_reap] == [140]
    blockers = set_blockers(inventory, GateSettings(stale, 16 * MIB, 1.0))
    assert blockers[0].startswith("GPU 3: 122205 MiB used, held by PID 140 (sglang::TP3")
    assert not any("NVML lists PID" in b for b in blockers)


def test_in_a_container_a_colliding_pid_is_neither_credited_nor_planned() -> None:
    """Host PID 77 equals an unrelated container process 77: not a holder, not reaped, OK level."""
    scan = ProcScan((process(77, cgroup=UNIT, comm="sglang-helper"), process(120, 0)))
    inventory = build_inventory(nvml(gpu(0, (77, 1000))), scan, 16 * MIB, LXC)
    assert [h.pid for h in inventory.holders] == [120]
    assert [f.pid for f in inventory.foreign] == [77]
    assert [d.holder.pid for d in plan(inventory.holders, EVERY_GPU).decisions] == [120]
    report = assess(inventory, STATUS_CONTEXT, NOW)
    assert report.level is Level.OK
    assert "Foreign: PID 77 listed by NVML on GPU 0 is not this namespace's PID 77" in render_text(
        report
    )


# --- properties ----------------------------------------------------------------------------

_PIDS = st.integers(min_value=2, max_value=40)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[NvmlReading, ProcScan, Containment]:
    """Up to 3 GPUs with listed PIDs, processes here holding any subset of their device files."""
    n_gpus = draw(st.integers(min_value=1, max_value=3))
    here = draw(st.dictionaries(_PIDS, st.sets(st.integers(0, n_gpus - 1), max_size=3)))
    readings = []
    for index in range(n_gpus):
        listed = draw(st.dictionaries(_PIDS, st.integers(0, 5000), max_size=4))
        extra = draw(st.integers(0, 5000))
        readings.append(gpu(index, *listed.items(), used_mib=sum(listed.values()) + extra))
    scan = ProcScan(tuple(process(pid, *sorted(minors)) for pid, minors in sorted(here.items())))
    containment = draw(st.sampled_from((HOST, LXC)))
    return nvml(*readings), scan, containment


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_every_credited_claim_is_backed_by_the_same_gpus_device_file(
    world: tuple[NvmlReading, ProcScan, Containment],
) -> None:
    """A listed use is only ever credited to a holder of that GPU's device file.

    And every listed PID is accounted for exactly once: credited, foreign or vanished.
    """
    reading, scan, containment = world
    inventory = build_inventory(reading, scan, 16 * MIB, containment)
    for holder in inventory.holders:
        for use in holder.gpus:
            if use.listed_by_nvml:
                assert f"/dev/nvidia{use.gpu_index}" in holder.device_files
            assert use.listed_by_nvml or use.holds_device_file
    credited = {(h.pid, u.gpu_index) for h in inventory.holders for u in h.gpus if u.listed_by_nvml}
    others = [(f.pid, f.gpu_index) for f in inventory.foreign] + [
        (v.pid, v.gpu_index) for v in inventory.vanished
    ]
    claims = [(p.pid, g.index) for g in reading.gpus for p in g.processes]
    assert sorted([*credited, *others]) == sorted(claims)
    here = {f.identity.pid for f in scan.processes}
    assert all(v.pid not in here for v in inventory.vanished)
    assert all(f.pid in here for f in inventory.foreign)


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_nothing_without_a_device_file_is_ever_planned_for_a_reap(
    world: tuple[NvmlReading, ProcScan, Containment],
) -> None:
    """Even with scope ALL: a process here that holds no device file is never a reap target."""
    reading, scan, containment = world
    inventory = build_inventory(reading, scan, 16 * MIB, containment)
    everything = replace(EVERY_GPU, scope=Scope.ALL)
    for decision in plan(inventory.holders, everything).to_reap:
        assert decision.holder.device_files


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_in_a_namespace_used_memory_is_the_containers_or_from_outside_never_unattributed(
    world: tuple[NvmlReading, ProcScan, Containment],
) -> None:
    """Inside a PID namespace memory beyond credited claims is the container's or from outside.

    The container's when some process here holds the GPU, else from outside; never both, never
    unattributed, never CRITICAL.
    """
    reading, scan, _ = world
    inventory = build_inventory(reading, scan, 16 * MIB, LXC)
    for occupancy in inventory.gpus:
        assert occupancy.unattributed_bytes == 0
        held = any(
            f"/dev/nvidia{occupancy.reading.index}" in f.device_files for f in scan.processes
        )
        assert not (occupancy.container_bytes and occupancy.outside_bytes)
        if held:
            assert occupancy.outside_bytes == 0
        else:
            assert occupancy.container_bytes == 0
    report = assess(inventory, STATUS_CONTEXT, NOW)
    assert report.level is not Level.CRITICAL
