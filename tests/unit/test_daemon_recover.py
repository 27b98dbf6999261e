"""The daemon's recovery procedure on its own: stop, free the GPUs, reset-failed, start.

systemd cannot run in a unit test, so the unit is an in-memory twin that answers `systemctl`
verbs the way systemd does (stop takes a few polls; a unit that failed stays "failed" until
reset-failed); the clock, GPUs and the gate's loop are the real pure ones. The root-only
integration tests drive the same procedure through the daemon against real processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from builders import gpu, inventory, nvml, plan_request

from gpuguard.core.gate.run import GateSettings
from gpuguard.core.unitstate import UnitState
from gpuguard.core.values import MIB
from gpuguard.daemon.recover import STOP_WAIT_S, Steps, carry_out

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.values import ReapResult, ReapTarget

UNIT = "sglang.service"


@dataclass
class Unit:
    """systemd's side of one unit: what each verb does to its state, and what was asked."""

    state: str = "active"
    polls_to_stop: int = 2
    refuse: str | None = None
    """A verb systemctl fails on."""
    verbs: list[str] = field(default_factory=list)
    stopping: int = 0

    def control(self, verb: str, unit: str) -> str | None:
        """`systemctl --no-block VERB UNIT`."""
        assert unit == UNIT
        self.verbs.append(verb)
        if verb == self.refuse:
            return f"systemctl {verb} {unit}: Access denied"
        if verb == "stop":
            self.stopping = self.polls_to_stop
        elif verb == "reset-failed":
            self.state = "inactive"
        elif verb == "start":
            self.state = "active"
        return None

    def show(self, unit: str) -> UnitState:
        """`systemctl show UNIT`: a stop lands after ``polls_to_stop`` looks (then "failed")."""
        if self.stopping:
            self.stopping -= 1
            if not self.stopping:
                self.state = "failed"
        return UnitState(unit, active_state=self.state, sub_state="x", load_state="loaded")


@dataclass
class World:
    """Clock and GPUs: every sleep advances the clock; the GPUs free up after ``busy_s``."""

    busy_s: float = 0.0
    now: float = 0.0

    def gather(self) -> Inventory:
        """GPU 0 busy until ``busy_s`` (PID 4242, in NVML only: never stale), idle after."""
        busy = self.now < self.busy_s
        return inventory(nvml(gpu(0, (4242, 4000)) if busy else gpu(0)))

    def sleep(self, seconds: float) -> None:
        """Advance the clock."""
        self.now += seconds

    def clock(self) -> float:
        """The in-memory monotonic clock."""
        return self.now


def steps(unit: Unit, world: World, timeout_s: float = 30.0) -> Steps:
    """The procedure's steps over the twins."""

    def gate_settings(name: str, _inventory: Inventory, _state: UnitState) -> GateSettings:
        request = replace(plan_request(gpu_set=frozenset({0})), unit=name, patterns=())
        return GateSettings(request, 16 * MIB, timeout_s, poll_s=0.5)

    def reap(_unit: str, targets: Sequence[ReapTarget]) -> tuple[ReapResult, ...]:
        raise AssertionError(f"nothing here is stale: {targets}")

    return Steps(
        control=unit.control,
        show_unit=unit.show,
        gather=world.gather,
        gate_settings=gate_settings,
        reap=reap,
        containers=lambda _request: None,
        monotonic=world.clock,
        sleep=world.sleep,
    )


def test_a_recovery_stops_waits_for_idle_resets_and_starts() -> None:
    """The verbs in order, the wait on the GPUs in the record, restarted_at before the start."""
    unit, world = Unit(), World(busy_s=3.0)
    done = carry_out(UNIT, steps(unit, world))
    assert unit.verbs == ["stop", "reset-failed", "start"]
    assert done.problem is None
    assert done.result == "restarted"
    assert done.outcome is not None
    assert done.outcome.passed
    assert done.outcome.waited_s >= 2.0
    assert done.restarted_at == world.now
    record = done.record(())
    assert record == {
        "result": "restarted",
        "problem": None,
        "reaped": [],
        "waited_s": round(done.outcome.waited_s, 2),
    }


def test_gpus_that_stay_busy_fail_the_recovery_and_the_unit_is_started_again() -> None:
    """The gate's blockers are the problem, and the unit it stopped is not left stopped."""
    unit, world = Unit(), World(busy_s=1e9)
    done = carry_out(UNIT, steps(unit, world, timeout_s=5.0))
    assert done.result == "failed"
    assert done.problem is not None
    assert "GPU 0" in done.problem
    assert "started again" in done.problem
    assert unit.verbs == ["stop", "reset-failed", "start"]
    assert unit.state == "active"


def test_a_unit_that_never_stops_is_named_and_never_started() -> None:
    """After STOP_WAIT_S of polling: the problem says so; no reset-failed, no start."""
    unit, world = Unit(polls_to_stop=10**9), World()
    done = carry_out(UNIT, steps(unit, world))
    assert done.problem == f"{UNIT} did not stop within {STOP_WAIT_S:.0f} s"
    assert done.outcome is None
    assert unit.verbs == ["stop"]
    assert done.record(())["waited_s"] is None
    assert world.now >= STOP_WAIT_S


def test_a_refused_stop_is_the_problem_and_nothing_else_is_tried() -> None:
    """Systemctl's own words are the record's problem."""
    unit, world = Unit(refuse="stop"), World()
    done = carry_out(UNIT, steps(unit, world))
    assert done.problem == f"systemctl stop {UNIT}: Access denied"
    assert unit.verbs == ["stop"]
