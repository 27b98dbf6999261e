"""The gate's answer names other users' processes to root only (the unit's journal keeps it)."""

from __future__ import annotations

from builders import gpu, inventory, nvml, plan_request, training_job

from gpuguard.core.gate.run import GateSettings, set_blockers
from gpuguard.core.values import MIB

# alice's (uid 1000) training job holds GPU 0 and GPU 1, a second one GPU 1.
FOUND = inventory(
    nvml(gpu(0, (500, 1000)), gpu(1, (500, 1000), (501, 2000))),
    training_job(500, 0, 1, comm="secret-model"),
    training_job(501, 1, comm="secret-model"),
)


def _said(viewer_uid: int | None) -> str:
    settings = GateSettings(plan_request(gpu_set=None), 16 * MIB, 1.0, viewer_uid=viewer_uid)
    return "\n".join(set_blockers(FOUND, settings))


def test_root_is_told_every_holder_by_pid_and_name() -> None:
    """Asked by root (an operator, a root unit), the blockers name PID, name and where it runs."""
    said = _said(None)
    assert "PID 500 (secret-model, training.service)" in said, said
    assert "PID 501 (secret-model, training.service)" in said, said


def test_another_users_asker_gets_counts_not_pids_or_names() -> None:
    """Asked by uid 2000 (a unit's ExecStartPre=), alice's processes are only counted."""
    said = _said(2000)
    assert "500" not in said.replace("1000 MiB", "").replace("3000 MiB", ""), said
    assert "501" not in said, said
    assert "secret-model" not in said, said
    assert "training.service" not in said, said
    assert "GPU 0: 1000 MiB used, held by another user's process" in said, said
    assert "GPU 1: 3000 MiB used, held by 2 processes of other users" in said, said


def test_an_askers_own_processes_are_named_to_it() -> None:
    """Asked by alice's own unit (uid 1000), her processes are named as before."""
    assert "PID 500 (secret-model, training.service)" in _said(1000)
