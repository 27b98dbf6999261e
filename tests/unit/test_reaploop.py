"""The one reap-until-idle loop: each holder signalled once, looked at again until done.

Pure: hand-made inventories and counting twins (the gate, reap and the daemon's sweep run it
with the real adapters in the integration tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from builders import gpu, inventory, nvml, plan_request, process

from gpuguard.core.reaploop import ReapUntilIdle
from gpuguard.core.values import ReapOutcome, ReapResult, ReapTarget

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpuguard.core.inventory import Inventory
    from gpuguard.core.policy import Decision

REQUEST = plan_request(gpu_set=None)
HELD = inventory(nvml(gpu(0, (40, 8000))), process(40, 0))
"""The unit's ended run's server still holding GPU 0: the plan reaps it."""
IDLE = inventory(nvml(gpu(0)))


def _result(decision: Decision) -> ReapResult:
    holder = decision.holder
    target = ReapTarget(holder.identity, holder.ppid, holder.command, None, decision.reason)
    return ReapResult(target, ReapOutcome.EXITED)


def test_a_holder_slow_to_go_is_signalled_once_and_the_loop_ends_when_done_says() -> None:
    """PID 40 outlives its signal for two looks: signalled once, two pauses, done when idle."""
    looks = [HELD, HELD, IDLE]
    signalled: list[list[int]] = []
    pauses: list[None] = []

    def reap(fresh: Sequence[Decision]) -> tuple[ReapResult, ...]:
        signalled.append([d.holder.pid for d in fresh])
        return tuple(_result(d) for d in fresh)

    def done(found: Inventory) -> str | None:
        return "idle" if not found.holders else None

    loop: ReapUntilIdle[str] = ReapUntilIdle(
        REQUEST, lambda: looks.pop(0), lambda: pauses.append(None), done, reap=reap
    )
    assert loop.run(HELD) == "idle"
    assert signalled == [[40]]
    assert [r.target.identity.pid for r in loop.reaped] == [40]
    assert len(pauses) == 2
    assert looks == []


def test_a_result_right_after_the_reap_ends_the_loop_before_it_looks_again() -> None:
    """``after_reap`` (the gate's stuck reap) ends the loop; nothing is gathered after it."""
    gathered: list[None] = []

    def gather() -> Inventory:
        gathered.append(None)
        return HELD

    loop: ReapUntilIdle[str] = ReapUntilIdle(
        REQUEST,
        gather,
        lambda: None,
        lambda _: None,
        reap=lambda fresh: tuple(_result(d) for d in fresh),
        after_reap=lambda results: f"stuck after {len(results)}",
    )
    assert loop.run(HELD) == "stuck after 1"
    assert gathered == []


def test_without_a_reap_the_loop_only_waits() -> None:
    """No ``reap`` (the wait after reap's confirmed plan): it looks again, signalling none."""
    looks = [HELD, IDLE]
    loop: ReapUntilIdle[Inventory] = ReapUntilIdle(
        REQUEST,
        lambda: looks.pop(0),
        lambda: None,
        lambda found: found if not found.holders else None,
    )
    assert loop.run(HELD) is IDLE
    assert loop.reaped == []
