"""The gate loop refuses at once when waiting cannot help, and is never silent while it waits.

Pure: the loop runs against an in-memory clock and hand-made inventories (the integration
tests run the same loop through the CLI over the fake NVML).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from builders import gpu, inventory, lost_gpu, nvml, plan_request, process, training_job

from gpuguard.core.gate.run import GateSettings, reap_targets, run_gate, wait_until_idle
from gpuguard.core.policy import Scope, plan
from gpuguard.core.values import (
    MIB,
    GpuHealth,
    NvmlHealth,
    ProcessIdentity,
    ReapOutcome,
    ReapResult,
    RecoveryAction,
)
from gpuguard.core.xid.faults import XidFault
from gpuguard.core.xid.stuck import XidClaim

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.gate.run import GateOutcome
    from gpuguard.core.inventory import Inventory
    from gpuguard.core.values import GpuReading, ReapTarget

UNIT = "sglang.service"
REQUEST = plan_request(gpu_set=frozenset({0, 1}), protected_names=("nvidia-persistenced",))


JOB = training_job(77, 0)
"""Another unit's live job on GPU 0: the gate never touches it."""


def gathered(
    *gpus: GpuReading, health: NvmlHealth = NvmlHealth.OK, reason: str | None = None
) -> Inventory:
    """What the gate gathers: these GPUs, with the other unit's job as the only process."""
    return inventory(nvml(*gpus, health=health, reason=reason), JOB)


@dataclass
class World:
    """Clock, sleep and gather twins: every sleep advances the clock; gathers come from a script."""

    script: list[Inventory]
    now: float = 0.0
    gathers: int = 0
    sleeps: int = 0
    lines: list[str] = field(default_factory=list)

    def gather(self) -> Inventory:
        """The next scripted inventory; the last one repeats."""
        self.gathers += 1
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def sleep(self, seconds: float) -> None:
        """Advance the clock."""
        self.sleeps += 1
        self.now += seconds

    def clock(self) -> float:
        """The in-memory monotonic clock."""
        return self.now

    def run(self, timeout_s: float = 300.0, faults: tuple[XidFault, ...] = ()) -> GateOutcome:
        """Run the gate over this world."""

        def reap(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
            raise AssertionError(f"nothing here is stale: {targets}")

        settings = GateSettings(REQUEST, 16 * MIB, timeout_s, poll_s=0.5, xid_faults=faults)
        return run_gate(
            settings, self.gather, reap, self.clock, self.sleep, report=self.lines.append
        )


def test_nvml_unavailable_refuses_at_once_in_one_line() -> None:
    """No NVML: no 300 s wait, no sleep at all; the reason is the message."""
    world = World(
        [gathered(health=NvmlHealth.UNAVAILABLE, reason="NVML unavailable: Driver Not Loaded")]
    )
    outcome = world.run()
    assert not outcome.passed
    assert world.sleeps == 0
    message = outcome.message
    assert message == (
        f"start of {UNIT} refused at once: NVML unavailable: Driver Not Loaded. "
        "Waiting cannot help; Restart= retries until the unit's start limit ends it"
        " (gpuguard doctor checks that it does)."
    )
    assert "\n" not in message


def test_a_gpu_of_the_set_lost_while_waiting_refuses_at_the_next_look() -> None:
    """Busy, then GPU 1 falls off the bus: refused then, not at the timeout."""
    busy = gathered(gpu(0, (77, 8000)), gpu(1))
    lost = gathered(gpu(0, (77, 8000)), lost_gpu(1))
    world = World([busy, busy, busy, lost])
    outcome = world.run()
    assert outcome.hopeless
    assert outcome.blockers == ("GPU 1: GPU is lost (fallen off the bus)",)
    assert world.now < 5


def test_a_lost_gpu_outside_the_set_does_not_matter() -> None:
    """GPU 3 lost, the set {0, 1} idle: start allowed."""
    world = World([gathered(gpu(0), gpu(1), gpu(2), lost_gpu(3))])
    outcome = world.run()
    assert outcome.passed


def test_a_gpu_of_the_set_needing_a_reset_refuses_at_once_naming_it() -> None:
    """GPU 1 has a row remap pending and a busy GPU 0: refused now, not after 300 s of waiting."""
    pending = gpu(1, health=GpuHealth(remapped_rows_pending=True))
    world = World([gathered(gpu(0, (77, 8000)), pending)])
    outcome = world.run(timeout_s=300.0)
    assert outcome.hopeless
    assert outcome.blockers == ("GPU 1 needs a reset: a memory row remap is pending",)
    assert world.now < 1
    assert "refused at once: GPU 1 needs a reset" in outcome.message


def test_driver_recovery_action_outside_the_set_or_advisory_does_not_refuse() -> None:
    """A reset asked for GPU 3 (outside the set) or a P2P drain on GPU 0: the start is allowed.

    Unknown health (None everywhere on GPU 1) is not a reason to refuse either.
    """
    reset = GpuHealth(recovery_action=RecoveryAction.GPU_RESET)
    drain = GpuHealth(recovery_action=RecoveryAction.DRAIN_P2P)
    world = World(
        [
            gathered(
                gpu(0, health=drain),
                gpu(1),
                gpu(3, health=reset),
            )
        ]
    )
    assert world.run().passed


def test_a_missing_gpu_of_the_set_refuses_at_once() -> None:
    """The set names GPU 1; NVML shows only GPU 0."""
    outcome = World([gathered(gpu(0))]).run()
    assert outcome.blockers == ("GPU 1 is not present",)
    assert outcome.hopeless


def test_waiting_reports_each_blocker_every_ten_seconds() -> None:
    """35 s of waiting on a foreign job: reports at 10, 20 and 30 s, one line per blocker."""
    world = World([gathered(gpu(0, (77, 8000)), gpu(1))])
    outcome = world.run(timeout_s=35.0)
    assert not outcome.passed
    assert not outcome.hopeless
    assert [line.split(":", 1)[0] for line in world.lines] == [
        "waiting 10 s of 35 s",
        "waiting 20 s of 35 s",
        "waiting 30 s of 35 s",
    ]
    assert all(
        "GPU 0: 8000 MiB used, held by PID 77 (python3, training.service)" in line
        for line in world.lines
    )


def test_a_quick_wait_says_nothing_extra() -> None:
    """Idle after 2 s: no progress lines (only waits past the interval are reported)."""
    busy = gathered(gpu(0, (77, 8000)), gpu(1))
    idle = gathered(gpu(0), gpu(1))
    world = World([busy] * 4 + [idle])
    assert world.run().passed
    assert world.lines == []


def test_waiting_until_idle_looks_again_until_the_set_is_free() -> None:
    """Reap's wait: no reaping, one look per poll, the first idle inventory ends it.

    PID 88, reaped, is still listed by NVML and gone from /proc: its memory is on its way out.
    """
    busy, idle = gathered(gpu(0, (88, 4000)), gpu(1)), gathered(gpu(0), gpu(1))
    world = World([busy, busy, idle])
    settings = GateSettings(REQUEST, 16 * MIB, 60.0, poll_s=0.5)
    last, blockers = wait_until_idle(
        settings, world.gather(), world.gather, world.clock, world.sleep, wait_s=60.0
    )
    assert blockers == ()
    assert last is idle
    assert world.sleeps == 2
    assert world.now == 1.0


def test_waiting_until_idle_gives_up_after_its_time_and_says_what_blocks() -> None:
    """A set that stays busy: the blockers after ``wait_s``, and no look without a wait."""
    busy = gathered(gpu(0, (88, 4000)), gpu(1))
    world = World([busy])
    settings = GateSettings(REQUEST, 16 * MIB, 60.0, poll_s=0.5)
    _, blockers = wait_until_idle(
        settings, world.gather(), world.gather, world.clock, world.sleep, wait_s=3.0
    )
    assert blockers
    assert "GPU 0" in blockers[0]
    assert world.now == 3.0
    _, at_once = wait_until_idle(settings, busy, world.gather, world.clock, world.sleep, wait_s=0.0)
    assert at_once == blockers
    assert world.now == 3.0


def test_waiting_ends_at_once_when_only_holders_the_plan_keeps_remain() -> None:
    """Another unit's live job holds GPU 0 after a reap: no look again, its blockers at once.

    Waiting could free nothing (a shared service's stop-reap waited its whole timeout on a
    tenant's job); a reaped process NVML still lists keeps the wait going (tests above).
    """
    busy = gathered(gpu(0, (77, 4000)), gpu(1))
    world = World([busy])
    settings = GateSettings(REQUEST, 16 * MIB, 60.0, poll_s=0.5)
    last, blockers = wait_until_idle(
        settings, world.gather(), world.gather, world.clock, world.sleep, wait_s=20.0
    )
    assert last is busy
    assert "PID 77" in blockers[0]
    assert "not touched" in blockers[0]
    assert world.sleeps == 0


def test_a_reset_class_xid_on_a_gpu_of_the_set_refuses_at_once_naming_it() -> None:
    """The daemon's Xid 79 on GPU 1's address, NVML healthy and GPU 0 busy: refused now."""
    fault = XidFault("0000:1a:00", 79, "2026-12-01T06:00:00+00:00")
    world = World([gathered(gpu(0, (77, 8000)), gpu(1))])
    outcome = world.run(faults=(fault,))
    assert outcome.hopeless
    assert outcome.blockers == (
        (
            "GPU 1 had Xid 79 (GPU has fallen off the bus) at 2026-12-01T06:00:00+00:00 since "
            "the unit last came up: it needs a reboot (docs/xid.md)"
        ),
    )
    assert world.sleeps == 0


def test_xid_faults_outside_the_set_or_at_unknown_addresses_never_refuse() -> None:
    """GPU 3's Xid (outside {0, 1}) and one for an address NVML does not know: started."""
    faults = (
        XidFault("0000:1c:00", 119, None),
        XidFault("0000:99:00", 79, None),
        XidFault("ffff:ff:ff", 48, "\x1b[2J"),
    )
    world = World([gathered(gpu(0), gpu(1), gpu(2), gpu(3))])
    assert world.run(faults=faults).passed


def test_a_reaped_process_sigkill_leaves_after_an_xid_naming_it_refuses_at_once() -> None:
    """Xid 31 named PID 88 (started 10 s after boot, the Xid at 50 s); SIGKILL leaves it alive.

    The reaper here is a twin: no process outside a driver fault survives SIGKILL. The gate
    refuses at once instead of waiting out its 300 s; without the Xid it would wait.
    """
    left_over = process(
        88, 0, comm="sglang::schedul", cmdline=("sglang::scheduler_TP0",), state="R"
    )
    left_over = replace(left_over, identity=ProcessIdentity(88, 1000))
    busy = inventory(nvml(gpu(0, (88, 8000)), gpu(1)), left_over)
    calls: list[int] = []

    def unkillable(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        calls.extend(t.identity.pid for t in targets)
        return tuple(ReapResult(t, ReapOutcome.UNKILLABLE, ("SIGTERM", "SIGKILL")) for t in targets)

    def run(claims: tuple[XidClaim, ...]) -> tuple[GateOutcome, World]:
        world = World([busy])
        settings = GateSettings(REQUEST, 16 * MIB, 300.0, poll_s=0.5, xid_claims=claims)
        return run_gate(settings, world.gather, unkillable, world.clock, world.sleep), world

    outcome, world = run((XidClaim(31, 88, 50.0, "T"),))
    assert calls == [88]
    assert outcome.hopeless
    assert outcome.blockers == (
        (
            "PID 88 is stuck in the driver after Xid 31 (GPU memory page fault) at T: SIGKILL "
            "did not end it; its GPU needs a reset or a reboot"
        ),
    )
    assert world.now == 0
    younger, world = run((XidClaim(31, 88, 5.0, "T"),))  # the Xid was about an older PID 88
    assert not younger.hopeless
    assert world.now >= 300


def test_the_gpu_the_last_run_ran_out_of_memory_on_is_named_first() -> None:
    """GPU 0 and GPU 1 busy; the last run's cuda:1 is GPU 1: its blocker leads and says so."""
    busy = gathered(gpu(0, (77, 8000)), gpu(1, (77, 4000)))
    world = World([busy])
    settings = GateSettings(REQUEST, 16 * MIB, 1.0, poll_s=0.5, oom=(1, 1))

    def reap(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        raise AssertionError(f"nothing here is stale: {targets}")

    outcome = run_gate(settings, world.gather, reap, world.clock, world.sleep)
    assert not outcome.passed
    assert outcome.blockers[0].startswith("GPU 1: 4000 MiB used")
    assert outcome.blockers[0].endswith(
        "(cuda:1 of the unit: its last run ran out of memory there)"
    )
    assert outcome.blockers[1].startswith("GPU 0: 8000 MiB used")


def test_the_reapers_lines_name_only_system_units() -> None:
    """A holder in a user's own unit named like a watched unit is logged with no unit name."""
    found = inventory(
        nvml(gpu(0, (40, 1000), (41, 1000))),
        process(40, 0, cgroup="/user.slice/user-1000.slice/user@1000.service/app.slice/a.service"),
        process(41, 0, cgroup="/system.slice/a.service"),
    )
    every = plan(found.holders, replace(plan_request(gpu_set=None), scope=Scope.ALL)).decisions
    assert [t.unit for t in reap_targets(every)] == [None, "a.service"]


def test_a_holder_sigkill_has_not_ended_is_dying_not_to_be_reaped() -> None:
    """SIGKILLed and alive (no Xid names it): the wait and the refusal call it dying, once."""
    left_over = process(
        88, 0, comm="sglang::schedul", cmdline=("sglang::scheduler_TP0",), state="D"
    )
    busy = inventory(nvml(gpu(0, (88, 8000)), gpu(1)), left_over)

    def unkillable(targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        return tuple(ReapResult(t, ReapOutcome.UNKILLABLE, ("SIGTERM", "SIGKILL")) for t in targets)

    world = World([busy])
    said: list[str] = []
    settings = GateSettings(REQUEST, 16 * MIB, 30.0, poll_s=0.5)
    outcome = run_gate(
        settings, world.gather, unkillable, world.clock, world.sleep, report=said.append
    )
    assert not outcome.passed
    assert [b for b in outcome.blockers if "PID 88" in b]
    assert all("would be reaped" not in b for b in outcome.blockers)
    assert any("PID 88 (sglang::schedul" in b and "dying: SIGKILLed" in b for b in outcome.blockers)
    assert said
    assert not [line for line in said if "PID 88" in line and "would be reaped" in line]
